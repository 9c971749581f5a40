"""Imports point down, and no module imports itself back through others.

The package is a house of floors; a module imports modules of its own floor or of those
below it, never above, at the top of the file or inside a function. From the bottom:

    base          utils, envs, logger, cpp_build, kv_cache_dtype, kv_cache_size, tracing,
                  sandbox and sandbox_worker; the data that crosses boundaries: outputs,
                  sampling_params, pooling_params, structured_output/params, protocol
                  (caller <-> core), core/sched_output (scheduler -> runner), lora/request
    config        config/: plain dataclasses (EngineConfig and its parts, HFConfigView)
    kernels       kernels/: Triton and C++ kernels with their Python wrappers, CPU GEMMs
    backends      attention/, distributed/, quantization/ (finds `Linear`s through a slot)
    layers        layers/: linear, norms, rotary, embeddings, the attention layer, MoE;
                  lora/layers (a Linear's LoRA delta)
    models        models/: one file a family, the registry, checkpoint names
    loader        loader/: checkpoint files, configs and tokenizers, `load_model()`;
                  lora/peft (adapter folders)
    sampling      sample/, structured_output/, spec_decode/ (draft proposers)
    worker        worker/: the model runner; lora/slots (its adapter slots)
    executor      executor/
    core          core/: the scheduler, KV blocks, requests
    engine        engine/: EngineArgs (arg_utils), the EngineCore, its clients, I/O
    entrypoints   entrypoints/: LLM, the OpenAI server
    top           cli.py, benchmarks/, __main__.py, the package's facade (__init__.py)

Imports inside `if TYPE_CHECKING:` are left out: they are annotations, never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagellm

ROOT = Path(pagellm.__file__).parent

BASE = (
    "pagellm.utils",
    "pagellm.envs",
    "pagellm.logger",
    "pagellm.cpp_build",
    "pagellm.kv_cache_dtype",
    "pagellm.kv_cache_size",
    "pagellm.tracing",
    "pagellm.sandbox",
    "pagellm.sandbox_worker",
    "pagellm.outputs",
    "pagellm.sampling_params",
    "pagellm.pooling_params",
    "pagellm.structured_output.params",
    "pagellm.protocol",
    "pagellm.core.sched_output",
    "pagellm.lora",
    "pagellm.lora.request",
)
FLOORS = (
    BASE,
    ("pagellm.config",),
    ("pagellm.kernels",),
    ("pagellm.attention", "pagellm.distributed", "pagellm.quantization"),
    ("pagellm.layers", "pagellm.lora.layers"),
    ("pagellm.models",),
    ("pagellm.loader", "pagellm.lora.peft"),
    ("pagellm.sample", "pagellm.structured_output", "pagellm.spec_decode"),
    ("pagellm.worker", "pagellm.lora.slots"),
    ("pagellm.executor",),
    ("pagellm.core",),
    ("pagellm.engine",),
    ("pagellm.entrypoints",),
    ("pagellm.cli", "pagellm.benchmarks", "pagellm.__main__", "pagellm"),
)


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imported_names(tree: ast.AST) -> list[str]:
    """Dotted names a module imports where they run (`from a import b` gives a.b and a)."""
    names: list[str] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if _is_type_checking(node):
            todo += node.orelse
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        todo += ast.iter_child_nodes(node)
    return names


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module a dotted import name lands in (the longest module prefix)."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = (_resolve(n, modules) for n in _imported_names(ast.parse(path.read_text())))
        # `import pagellm` itself (its __file__, __version__) runs with any submodule's import
        graph[name] = {t for t in targets if t not in (None, name, "pagellm")}
    return graph


def floor(module: str) -> int:
    """The floor of a module: the one of its longest listed prefix."""
    best, level = "", None
    for index, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, index
    assert level is not None, f"{module} is on no floor: add it to FLOORS"
    return level


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if floor(target) > floor(module)
    )


def test_every_module_is_on_a_floor():
    graph = import_graph()
    assert len(graph) > 100
    for module in graph:
        floor(module)


def test_imports_point_down():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []
