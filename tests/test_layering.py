"""Arrows point down: the lower floors never import the engine, the entrypoints or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pagellm

LOWER = ("core", "worker", "models", "attention", "kernels")
UPPER = ("pagellm.engine", "pagellm.entrypoints", "pagellm.cli")


def _imports(path: Path) -> list[str]:
    """Every module a file imports, at the top or inside a function."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_lower_floors_do_not_import_upper_ones():
    root = Path(pagellm.__file__).parent
    files = [p for floor in LOWER for p in sorted((root / floor).rglob("*.py"))]
    assert len(files) > 20
    upward = [
        f"{path.relative_to(root.parent)} imports {name}"
        for path in files
        for name in _imports(path)
        if name.startswith(UPPER)
    ]
    assert upward == []
