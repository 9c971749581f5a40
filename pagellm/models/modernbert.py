"""ModernBERT for the pooling runner: `ModernBertModel` (embeddings) and
`ModernBertForSequenceClassification`.

An encoder as BERT is here (`models/bert.py`: whole prompts, no KV cache, attention within
each request), with ModernBERT's layer: pre-LayerNorm (none before the first attention),
fused q | k | v, rotary positions, a GeGLU-style MLP (`Wi` -> act(input) * gate -> `Wo`),
no token types; layers alternate (`layer_types`) between global attention and a local band
(|query - key| <= `sliding_window`), each kind with its own rotary base. The classifier
pools (CLS or mean: `classifier_pooling`) before its head (dense, act, LayerNorm) and Linear.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.linear import Linear
from pagellm.models.bert import BertEmbeddingModel, PaddedLayout, activation
from pagellm.models.pooling import num_labels


def _norm(config: Any) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, D] (HF's rotate_half layout)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class ModernBertLayer(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.attn_norm = nn.Identity() if index == 0 else _norm(config)
        self.attn = nn.Module()
        self.attn.Wqkv = Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.attn.Wo = Linear(hidden, hidden, bias=config.attention_bias)
        self.mlp_norm = _norm(config)
        self.mlp = nn.Module()
        self.mlp.Wi = Linear(hidden, 2 * inter, bias=config.mlp_bias)
        self.mlp.Wo = Linear(inter, hidden, bias=config.mlp_bias)
        self.act = activation(config, "hidden_activation")
        self.kind = config.layer_types[index]  # "full_attention" | "sliding_attention"

    def forward(self, x: torch.Tensor, cos_sin: dict, layout: PaddedLayout, masks: dict):
        # x: [T, hidden]
        t = x.shape[0]
        qkv = self.attn.Wqkv(self.attn_norm(x)).view(t, 3, self.num_heads, -1)
        cos, sin = cos_sin[self.kind]
        q, k = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin)
        q, k, v = (layout.pad(y.reshape(t, -1), self.num_heads) for y in (q, k, qkv[:, 2]))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[self.kind])
        x = x + self.attn.Wo(layout.unpad(out))
        gate_in, gate = self.mlp.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp.Wo(self.act(gate_in) * gate)


class ModernBertEmbeddingModel(BertEmbeddingModel):
    """`ModernBertModel`: the final-norm states, pooled by the runner."""

    prefix = "model."  # of a classifier checkpoint's encoder tensors

    def __init__(self, config: Any, attn_backend_cls: type | None = None) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embeddings.norm = _norm(config)
        self.layers = nn.ModuleList(
            ModernBertLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.final_norm = _norm(config)
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.token_type_ids = None  # none: the runner sets nothing

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, attn_metadata
    ) -> torch.Tensor:
        n = attn_metadata.num_actual_tokens
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids[:n]))  # [T, hidden]
        layout = PaddedLayout(attn_metadata.query_start_loc_cpu, n, x.device)
        kinds = set(self.config.layer_types)
        cos_sin = {kind: self._cos_sin(positions[:n], kind, x.dtype) for kind in kinds}
        masks = {"full_attention": layout.mask}
        if "sliding_attention" in kinds:
            # HF's sliding_window (a property, not in config.json): half the local window
            masks["sliding_attention"] = layout.band_mask(self.config.local_attention // 2)
        for layer in self.layers:
            x = layer(x, cos_sin, layout, masks)
        return self.final_norm(x)

    def _cos_sin(self, positions: torch.Tensor, kind: str, dtype: torch.dtype):
        """[T, 1, D] cos and sin of the layer kind's rotary base."""
        theta = self.config.rope_parameters[kind]["rope_theta"]
        d = self.head_dim
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=positions.device) / d)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def prepack_cpu_weights(self, batch_hint: int) -> None:
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.prepack(batch_hint)


class ModernBertForSequenceClassification(ModernBertEmbeddingModel):
    """The pooled state through the head (dense, act, LayerNorm), then the classifier."""

    classify = True

    def __init__(self, config: Any, attn_backend_cls: type | None = None) -> None:
        super().__init__(config, attn_backend_cls)
        self.head = nn.Module()
        self.head.dense = nn.Linear(config.hidden_size, config.hidden_size,
                                    bias=config.classifier_bias)  # fmt: skip
        self.head.norm = _norm(config)
        self.head_act = activation(config, "classifier_activation")
        self.classifier = nn.Linear(config.hidden_size, num_labels(config))

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        # pooled: [N, hidden] float32 -> [N, num_labels]
        dense, norm = self.head.dense, self.head.norm
        x = self.head_act(F.linear(pooled, dense.weight.float(), _float(dense.bias)))
        x = F.layer_norm(x, x.shape[-1:], norm.weight.float(), _float(norm.bias), norm.eps)
        return F.linear(x, self.classifier.weight.float(), self.classifier.bias.float())


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()
