"""Weight-only int4 / int8 on x86 CPUs: torch's `_weight_int4pack_mm_for_cpu` and
`_weight_int8pack_mm` (`quantization="int4" | "int8"`; GGUF blocks map onto the same
layouts, see `gguf_cpu.py`).

What the kernels compute (checked by tests/test_quantization_cpu.py):

    int4  w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n],  q in 0..15, g = k // group
          `qScaleAndZeros`: [K / group, N, 2] (scale, zero); group 32, 64, 128 or 256;
          the weight packed by `_convert_weight_to_int4pack_for_cpu` (int32 0..15 in,
          [N, K / 2] uint8 out)
    int8  w[n, k] = q[n, k] * scale[n],  q int8, one scale per output row

An asymmetric group (w = q * d + m, q in 0..15: GGUF's Q4_1, or min/max rounding) is
therefore scale = d, zero = m + 8 d; a symmetric one (Q4_0: w = d (q - 8)) is zero = 0.

Both kernels require the scales and the activations in bfloat16: given float32 or float16
activations they run a scalar path 15-40x slower than float32 MKL (docs/notes.md). So a
float32 model casts x to bfloat16 for these GEMMs and the result back (accumulation is
float32 inside); the accuracy this costs is measured in docs/benchmarks.md. They pay off at
decode sizes only (up to `PAGELLM_CPU_QUANT_MAX_ROWS` rows, 4: at 8+ rows they are slower than MKL's
float32 GEMM), so a `CpuQuantizedWeight` also keeps the dequantized weight, packed as an
unquantized layer's would be, for larger batches (prefill chunks): the model is the same
quantized model at every batch size, only the kernel and the activation rounding differ.
"""

from __future__ import annotations

import logging
import platform

import torch
import torch.nn.functional as F

from pagellm import envs
from pagellm.kernels.cpu_gemm import PackedWeight, cpu_prepack_supported
from pagellm.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizedWeight,
    drop_params,
    param_bytes,
)
from pagellm.utils import physical_memory_bytes

logger = logging.getLogger(__name__)
INT4_GROUP = 32  # weights per (scale, zero): GGUF's block size; the kernel allows 32..256


