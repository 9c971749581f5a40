"""The package's C++ CPU kernels (`pagellm/csrc/*.cpp`), compiled on first use.

Each source includes only ATen's thread pool from torch, so it compiles in about a second
with the system's C++ compiler (`-O3 -march=native`, torch's OpenMP runtime), into
PAGELLM_CACHE_DIR, keyed by the source, torch's version and the CPU's flags, and is loaded
with ctypes. A build at install time is not possible with the README's one pip command:
torch is not installed yet when the package is built. Callers treat `OSError` /
`SubprocessError` from `load` (no compiler, a failed build) as "this kernel is not here"
and take their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagellm import envs
from pagellm.utils import cpuinfo_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC"]


def load(name: str) -> ctypes.CDLL:
    """`pagellm/csrc/<name>.cpp` as a loaded library (built first if not cached)."""
    return ctypes.CDLL(str(build(name)))


def entry_point(name: str, symbol: str, argtypes: list, restype, instead: str):
    """The C function `symbol` of `pagellm/csrc/<name>.cpp` with its ctypes signature, or
    None where the library cannot be built or loaded here (logged with what is done
    `instead`)."""
    try:
        fn = getattr(load(name), symbol)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernel %s unavailable (%s): %s", name, e, instead)
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def build(name: str) -> Path:
    """The shared library of `pagellm/csrc/<name>.cpp` for this torch and CPU."""
    source = CSRC / f"{name}.cpp"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler (c++, g++ or $CXX)")
    torch_dir = Path(torch.__file__).parent
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    lib_dir = torch_dir / "lib"
    cmd = [compiler, *FLAGS, abi, f"-I{torch_dir / 'include'}", str(source)]
    cmd += [f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]
    key = hashlib.sha256(source.read_bytes())
    for header in sorted(CSRC.glob("*.h")):  # the sources' shared headers
        key.update(header.read_bytes())
    key.update(" ".join([*cmd, torch.__version__, *sorted(cpuinfo_flags())]).encode())
    out = Path(envs.cache_dir()) / "cpu_kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # then one atomic rename
        subprocess.run([*cmd, "-o", f"{tmp}/k.so"], check=True, capture_output=True, timeout=300)
        os.replace(f"{tmp}/k.so", out)
    logger.info("built the CPU kernel %s: %s", name, out)
    return out
