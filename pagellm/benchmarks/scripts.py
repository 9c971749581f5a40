"""A benchmark script of the checkout imported by its path: benchmarks/ is never put on
sys.path (a script named like a package would shadow it: `benchmarks/kernels.py` once hid
the `kernels` package that transformers imports lazily, an ImportError far from the cause).
Scripts and tests share their workloads this way."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def load_script(path: str | os.PathLike, name: str) -> ModuleType:
    """The file at `path` as the module `name` (loaded once; registered before it runs, as
    dataclasses look their module up)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