def cpu_int_supported() -> bool:
    """Whether the int kernels are fast here: x86 with AVX512-BF16 (or AMX)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def dense_weight(weight: torch.Tensor):
    """F.linear on `weight` [out, in], packed for MKL / oneDNN where the runner would pack an
    unquantized layer (see `pagellm.kernels.cpu_gemm.PackedWeight`)."""
    if cpu_prepack_supported(weight.device, weight.dtype):
        return PackedWeight(weight, batch_hint=256)
    return lambda x, bias=None: F.linear(x, weight, bias)


class DenseCopies:
    """Whether one model's CPU quantized layers keep a dequantized copy beside their blocks
    for batches beyond the block kernel's rows (prefill chunks), decided once for the model
    from what every copy would take (`count`, as the layers are built) against this machine's
    memory (PAGELLM_CPU_QUANT_DENSE_COPY, `pagellm.envs`). A copy makes those batches ~1.3x
    faster at 64-row chunks (less at larger ones) than dequantizing each layer into one
    reused buffer per batch, at 4.5 (float32) or 2.5 (bf16) bytes a weight against the
    blocks' ~0.6: a Llama-3.1-8B checkpoint's copies are ~29 GB in float32
    (docs/notes.md, "The dequantized copy's memory")."""

    FRACTION = 0.25  # auto: copies kept while they take at most this share of the memory

    def __init__(self) -> None:
        self.bytes = 0  # every counted layer's copy
        self._keep: bool | None = None

    def count(self, n: int, k: int, dtype: torch.dtype) -> None:
        self.bytes += n * k * dtype.itemsize

    def keep(self) -> bool:
        """Decided (and logged) at the first call, once every layer has been counted."""
        if self._keep is None:
            self._keep = self._decide()
        return self._keep

    def _decide(self) -> bool:
        mode = envs.cpu_quant_dense_copy()
        if mode != "auto" or not self.bytes:
            return mode != "0"
        ram = physical_memory_bytes()
        keep = self.bytes <= self.FRACTION * ram
        if not keep:
            logger.info(
                "CPU quantized layers: no dequantized copies (they would take %.1f GiB, over "
                "a quarter of this machine's %.1f GiB): batches beyond the block kernel's rows "
                "dequantize each layer as they run it; PAGELLM_CPU_QUANT_DENSE_COPY=1 keeps "
                "them", self.bytes / 2**30, ram / 2**30,
            )  # fmt: skip
        return keep


def int4_scales_zeros(scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """`qScaleAndZeros` [K / group, N, 2] bfloat16 for w = q * scale + low (scale, low:
    [N, K / group], q in 0..15)."""
    zero = low.float() + 8.0 * scale.float()
    sz = torch.stack([scale.float(), zero], dim=-1)  # [N, K / group, 2]
    return sz.transpose(0, 1).to(torch.bfloat16).contiguous()


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """w = q * scale + low in float32: [N, K] (scale, low: [N, K / group])."""
    n, k = q.shape
    g = q.view(n, scale.shape[1], -1).float() * scale[..., None].float() + low[..., None].float()
    return g.view(n, k)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max rounding per group: (q int32 [N, K] in 0..15, scale, low
    [N, K / group]) with w ~ q * scale + low."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15.0).clamp(min=1e-10)
    q = ((g - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    return q.view(n, k).to(torch.int32), scale, low


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output row: (q int8 [N, K], scale float32 [N]) with w ~ q * scale."""
    scale = (w.float().abs().amax(-1) / 127.0).clamp(min=1e-10)
    q = (w.float() / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


class CpuQuantizedWeight(QuantizedWeight):
    """An int4 / int8 weight for small batches, its dequantized copy for large ones."""

    def __init__(self, small, dense, out_features: int) -> None:
        self.small = small  # bfloat16 x [T, in] -> bfloat16 [T, out]
        self.dense = dense  # x [T, in], bias -> [T, out] in x's dtype
        self.out_features = out_features
        self.max_rows = envs.cpu_quant_max_rows(4)  # beyond: float32 MKL is faster

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if x.shape[0] > self.max_rows:
            return self.dense(x, bias)
        y = self.small(x.to(torch.bfloat16)).to(x.dtype)
        return y if bias is None else y.add_(bias)


def int4_weight(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dense: torch.Tensor):
    """A `CpuQuantizedWeight` for w = q * scale + low (q int32 [N, K] in 0..15; scale, low
    [N, K / group]); `dense` [N, K] is w in the model dtype, for large batches."""
    group = q.shape[1] // scale.shape[1]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 8)
    sz = int4_scales_zeros(scale, low)

    def small(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)

    return CpuQuantizedWeight(small, dense_weight(dense), q.shape[0])


def int8_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """A `CpuQuantizedWeight` for w = q * scale (q int8 [N, K], scale [N])."""
    scale_bf16 = scale.to(torch.bfloat16)

    def small(x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, q, scale_bf16)

    dense = dense_weight((q.float() * scale.float()[:, None]).to(dtype))
    return CpuQuantizedWeight(small, dense, q.shape[0])


def float_weight_to_int(weight: torch.Tensor, bits: int):
    """Quantize a float weight [N, K] (int4: groups of `INT4_GROUP` along K)."""
    if bits == 4:
        q, scale, low = quantize_int4(weight, INT4_GROUP)
        return int4_weight(q, scale, low, dequantize_int4(q, scale, low).to(weight.dtype))
    return int8_weight(*quantize_int8(weight), weight.dtype)


class FloatToIntMethod(LinearMethod):
    """Quantize a Linear's loaded float weight to int4 / int8."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def process_weights_after_loading(self, layer) -> None:
        layer.packed_weight = float_weight_to_int(layer.weight.detach(), self.bits)
        drop_params(layer, "weight")

    def weight_bytes(self, layer) -> int:
        # the float weight's dequantized copy (as large as the weight) and the int form
        n, k = layer.out_features, layer.in_features
        small = int4_bytes(n, k) if self.bits == 4 else n * k + 2 * n  # int8: bf16 scales
        return param_bytes(layer) + small


def int4_bytes(n: int, k: int) -> int:
    """An int4 weight [n, k] packed for torch's kernel: two values a byte, and a bfloat16
    (scale, zero) pair per group of `INT4_GROUP`."""
    return n * k // 2 + (k // INT4_GROUP) * n * 2 * 2


def int4_fits(in_features: int) -> bool:
    return in_features % INT4_GROUP == 0


class CpuIntConfig(QuantizationConfig):
    """Every Linear and the tied LM head in int4 or int8; embeddings stay in the model dtype
    (a lookup reads a few rows)."""

    bits: int

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.name = f"int{bits}"

    @classmethod
    def from_model(cls, model_config, device: torch.device, checkpoint=None) -> CpuIntConfig:
        return cls(4 if model_config.quantization == "int4" else 8)

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        if self.bits == 4 and not int4_fits(layer.in_features):
            return None  # stays in the model dtype
        return FloatToIntMethod(self.bits)

    def tied_head_weight(self, embedding: torch.Tensor) -> QuantizedWeight | None:
        if self.bits == 4 and not int4_fits(embedding.shape[1]):
            return None
        return float_weight_to_int(embedding.detach(), self.bits)
