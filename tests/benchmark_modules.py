"""Scripts of benchmarks/ that tests share (their prompt sets and measures), imported by
file path. benchmarks/ is never put on sys.path: its kernels.py would shadow the `kernels`
package, which transformers imports lazily (an ImportError far from the cause)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module `pagellm_benchmarks_<name>` (loaded once)."""
    key = f"pagellm_benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(BENCHMARKS, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before exec: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[key]
