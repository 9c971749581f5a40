"""MXFP4 expert weights (gpt-oss checkpoints, `quant_method: "mxfp4"`), dequantized at load.

A projection of E experts is stored as two tensors, its rows (outputs) first:

    <name>_blocks  [E, rows, G, 16] uint8: 32 FP4 (e2m1) values a group of columns, two a
                   byte, the even column in the low nibble
    <name>_scales  [E, rows, G] uint8: each group's power of two as E8M0 (2 ** (s - 127))

so the weight [E, rows, G * 32] is value * 2 ** (scale - 127). On CUDA (`Mxfp4Config`)
the experts stay as stored and the fused MoE kernel dequantizes each tile in registers; on
the CPU (and with quantization="none") the model's loader (`pagellm/models/gpt_oss.py`)
pairs the two tensors and dequantizes them to the model's dtype (`dequantize_mxfp4`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace  # of a TensorSlice (pagellm/layers/weights.py, a floor above)

import torch

from pagellm.quantization.base import (
    ExpertsMethod,
    QuantizationConfig,
    QuantizedExperts,
    drop_params,
    replace_param,
)

logger = logging.getLogger(__name__)
STACKS = ("w13", "w2")
STORED_NAMES = {"w13": "gate_up_proj", "w2": "down_proj"}  # gpt-oss's names of the stacks

# the 16 e2m1 codes: sign bit 3, then exponent and mantissa
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
BLOCK_BYTES = 16  # 32 values a scale
# the CUDA kernels build a group's 2^(s - 127) times 2^14 in one float32: finite up to 240
# (weights up to 6 x 2^113; E8M0's 255 is NaN)
MAX_KERNEL_SCALE = 240


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """ValueError naming the projection `name` where its blocks and scales are not MXFP4's
    (dtypes are checked where they are known: not on `meta`)."""
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(
            f"MXFP4 tensor {name}_blocks: expected [..., groups, {BLOCK_BYTES}] bytes, "
            f"got shape {tuple(blocks.shape)}"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"MXFP4 tensor {name}_scales: shape {tuple(scales.shape)} does not match its "
            f"blocks' groups {tuple(blocks.shape[:-1])}"
        )
    for suffix, tensor in (("blocks", blocks), ("scales", scales)):
        if not tensor.is_meta and tensor.dtype != torch.uint8:
            raise ValueError(f"MXFP4 tensor {name}_{suffix}: expected uint8, got {tensor.dtype}")


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [*prefix, G, 16] uint8
    scales: torch.Tensor,  # [*prefix, G] uint8 (E8M0)
    dtype: torch.dtype,
    name: str = "weight",
) -> torch.Tensor:  # [*prefix, G * 32] in dtype
    """The weight the blocks and scales encode (exact in float32 and bf16: FP4 values have
    2 significant bits; a product underflowing the dtype rounds as `ldexp` does)."""
    check_mxfp4(blocks, scales, name)
    *prefix, groups, _ = blocks.shape
    if blocks.is_meta:
        return torch.empty((*prefix, groups * 2 * BLOCK_BYTES), dtype=dtype, device="meta")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [*prefix, G, 32]
    exponents = scales.to(torch.int32) - 127
    weight = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return weight.flatten(-2).to(dtype)


class Mxfp4Config(QuantizationConfig):
    """`quantization="mxfp4"` on CUDA: gpt-oss's experts kept as stored and run by the fused
    MoE kernel with MXFP4 weights (`pagellm/kernels/fused_moe_quant.py`, dequantized in
    registers); nothing else is quantized. On the CPU, with quantization="none", or where an
    expert's rank part is not whole groups of 32: dequantized at load (no config)."""

    name = "mxfp4"

    @classmethod
    def from_model(cls, model_config, device: torch.device, checkpoint=None) -> Mxfp4Config | None:
        if device.type != "cuda" or model_config.quantization is None:
            logger.info("mxfp4 checkpoint on %s: experts dequantized to %s at load",
                        device.type, model_config.dtype)  # fmt: skip
            return None
        return cls()

    def linear_method(self, prefix: str, layer) -> None:
        return None

    def experts_method(self, prefix: str, layer) -> ExpertsMethod | None:
        if layer.part.size % 32 or layer.hidden_size % 32:
            return None
        return Mxfp4ExpertsMethod(prefix)


