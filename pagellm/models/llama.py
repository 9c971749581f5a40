"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral) and the shared decoder used by Qwen2/3.

Module names follow HF (`model.layers.N.self_attn.o_proj`, ...) so checkpoint names map 1:1,
except the fused `qkv_proj` and `gate_up_proj` (see `packed_modules`). Variants differ only in
`AttentionOptions`: Qwen2 adds a q/k/v bias, Qwen3 a per-head RMSNorm on q and k; and in
`sliding_windows` (per layer): Mistral windows every layer, Qwen2/3 the layers HF marks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels.cpu_gemm import PackedWeight
from pagellm.layers.attention import Attention
from pagellm.layers.cpu_decoder import CpuDecoder
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import Linear, QKVParallelLinear, RowParallelLinear
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.rope import max_positions, rope_parameters, rotary_dim
from pagellm.layers.rotary_embedding import RotaryEmbedding, apply_rotary, qk_norm_rotary
from pagellm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits
from pagellm.layers.weights import load_packed_weights
from pagellm.quantization.base import QuantizedActivation, QuantizedWeight

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rotary
    norm_cls: type[RMSNorm] = RMSNorm  # of that q/k norm (Gemma 3: GemmaRMSNorm)
    scale: float | None = None  # of q.k; None: head_dim ** -0.5
    logits_soft_cap: float | None = None  # Gemma 2: cap * tanh(score / cap)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_embedding(config: PretrainedConfig, params: dict | None = None) -> RotaryEmbedding:
    """The config's rotary table (`params`: one layer type's rope parameters, Gemma 3), over
    the rotated dims of a head, for every position the model may serve."""
    theta, scaling = rope_parameters(config, params)
    dim = rotary_dim(config, head_dim_of(config))
    return RotaryEmbedding(dim, max_positions(config), theta, scaling)


