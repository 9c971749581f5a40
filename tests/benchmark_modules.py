"""Scripts of benchmarks/ that tests share (their prompt sets and measures), imported by
file path. benchmarks/ is never put on sys.path: a script named like a package would shadow it
(`pagellm.benchmarks.scripts`)."""

from __future__ import annotations

import os
from types import ModuleType

from pagellm.benchmarks.scripts import load_script

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module `pagellm_benchmarks_<name>` (loaded once)."""
    return load_script(os.path.join(BENCHMARKS, f"{name}.py"), f"pagellm_benchmarks_{name}")