class Mxfp4ExpertsMethod(ExpertsMethod):
    """One MoE layer's experts as stored: `w13_blocks` [E, 2I, H / 32, 16] (gate rows, then
    up rows: the model's loader de-interleaves them), `w13_scales` [E, 2I, H / 32], `w2_*`
    likewise over I; its biases stay in the model dtype."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix  # the layer's name, for errors

    def create_weights(self, layer) -> None:
        e = layer.num_experts
        for stacked in STACKS:
            n, k = getattr(layer, stacked).shape[1:]
            replace_param(layer, f"{stacked}_blocks", (e, n, k // 32, BLOCK_BYTES), torch.uint8)
            replace_param(layer, f"{stacked}_scales", (e, n, k // 32), torch.uint8)
            drop_params(layer, stacked)

    def checkpoint_param(self, layer, stacked: str, leaf: str) -> str | None:
        return f"{stacked}_{leaf}" if leaf in ("blocks", "scales") else None

    def tensor_slice(self, layer, param_name: str, part):
        if param_name.startswith("w13"):
            return part  # rows
        return replace(part, start=part.start // 32, size=part.size // 32)  # w2: column groups

    def process_weights_after_loading(self, layer) -> None:
        from pagellm.kernels.fused_moe_quant import QuantizedStack

        stacks = []
        for stacked in STACKS:
            blocks = getattr(layer, f"{stacked}_blocks").detach()
            q = blocks.reshape(*blocks.shape[:2], -1)  # [E, N, K / 2]
            scales = getattr(layer, f"{stacked}_scales").detach()
            top = int(scales.max()) if scales.numel() else 0
            if top > MAX_KERNEL_SCALE:
                name = f"{self.prefix}.{STORED_NAMES[stacked]}_scales"
                raise ValueError(
                    f"MXFP4 tensor {name}: a scale byte of {top} "
                    f"(2^{top - 127}); the CUDA kernels take at most {MAX_KERNEL_SCALE} "
                    "(quantization='none' dequantizes the experts at load)"
                )
            stacks.append(QuantizedStack(q, scales.contiguous(), None, 4, 32, mxfp4=True))
        layer.quantized_experts = Mxfp4GpuExperts(*stacks)

    def dummy_tensor(self, layer, param_name: str, std: float, generator: torch.Generator):
        stacked, _, kind = param_name.partition("_")
        if kind not in ("blocks", "scales"):
            return None  # the biases: float
        e, n, k = layer.full_shape(stacked)  # every rank's rows and columns
        shape = (e, n, k // 32, BLOCK_BYTES) if kind == "blocks" else (e, n, k // 32)
        device = generator.device
        if kind == "blocks":
            return torch.randint(0, 256, shape, generator=generator, device=device).to(torch.uint8)
        top = 127 + max(-120, round(math.log2(max(std, 1e-30) / 2)))  # weights of about std
        codes = torch.randint(top - 2, top + 1, shape, generator=generator, device=device)
        return codes.to(torch.uint8)


class Mxfp4GpuExperts(QuantizedExperts):
    """MXFP4 experts on CUDA: the fused MoE kernels with MXFP4 weights (gpt-oss's biases and
    activation as the layer passes them)."""

    def __init__(self, w13, w2) -> None:
        from pagellm.kernels import fused_moe_quant

        self.kernels = fused_moe_quant
        self.w13, self.w2 = w13, w2  # QuantizedStack each

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **extras):
        return self.kernels.fused_moe_quant(x, self.w13, self.w2, weights, ids, **extras)
