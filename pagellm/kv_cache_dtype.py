"""The KV cache's storage precision: `kv_cache_dtype` (vLLM's names) and fp8 scales.

`"auto"` stores K/V in the model's dtype. `"fp8"` / `"fp8_e4m3"` store float8 e4m3 (max 448,
3 mantissa bits), `"fp8_e5m2"` float8 e5m2 (max 57344, 2 mantissa bits): half the bytes of
bf16, so twice the blocks in the same budget.

An fp8 layer has two per-tensor scales, `kv_scale = [k_scale, v_scale]` (float32, on the
device, one pair per attention layer, so each tensor-parallel rank keeps its own copy):

    stored = clamp(k / k_scale, -max, max) as fp8        (written by reshape_and_cache)
    k ~= stored * k_scale                                 (read by the attention)

Attention never multiplies the keys back: q.k * scale becomes q.stored * (scale * k_scale), and
the output, a convex mix of stored values, is multiplied by v_scale once. Scales are 1.0 unless
the checkpoint has them (`...self_attn.k_scale`, `.v_scale`, the older `.kv_scale` for both,
`...self_attn.k_proj.k_scale` / `.v_proj.v_scale`) or `calculate_kv_scales=True` computes them
from the first batch as vLLM does: amax(|k|) / 200 and amax(|v|) / 100 (room to spare for
later tokens larger than the first batch's; beyond the fp8 range values saturate).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
K_SCALE_CONSTANT = 200.0  # calculate_kv_scales: k_scale = amax(|k|) / this
V_SCALE_CONSTANT = 100.0

# checkpoint name suffix (after `...self_attn`) -> which scales it sets (0: k, 1: v)
_CHECKPOINT_SCALES = {
    "k_scale": (0,),
    "v_scale": (1,),
    "kv_scale": (0, 1),
    "k_proj.k_scale": (0,),
    "v_proj.v_scale": (1,),
    "attn.k_scale": (0,),
    "attn.v_scale": (1,),
}


def check_kv_cache_dtype(name: str) -> None:
    if name != "auto" and name not in KV_CACHE_DTYPES:
        choices = ", ".join(repr(n) for n in ["auto", *KV_CACHE_DTYPES])
        raise ValueError(f"kv_cache_dtype must be one of {choices}, got {name!r}")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for `kv_cache_dtype` `name`."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale, saturated to the fp8 range, as `dtype` (torch rounds to nearest even)."""
    fp8_max = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp_(-fp8_max, fp8_max).to(dtype)


def first_batch_scales(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[k_scale, v_scale] from one batch's K/V (float32, on their device; never 0)."""
    amax = torch.stack([k.abs().amax().float(), v.abs().amax().float()])
    consts = torch.tensor([K_SCALE_CONSTANT, V_SCALE_CONSTANT], device=amax.device)
    return (amax / consts).clamp_min_(torch.finfo(torch.float32).tiny)


def checkpoint_kv_scale(hf_name: str) -> tuple[str, tuple[int, ...]] | None:
    """(the `self_attn` module's name, indices into kv_scale) for a KV-scale tensor's name;
    None for any other tensor."""
    owner, sep, suffix = hf_name.rpartition(".self_attn.")
    if not sep or suffix not in _CHECKPOINT_SCALES:
        return None
    return f"{owner}.self_attn", _CHECKPOINT_SCALES[suffix]
