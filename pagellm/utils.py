"""Small helpers shared across layers of the engine."""

from __future__ import annotations

import functools
import subprocess

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for the device: on CUDA through pinned memory
    and a non-blocking copy (a plain `.to(device)` synchronizes the stream, which would stall
    async scheduling until the step in flight is done)."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@functools.cache
def cpu_bf16_units() -> str | None:
    """The CPU's bfloat16 matrix hardware, "AMX" or "AVX512-BF16"; None without either
    (bf16 would then run through float32 conversions: slower than float32 itself)."""
    checks = (("AMX", "_is_amx_tile_supported", "amx_bf16"),
              ("AVX512-BF16", "_is_avx512_bf16_supported", "avx512_bf16"))  # fmt: skip
    for name, probe, flag in checks:
        supported = getattr(torch.cpu, probe, None)
        if supported is not None and supported():
            return name
        if supported is None and flag in cpuinfo_flags():
            return name
    return None


@functools.cache
def cpuinfo_flags() -> frozenset[str]:
    """The CPU's feature flags (read once: they do not change while we run)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def physical_memory_bytes() -> int:
    """This machine's physical memory (what the CPU's weights and KV cache must fit in)."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    """Give `proc` `timeout` seconds to exit, then SIGKILL it; either way it is reaped (no
    zombie left behind). For a child already asked to stop (SHUTDOWN, stdin closed, SIGTERM)
    that may be stuck where no handler runs."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_weights(folder: str, stem: str, what: str) -> dict[str, torch.Tensor] | None:
    """The tensors of `<stem>.safetensors` in `folder`, else of `<stem>.bin` (a torch pickle,
    loaded with weights_only): None where neither file is there; a ValueError naming `what`
    where the one there cannot be read (corrupt, or not a dict of tensors)."""
    import os

    st, pt = os.path.join(folder, f"{stem}.safetensors"), os.path.join(folder, f"{stem}.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(pt):
            tensors = torch.load(pt, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict):
                raise ValueError("not a dict of tensors")
            return tensors
    except Exception as e:  # a corrupt or foreign file (SafetensorError, UnpicklingError, ...)
        raise ValueError(f"{what}: its weights cannot be read ({type(e).__name__}: {e})") from None
    return None
