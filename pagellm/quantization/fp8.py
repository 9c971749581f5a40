"""`quantization="fp8"`: float8 e4m3 weights (LM head and embeddings stay in the model dtype).

Where the weights come from:

    a bf16 / fp16 checkpoint (or dummy weights)  quantized at load: one scale per output row,
                                                 amax / 448
    `quantization_config.quant_method: "fp8"`    as stored: `weight` fp8 + `weight_scale`
                                                 (per tensor) or, with `weight_block_size:
                                                 [128, 128]` (Qwen3-FP8, DeepSeek-V3),
                                                 `weight_scale_inv` per 128x128 block
    `quant_method: "compressed-tensors"`,        `weight` fp8 + `weight_scale` per channel
    format "float-quantized"                     ([N, 1]), per tensor, or per block

A per-tensor scale becomes one per row (fused q|k|v parts keep their own); static activation
scales (`input_scale`) are read and dropped: activations are scaled per token, dynamically.
MoE experts on CUDA stay fp8 (or are quantized at load), stacked by expert, for the fused MoE
kernel with fp8 weights (`fp8_moe.py`); on the CPU an fp8 checkpoint's expert projections
are dequantized at load (`pagellm.layers.moe_weights`). Routers stay in the model dtype
(`Linear.quantizable`).

On CUDA (`Fp8Weight`): GEMMs of up to `MAX_TRITON_ROWS` rows (decode) run the weight-only
Triton kernel (`pagellm/kernels/fp8_gemm.py`: bf16 activations, the weight streamed once);
larger ones quantize the activations per token (per 128 columns for block weights) and run
`torch._scaled_mm` (per-row weights) or the block-scaled Triton kernel. Where the model hands
the op before a GEMM its weight (`quant_for`: the RMSNorms of Llama-family decoder layers,
SiLU-and-mul in `GatedMLP`), that op's kernel writes the quantized input itself
(`input_quantization`, `QuantizedActivation`): one kernel and one pass over x fewer.

On the CPU fp8 checkpoints are dequantized at load to the model dtype (there is no fp8 GEMM
on CPUs; this keeps fp8 checkpoints usable there, at the dequantized speed and memory); asking
for `quantization="fp8"` on a CPU with an unquantized checkpoint is a ValueError.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from pagellm.quantization.base import (
    ExpertsMethod,
    LinearMethod,
    QuantizationConfig,
    QuantizedActivation,
    QuantizedWeight,
    checkpoint_names,
    drop_params,
    param_bytes,
    quant_config_dict,
    replace_param,
)

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # the only block size the kernels take (every public fp8 block checkpoint's)
MAX_TRITON_ROWS = 16  # decode sizes: weight-only Triton; above: w8a8 (see gemm_config)


def quantize_weight_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], float32 scale [N]) with w ~ q * scale, scale = amax(row) / 448."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from an fp8 weight and its per-row [N] or 128x128-block scales
    [ceil(N / 128), ceil(K / 128)] (the reference the kernels are tested against)."""
    if scale.dim() < 2:
        return w.float() * scale.float().reshape(-1, 1)
    n, k = w.shape
    full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return w.float() * full[:n, :k]


