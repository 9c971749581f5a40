"""Every import in the package names something that exists, those inside functions too.

An import inside a function runs only when its branch does: one on a CUDA-only path (CUDA
graphs, the fp8 kernels, the Triton backend) is never executed by the CPU suite, so a module
moved or a name renamed would fail first on a GPU. This test resolves each one statically:
the module is imported (none of pagellm's modules needs a GPU to import) and the name looked
up in it, as a submodule or an attribute.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pagellm

ROOT = Path(pagellm.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(source: str, package: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of each pagellm import in a module of `package`, relative
    ones resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name, None) for a in node.names if a.name.startswith("pagellm")
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("pagellm"):
                found += [(node.lineno, module, a.name) for a in node.names if a.name != "*"]
    return found


def _resolves(module: str, name: str | None) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    if name is None:
        return True
    imported = importlib.import_module(module)
    if hasattr(imported, name):
        return True
    return (
        hasattr(imported, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
    )


def test_every_import_in_the_package_resolves():
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 100
    broken = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {name or module} from {module}"
        for path in files
        for line, module, name in _imports(path.read_text(), _package(path))
        if not _resolves(module, name)
    ]
    assert broken == []


def test_a_broken_import_is_found():
    """The check itself: a moved module and a renamed name are both reported."""
    source = (
        "def f():\n"
        "    from pagellm.models.no_such_module import x\n"
        "    from pagellm.sampling_params import NoSuchName\n"
        "    from .core import EngineCore\n"
        "    import pagellm.engine.no_such_module\n"
    )
    found = [(m, n) for _, m, n in _imports(source, "pagellm.engine")]
    assert found[2] == ("pagellm.engine.core", "EngineCore")
    assert [_resolves(m, n) for m, n in found] == [False, False, True, False]
