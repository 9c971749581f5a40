"""OLMo 2: the Llama decoder with its norms moved.

- q and k are RMS-normed over the whole projection (all heads at once, weights of
  `num_heads * head_dim` and `num_kv_heads * head_dim`) before they are split into heads;
  with tensor parallelism each rank holds its heads' part of the weights and one all-reduce
  of the sums of squares gives the whole projection's RMS (`HeadSplitRMSNorm`);
- no norm before attention or the MLP: each sublayer's output is normed, then added to the
  residual stream (`post_attention_layernorm`, `post_feedforward_layernorm`).

The layer keeps the shared decoder's (hidden, residual) convention: the stream after a layer
is `hidden + residual`, so the final norm adds them as it does for Llama.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.distributed.parallel_state import all_reduce, get_tp_group
from pagellm.layers.attention import Attention
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.rotary_embedding import apply_rotary
from pagellm.layers.weights import TensorSlice
from pagellm.models.llama import AttentionOptions, LlamaForCausalLM, head_dim_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


class HeadSplitRMSNorm(RMSNorm):
    """RMSNorm over a whole projection whose heads are split over the tensor-parallel ranks:
    this rank holds `part` of the weight (its heads' entries) and of each row; the mean square
    is over all `full_size` entries, summed over the ranks. A head that `copies` ranks hold
    (KV heads replicated when fewer than ranks) is counted once. One rank: RMSNorm."""

    def __init__(self, full_size: int, part: TensorSlice, copies: int, eps: float) -> None:
        super().__init__(part.size, eps)
        self.full_size, self.part, self.copies = full_size, part, copies
        self.split = get_tp_group().size > 1

    def checkpoint_slice(self, param_name: str) -> TensorSlice:
        return self.part

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        return (self.full_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, part.size] -> [T, part.size]
        if not self.split:
            return super().forward(x)
        xf = x.float()
        squares = all_reduce(xf.square().sum(-1, keepdim=True)) / self.copies  # [T, 1]
        normed = xf * torch.rsqrt(squares / self.full_size + self.eps)
        return self.weight * normed.to(x.dtype)


class Olmo2Attention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
    ) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = hd = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, num_heads, num_kv_heads, hd, bias=options.qkv_bias
        )
        parts = self.qkv_proj.parts  # this rank's rows of q, k and v
        self.sizes = [parts[name].size for name in ("q_proj", "k_proj", "v_proj")]
        self.o_proj = RowParallelLinear(num_heads * hd, config.hidden_size, bias=options.o_bias)
        eps, kv_copies = config.rms_norm_eps, max(1, get_tp_group().size // num_kv_heads)
        self.q_norm = HeadSplitRMSNorm(num_heads * hd, parts["q_proj"], 1, eps)
        self.k_norm = HeadSplitRMSNorm(num_kv_heads * hd, parts["k_proj"], kv_copies, eps)
        heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.attn = Attention(*heads, hd, attn_backend_cls)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        # this rank's heads: [T, H * D], [T, H_kv * D], [T, H_kv * D]
        q, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        heads = (hidden.shape[0], -1, self.head_dim)
        q = apply_rotary(self.q_norm(q).view(heads), cos_sin)  # [T, H, D]
        k = apply_rotary(self.k_norm(k).view(heads), cos_sin)  # [T, H_kv, D]
        return self.o_proj(self.attn(q, k, v.view(heads), kv_cache, attn_metadata))


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, attn_backend_cls, options)
        act = getattr(config, "hidden_act", None) or "silu"
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=act)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor,  # [T, hidden]: the last sublayer's output
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before it; None first
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual
        attn = self.self_attn(cos_sin, stream, kv_cache, attn_metadata)
        stream = stream + self.post_attention_layernorm(attn)
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Olmo2DecoderLayer