def qwen_sliding_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Qwen2 / Qwen3 (and their MoE variants) as HF applies them: with `use_sliding_window`,
    the layers `layer_types` marks "sliding_attention" (without it, those from
    `max_window_layers` on; every layer for Qwen3-MoE, which has neither) see only the last
    `sliding_window` tokens; the others attend to everything."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", False) or window is None:
        return (None,) * n
    types = getattr(config, "layer_types", None) or [
        "sliding_attention" if i >= getattr(config, "max_window_layers", 0) else "full_attention"
        for i in range(n)
    ]
    return tuple(window if kind == "sliding_attention" else None for kind in types)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = hd = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, num_heads, num_kv_heads, hd, bias=options.qkv_bias
        )
        # this rank's heads (all of them with one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * hd, config.hidden_size, bias=options.o_bias)
        if options.qk_norm:
            self.q_norm = options.norm_cls(hd, config.rms_norm_eps)
            self.k_norm = options.norm_cls(hd, config.rms_norm_eps)
        self.qk_norm = options.qk_norm
        self.rotary = True  # False: q and k are not rotated (SmolLM3's NoPE layers)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            hd,
            attn_backend_cls,
            scale=options.scale,
            sliding_window=sliding_window,
            logits_soft_cap=options.logits_soft_cap,
        )

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor | QuantizedActivation,  # [T, hidden]
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        q = self._qkv_into_cache(hidden, cos_sin, kv_cache, attn_metadata)
        if q is not None:  # k and v are in the cache already
            return self.o_proj(self.attn(q, None, None, kv_cache, attn_metadata))
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim)  # [T, H+2H_kv, D]
        num_qk = self.num_heads + self.num_kv_heads
        if not self.rotary:
            q, k, v = qkv[:, : self.num_heads], qkv[:, self.num_heads : num_qk], qkv[:, num_qk:]
        elif self.qk_norm:
            heads = (self.num_heads, self.num_kv_heads)
            q, k = qk_norm_rotary(qkv, self.q_norm, self.k_norm, cos_sin, *heads)
            v = qkv[:, num_qk:]
        else:  # rotate q and k in one go
            qk = apply_rotary(qkv[:, :num_qk], cos_sin)
            q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, num_qk:]
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))

    def _qkv_into_cache(self, hidden, cos_sin, kv_cache, attn_metadata) -> torch.Tensor | None:
        """q [T, H, D] after rotary, k and v written into the cache, all by the q | k | v
        projection's kernel where its weight has one (fp8 at batch 1); None otherwise."""
        weight = self.qkv_proj.packed_weight
        if self.qk_norm or not self.rotary or not isinstance(weight, QuantizedWeight):
            return None
        if self.qkv_proj.lora is not None:  # LoRA adds to the projection's output first
            return None
        slots = self.attn.cache_slots(attn_metadata)
        if slots is None or cos_sin.shape[-1] != self.head_dim:  # partial rotary: apart
            return None
        return weight.qkv_rotary_into_cache(
            hidden, self.qkv_proj.bias, cos_sin, self.num_heads, self.num_kv_heads, kv_cache,
            slots, self.attn.kv_scale,
        )  # fmt: skip


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend_cls, options, sliding_window)
        self.mlp = self.make_mlp(config)
        self.input_layernorm = self.make_norm(config)
        self.post_attention_layernorm = self.make_norm(config)

    def make_mlp(self, config: PretrainedConfig) -> nn.Module:
        """The layer's MLP (Gemma: GeGLU; StarCoder2: a plain one)."""
        bias = getattr(config, "mlp_bias", False)
        act = getattr(config, "hidden_act", None) or "silu"
        return GatedMLP(config.hidden_size, config.intermediate_size, bias=bias, act=act)

    def make_norm(self, config: PretrainedConfig) -> nn.Module:
        """One of its two norms (Gemma: (1 + w); StarCoder2: LayerNorm)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: torch.Tensor,  # [T, 1, D]
        hidden: torch.Tensor,  # [T, hidden]: the last sublayer's output
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before it; None first
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # each norm's kernel may quantize its output for the fp8 GEMM after it (w8a8), not
        # for a LoRA-wrapped projection (its adapters read the plain activations)
        qkv_weight = _quantizing_weight(self.self_attn.qkv_proj)
        hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual, qkv_weight)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, attn_metadata)
        gate_up = getattr(self.mlp, "gate_up_proj", None)  # a GatedMLP's (not an MoE block's)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(
            hidden, residual, _quantizing_weight(gate_up)
        )
        return self.mlp(hidden), residual


def _quantizing_weight(linear: nn.Module | None) -> Any:
    """The packed weight a norm may quantize its output for (None: plain activations)."""
    if linear is None or getattr(linear, "lora", None) is not None:
        return None
    return linear.packed_weight


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend_cls: type[AttentionBackend],
        options: AttentionOptions,
        sliding_windows: Sequence[int | None] = (),  # per layer; (): no window anywhere
        layer_cls: type[nn.Module] | None = None,  # LlamaDecoderLayer; OLMo 2 has its own
        norm: nn.Module | None = None,  # the final norm; None: RMSNorm (StarCoder2: LayerNorm)
    ) -> None:
        super().__init__()
        layer_cls = layer_cls or LlamaDecoderLayer
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        windows = sliding_windows or (None,) * config.num_hidden_layers
        self.layers = nn.ModuleList(
            layer_cls(config, attn_backend_cls, options, window) for window in windows
        )
        self.norm = norm if norm is not None else RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary_embedding(config)
        self.embed_scale: float | None = None  # the embeddings times this (Granite's multiplier)
        self.cpu_decoder: CpuDecoder | None = None  # built on the first CPU forward
        self._cpu_decoder_built = False
        self.cpu_decoder_allowed = True  # False: the layers' own forward
        # an EAGLE-3 head's inputs (pagellm/spec_decode/eagle3.py): the residual stream entering
        # these layers, kept by each forward as `aux_hidden_states` [T, len * hidden]
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, hidden]
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        cos_sin = self.rotary_emb(positions, hidden.dtype)
        if hidden.device.type == "cpu" and not self._cpu_decoder_built:
            # the weights are packed by now
            self.cpu_decoder = CpuDecoder.build(self, LlamaDecoderLayer)
            self._cpu_decoder_built = True
        one_call = self.cpu_decoder_allowed and not self.aux_hidden_layers  # one call: no aux
        decoder = self.cpu_decoder if one_call else None
        if decoder is not None and decoder.runs(hidden, kv_caches, attn_metadata):
            hidden, residual = decoder(hidden, cos_sin, kv_caches, attn_metadata)
        else:
            residual, aux = None, []
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                if i in self.aux_hidden_layers:
                    aux.append(hidden if residual is None else hidden + residual)
                hidden, residual = layer(cos_sin, hidden, residual, kv_cache, attn_metadata)
            if aux:
                self.aux_hidden_states = torch.cat(aux, dim=-1)
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The model contract used by the runner: forward, compute_logits, load_weights."""

    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    decoder_layer_cls: type[nn.Module] | None = None  # None: LlamaDecoderLayer

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: attends to every earlier token)."""
        return (None,) * config.num_hidden_layers

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = config
        self.attn_backend_cls = attn_backend_cls
        self.model = self.build_model(config, attn_backend_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.packed_tied_head: PackedWeight | None = None  # see prepack_cpu_weights
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def build_model(
        self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]
    ) -> nn.Module:
        """The decoder (`self.model`): embeddings, layers, final norm, rotary table."""
        options, windows = self.attention_options(config), self.sliding_windows(config)
        return LlamaModel(config, attn_backend_cls, options, windows, self.decoder_layer_cls)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per layer
        attn_metadata: Any,  # attn_backend_cls.build_metadata(common)
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] in the model's dtype (the sampler works in float32)
        return gather_logits(self._rank_logits(hidden), self.config.vocab_size)

    def _rank_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab / tp]: this rank's vocabulary rows
        if not self.tie_word_embeddings:
            return self.lm_head(hidden)
        if self.packed_tied_head is not None:
            return self.packed_tied_head(hidden)
        return F.linear(hidden, self.model.embed_tokens.weight)

    def greedy_head_weight(self) -> torch.Tensor | None:
        """The float [vocab, hidden] weight whose product with the final hidden states is
        every logit (`pagellm.sample.greedy_head`): a tied head, one rank, logits computed as
        here (a family that scales or caps them overrides compute_logits), not quantized."""
        cls = type(self)
        plain = (cls.compute_logits is LlamaForCausalLM.compute_logits
                 and cls._rank_logits is LlamaForCausalLM._rank_logits)  # fmt: skip
        head = self.packed_tied_head
        float_head = head is None or isinstance(head, PackedWeight)
        if not (self.tie_word_embeddings and plain and float_head) or get_tp_group().size > 1:
            return None
        return self.model.embed_tokens.weight

    def prepack_cpu_weights(self, batch_hint: int) -> None:
        """Pack every Linear weight (x86 CPUs; see `pagellm.layers.linear`); a tied
        LM head gets a packed copy, the embedding keeps its plain weight for lookups."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(batch_hint)
        if self.tie_word_embeddings and self.packed_tied_head is None:  # None: not quantized
            self.packed_tied_head = PackedWeight(self.model.embed_tokens.weight, batch_hint)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; return the names of the parameters fully loaded."""
        return load_packed_weights(self, weights, self.packed_modules, self._skip_weight)

    def _skip_weight(self, name: str) -> bool:
        if "rotary_emb." in name:  # old checkpoints store inv_freq
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's architecture; a config with `sliding_window` (Mistral 7B v0.1)
    windows every layer, as HF does."""

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> tuple[int | None, ...]:
        return (getattr(config, "sliding_window", None),) * config.num_hidden_layers