class Fp8Weight(QuantizedWeight):
    """An fp8 weight [N, K] with per-row [N] or block scales, on CUDA."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        from pagellm.kernels import fp8_gemm

        self.kernels = fp8_gemm
        self.weight = weight  # [N, K] fp8, K contiguous
        self.scale = scale.float().contiguous()
        self.block = BLOCK if scale.dim() == 2 else None
        self.scale_row = None if self.block else self.scale.view(1, -1)  # for _scaled_mm

    def __call__(
        self, x: torch.Tensor | QuantizedActivation, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # x: [T, K] bf16 (or already quantized) -> [T, N]
        if isinstance(x, QuantizedActivation):
            return self.quantized_matmul(x.q, x.scale, bias, x.dtype)
        if x.shape[0] <= MAX_TRITON_ROWS:
            return self.kernels.fp8_gemm(x, self.weight, self.scale, bias, out_dtype=x.dtype)
        xq, x_scale = self.kernels.quantize_fp8(x, self.block)
        return self.quantized_matmul(xq, x_scale, bias, x.dtype)

    def input_quantization(self, rows: int) -> int | None:
        # w8a8 above the decode sizes: per token (per-row weights), per 128 columns (block)
        return None if rows <= MAX_TRITON_ROWS else self.block or 0

    def quantized_matmul(self, xq, x_scale, bias, out_dtype: torch.dtype) -> torch.Tensor:
        """The w8a8 GEMM of an fp8 x [T, K] with its scales ([T, 1] or [T, K / 128])."""
        if self.block:
            return self.kernels.fp8_gemm(xq, self.weight, self.scale, bias, x_scale, out_dtype)
        if bias is not None and out_dtype == torch.float32:
            # CUDA's _scaled_mm adds no bias to a float32 output
            return self.quantized_matmul(xq, x_scale, None, out_dtype) + bias
        return torch._scaled_mm(
            xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale_row, bias=bias,
            out_dtype=out_dtype,
        )  # fmt: skip

    def silu_and_mul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        # one row (batch-1 decode): the GEMV's epilogue pairs gate row j with up row j
        if x.shape[0] != 1:
            return None
        return self.kernels.fp8_gemm(
            x, self.weight, self.scale, bias, out_dtype=x.dtype, gated=True
        )

    def qkv_rotary_into_cache(
        self, x, bias, cos_sin, num_heads, num_kv_heads, kv_cache, slot_mapping, kv_scale
    ) -> torch.Tensor | None:
        # one row (batch-1 decode): rotary and the cache write in the GEMV's epilogue
        if x.shape[0] != 1:
            return None
        return self.kernels.fp8_gemv_qkv(
            x, self.weight, self.scale, bias, cos_sin, num_heads, num_kv_heads, kv_cache,
            slot_mapping, kv_scale,
        )  # fmt: skip


class Fp8LinearMethod(LinearMethod):
    """fp8 weights for one Linear: quantized at load (`scheme` None) or loaded as stored
    ("tensor" | "channel" | "block" scales); dequantized instead where `dequantize`."""

    def __init__(
        self, scheme: str | None, dequantize: bool, dtype: torch.dtype, block_scale_name: str
    ) -> None:
        self.scheme = scheme
        self.dequantize = dequantize
        self.dtype = dtype  # the model's: dequantized weights are in it
        self.block_scale_name = block_scale_name  # "weight_scale_inv" (fp8) | "weight_scale"

    def create_weights(self, layer) -> None:
        if self.scheme is None:  # the float weight is loaded, then quantized
            return
        n, k = layer.out_features, layer.in_features
        replace_param(layer, "weight", (n, k), FP8)
        if self.scheme == "block":
            _check_block_shards(layer)
            shape = (-(-n // BLOCK), -(-k // BLOCK))
            replace_param(layer, self.block_scale_name, shape, torch.float32)
            return
        fused = bool(getattr(layer, "shard_rows", None))
        shape = (n,) if self.scheme == "channel" or fused else ()
        replace_param(layer, "weight_scale", shape, torch.float32)

    def process_weights_after_loading(self, layer) -> None:
        weight = layer.weight.detach()
        if self.scheme is None:
            q, scale = quantize_weight_per_row(weight)
        elif self.scheme == "block":
            q, scale = weight, getattr(layer, self.block_scale_name).detach()
        else:
            q, scale = weight, layer.weight_scale.detach().expand(layer.out_features)
        drop_params(layer, "weight_scale", "weight_scale_inv")
        if self.dequantize:
            dense = dequantize_fp8(q, scale).to(self.dtype)
            layer.weight = nn.Parameter(dense, requires_grad=False)
            return
        layer.packed_weight = Fp8Weight(q.contiguous(), scale)
        drop_params(layer, "weight")

    def weight_bytes(self, layer) -> int:
        # fp8 values and float32 scales (a row's, or a 128x128 block's), or dequantized
        n, k = layer.out_features, layer.in_features
        rest = param_bytes(layer, but=("weight", "weight_scale", "weight_scale_inv"))
        if self.dequantize:
            return rest + n * k * self.dtype.itemsize
        scales = -(-n // BLOCK) * -(-k // BLOCK) if self.scheme == "block" else n
        return rest + n * k + 4 * scales


def _check_block_shards(layer) -> None:
    for name, (start, end) in (getattr(layer, "shard_rows", None) or {}).items():
        if start % BLOCK or (end % BLOCK and end != layer.out_features):
            raise ValueError(
                f"fp8 block scales: part {name!r} (rows {start}:{end}) of a fused projection "
                f"is not aligned to {BLOCK}-row blocks"
            )


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(
        self, scheme: str | None, ignore: list[str], dequantize: bool, dtype: torch.dtype,
        compressed: bool = False,
    ) -> None:  # fmt: skip
        self.scheme = scheme  # None: quantize at load; "tensor" | "channel" | "block"
        self.ignore = ignore  # checkpoint module names (or "re:" patterns) left unquantized
        self.dequantize = dequantize
        scale_name = "weight_scale" if compressed else "weight_scale_inv"
        self.method = Fp8LinearMethod(scheme, dequantize, dtype, scale_name)

    @classmethod
    def from_model(cls, model_config, device: torch.device, checkpoint=None) -> Fp8Config:
        cfg = quant_config_dict(model_config.hf_config)
        dequantize = device.type != "cuda" or model_config.quantization is None
        scheme, ignore = checkpoint_scheme(cfg) if cfg else (None, [])
        if scheme is None and dequantize:
            raise ValueError("quantization='fp8' at load needs a CUDA device")
        compressed = bool(cfg) and cfg.get("quant_method") == "compressed-tensors"
        config = cls(scheme, ignore, dequantize, model_config.dtype, compressed)
        if dequantize:
            logger.info("fp8 checkpoint on %s: weights dequantized to %s at load", device.type,
                        model_config.dtype)  # fmt: skip
        return config

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        if prefix.rpartition(".")[2] == "lm_head" or self._ignored(prefix, layer):
            return None
        return self.method

    def experts_method(self, prefix: str, layer) -> ExpertsMethod | None:
        if self.dequantize:  # the CPU, quantization="none": dequantized at load (moe_weights)
            return None
        from pagellm.quantization.fp8_moe import fp8_experts_method

        return fp8_experts_method(
            layer, self.scheme, self.method.block_scale_name, quantize_weight_per_row
        )

    def _ignored(self, prefix: str, layer) -> bool:
        names = [n.removesuffix(".weight") for n in checkpoint_names(prefix, layer)]
        for entry in self.ignore:
            pattern = entry[3:] if entry.startswith("re:") else re.escape(entry)
            if any(re.fullmatch(pattern, n) or n.endswith("." + entry) for n in names):
                return True
        return False

    def prepare_tensor(self, name: str, tensor: torch.Tensor, dtype: torch.dtype):
        if name.endswith(".input_scale"):
            return None  # activations are scaled per token instead
        if tensor.dtype == FP8 or not tensor.is_floating_point():
            return tensor
        if name.endswith(".weight_scale_inv") or (self.scheme == "block" and "_scale" in name):
            return tensor.float()
        if name.endswith(".weight_scale"):
            if tensor.numel() == 1:
                return tensor.float().reshape(())
            return tensor.float().reshape(-1)  # [N, 1] -> [N]
        return tensor.to(dtype)

    def describe(self) -> str:
        how = "dequantized at load" if self.dequantize else "fp8 GEMMs"
        return f"fp8 ({self.scheme or 'per-row, quantized at load'} scales; {how})"


def checkpoint_scheme(cfg: dict) -> tuple[str, list[str]]:
    """("tensor" | "channel" | "block", ignored modules) of an fp8 checkpoint's config."""
    if cfg.get("quant_method") == "compressed-tensors":
        return _compressed_tensors_scheme(cfg)
    if cfg.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 checkpoints in format {cfg.get('fmt')!r} are not supported")
    ignore = list(cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or [])
    block = cfg.get("weight_block_size")
    if block is None:
        return "tensor", ignore
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"fp8 weight_block_size {block} is not supported (only [128, 128])")
    return "block", ignore


def _compressed_tensors_scheme(cfg: dict) -> tuple[str, list[str]]:
    if cfg.get("format") not in ("float-quantized", None):
        raise ValueError(
            f"compressed-tensors format {cfg.get('format')!r} is not supported "
            "(only float-quantized fp8)"
        )
    weights = [g.get("weights") or {} for g in (cfg.get("config_groups") or {}).values()]
    if len(weights) != 1 or weights[0].get("type") != "float" or weights[0].get("num_bits") != 8:
        raise ValueError("compressed-tensors: only one config group of 8-bit float weights")
    strategy = weights[0].get("strategy")
    if strategy == "block" and list(weights[0].get("block_structure") or []) != [BLOCK, BLOCK]:
        raise ValueError("compressed-tensors: only 128x128 weight blocks are supported")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported")
    return strategy, list(cfg.get("ignore") or [])
