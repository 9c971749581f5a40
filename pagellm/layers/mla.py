"""`LatentAttention`: DeepSeek V2 / V3's multi-head latent attention layer, its projections
named as HF's (`q_proj` or `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`,
`kv_a_proj_with_mqa` -> `kv_a_layernorm`, `kv_b_proj`, `o_proj`), the attention itself over
the latent cache in `pagellm/attention/mla.py`.

Tensor parallelism splits heads: q_proj / q_b_proj and kv_b_proj by rows (a rank's heads),
o_proj by columns; q_a_proj and kv_a_proj_with_mqa (the latent, which every head reads) are
replicated, so is the cache row.

Rotary: DeepSeek's checkpoints rotate adjacent pairs (x0, x1), (x2, x3), ... (V2 always; V3
with `rope_interleave`, its default); the pairs are gathered into halves first, then turned
as the rotate-half table turns them: the same dot products q_pe . k_pe as HF's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.attention.mla import MLAAttention
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from pagellm.layers.rope import rope_parameters, rope_type
from pagellm.layers.rotary_embedding import apply_rotary
from pagellm.quantization.fp8 import Fp8Weight, dequantize_fp8

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers

LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm and kv_a_layernorm with the default eps


class LatentProjection(ColumnParallelLinear):
    """kv_b_proj: its weight is read by head (absorbed into decode queries and outputs), never
    multiplied as a Linear, so it stays a plain float matrix (not packed for the CPU GEMMs).
    A quantized checkpoint's (DeepSeek-V3's fp8 128x128 blocks) loads as its method loads it
    and is dequantized once (`dense_weight`); on the CPU the fp8 path dequantizes at load."""

    _dense: torch.Tensor | None = None
    dense_only = True  # int weight-only methods dequantize it at load

    def prepack(self, batch_hint: int) -> None:
        return None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in `dtype`: the weight, or the quantized one dequantized (kept)."""
        weight = getattr(self, "weight", None)
        if weight is not None:
            return weight
        if self._dense is None:
            packed = self.packed_weight
            if not isinstance(packed, Fp8Weight):
                raise ValueError(
                    f"kv_b_proj quantized as {type(packed).__name__}: latent attention reads "
                    "it by head and takes float or fp8 weights only"
                )
            self._dense = dequantize_fp8(packed.weight, packed.scale).to(dtype)
        return self._dense


def mla_softmax_scale(config: PretrainedConfig) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under yarn (HF's
    `yarn_apply_mscale`: the unrotated dims are scaled too)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, params = rope_parameters(config)
    all_dim = params.get("mscale_all_dim")
    if rope_type(params) != "default" and all_dim:
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def interleaved_rope(config: PretrainedConfig) -> bool:
    """Adjacent dims rotate together (V2; V3 unless `rope_interleave` is False)."""
    if getattr(config, "model_type", None) == "deepseek_v2":
        return True
    return bool(getattr(config, "rope_interleave", True))


class LatentAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, hidden = config.num_attention_heads, config.hidden_size
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, h * qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, h * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(self.rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(h * self.v_dim, hidden, bias=bias)
        self.num_heads = self.kv_b_proj.out_features // (self.nope_dim + self.v_dim)  # a rank's
        self.interleaved = interleaved_rope(config)
        scale = mla_softmax_scale(config)
        self.attn = MLAAttention(self.num_heads, self.nope_dim, self.rank, self.rope_dim, scale)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, P]
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,  # [1, blocks, block_size, 1, R + P]
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        t = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope_dim], dim=-1)
        q_pe = apply_rotary(self._halves(q_pe), cos_sin)
        k_pe = apply_rotary(self._halves(k_pe[:, None]), cos_sin)[:, 0]
        latent = torch.cat([self.kv_a_layernorm(c.contiguous()), k_pe], dim=-1)  # [T, R + P]
        w_kv = self.kv_b_proj.dense_weight(hidden.dtype)
        w_kv = w_kv.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        out = self.attn.forward(q_nope, q_pe, latent, w_kv, kv_cache, attn_metadata)
        return self.o_proj(out.flatten(1))

    def _halves(self, x: torch.Tensor) -> torch.Tensor:
        """Interleaved pairs gathered into halves (evens, then odds); contiguous."""
        if not self.interleaved:
            return x.contiguous()
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
