"""Encoders: BERT and XLM-RoBERTa, embedding (`BertModel`, `XLMRobertaModel`) or
classifying (`*ForSequenceClassification`), for the pooling runner.

An encoder attends both ways and keeps no KV cache: each request's whole prompt is one
forward (the scheduler never chunks it, `enable_chunked_prefill=False`), attention runs over
the request's own tokens only (the flat batch padded per request for SDPA). Absolute position
and token type embeddings, post-LayerNorm layers, GELU. XLM-RoBERTa is BERT with positions
counted from `pad_token_id + 1` and a classifier head of its own (dense, tanh, out_proj on
the first token). Module names follow HF's, so checkpoint tensors load by name (a
classifier's `bert.` / `roberta.` prefix dropped).

The runner hands the step's token types over in `token_type_ids` before each forward
(a cross-encoder's pair: 0 for the first text, 1 for the second; else zeros).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.linear import Linear
from pagellm.layers.weights import load_packed_weights
from pagellm.models.pooling import num_labels


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF's ACT2FN names (transformers' activations.py) -> the same functions in torch
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "mish": F.mish,
    "tanh": torch.tanh,
}


def activation(config: Any, key: str) -> Any:
    """The config's activation `key` (hidden_act, ...) as a function; an unserved name is a
    ValueError naming it (was a bare KeyError)."""
    name = getattr(config, key)
    if name not in ACTIVATIONS:
        raise ValueError(
            f"{key}={name!r} is not served for encoders; served: {', '.join(sorted(ACTIVATIONS))}"
        )
    return ACTIVATIONS[name]


class DenseNorm(nn.Module):
    """HF's `*Output`: dense, then LayerNorm over it plus the residual."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class SelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query = Linear(hidden, hidden)
        self.key = Linear(hidden, hidden)
        self.value = Linear(hidden, hidden)
        self.qkv: Linear | None = None  # query | key | value in one GEMM (`fuse_qkv`)

    def fuse_qkv(self) -> None:
        """One [3 * hidden, hidden] Linear in place of three: one pass over x (the CPU's
        packed GEMMs; the checkpoint's names are loaded by then)."""
        parts = (self.query, self.key, self.value)
        fused = Linear(self.query.in_features, 3 * self.query.out_features, device="meta")
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        self.qkv = fused
        del self.query, self.key, self.value

    def forward(self, x: torch.Tensor, layout: PaddedLayout | RequestSlices) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden], each token attending to its request's tokens
        if self.qkv is not None:
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # each [T, hidden], a view
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
        return layout.attend(q, k, v, self.num_heads)


class EncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.attention = nn.Module()
        self.attention.self = SelfAttention(config)
        self.attention.output = DenseNorm(config.hidden_size, config.hidden_size, eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(config.hidden_size, config.intermediate_size)
        self.output = DenseNorm(config.intermediate_size, config.hidden_size, eps)
        self.act = activation(config, "hidden_act")

    def forward(self, x: torch.Tensor, layout: PaddedLayout | RequestSlices) -> torch.Tensor:
        attn = self.attention.output(self.attention.self(x, layout), x)
        return self.output(self.act(self.intermediate.dense(attn)), attn)


class Embeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor):
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(types))


class PaddedLayout:
    """A step's requests as rows of a padded batch: [T, ...] <-> [R, H, L, D]."""

    def __init__(self, query_start_loc: np.ndarray, num_tokens: int, device: torch.device):
        lens = np.diff(query_start_loc)  # [R]
        self.shape = (len(lens), int(lens.max()))
        valid = np.arange(self.shape[1])[None, :] < lens[:, None]  # [R, L]
        flat = np.zeros(self.shape, np.int64)
        flat[valid] = np.arange(num_tokens)
        self.index = torch.from_numpy(flat).to(device)  # [R, L] flat token of each slot
        self.valid = torch.from_numpy(valid.reshape(-1)).to(device)  # [R * L]
        self.mask = torch.from_numpy(valid).to(device)[:, None, None, :]  # [R, 1, 1, L] keys

    def band_mask(self, window: int) -> torch.Tensor:
        """[R, 1, L, L]: a valid key within `window` positions of its query, either side (a
        padding query row sees every valid key, so that no row is empty)."""
        positions = torch.arange(self.shape[1], device=self.mask.device)
        band = (positions[:, None] - positions[None, :]).abs() <= window  # [L, L]
        padded_query = ~self.mask.transpose(-1, -2)  # [R, 1, L, 1]
        return self.mask & (band | padded_query)

    def pad(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        r, length = self.shape
        return x[self.index].view(r, length, num_heads, -1).transpose(1, 2)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        r, _, length, _ = out.shape
        return out.transpose(1, 2).reshape(r * length, -1)[self.valid]

    def attend(self, q, k, v, num_heads: int) -> torch.Tensor:
        """q, k, v: [T, H * D] -> [T, H * D], one SDPA over the padded batch."""
        q, k, v = (self.pad(t, num_heads) for t in (q, k, v))
        return self.unpad(F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask))


class RequestSlices:
    """A step's requests as slices of the flat batch, attended one at a time: no padding
    gathers, no mask (SDPA's flash kernel on each exact length). The CPU's choice for a few
    requests a step (an encoder's long prompts fill the token budget with a handful); many
    short ones go padded (`use_slices`), where one call beats one per request."""

    MAX_REQUESTS = 32

    def __init__(self, query_start_loc: np.ndarray) -> None:
        self.bounds = list(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist()))

    @classmethod
    def use_slices(cls, query_start_loc: np.ndarray, device: torch.device) -> bool:
        return device.type == "cpu" and len(query_start_loc) - 1 <= cls.MAX_REQUESTS

    def attend(self, q, k, v, num_heads: int) -> torch.Tensor:
        """q, k, v: [T, H * D] (views of a fused GEMM's columns are fine) -> [T, H * D]."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for a, b in self.bounds:
            # [1, H, L, D]: SDPA's CPU flash kernel takes 4-D inputs only (3-D ones go to the
            # math path, 15x slower at L = 300)
            heads = [t[a:b].view(1, b - a, num_heads, -1).transpose(1, 2) for t in (q, k, v)]
            attended = F.scaled_dot_product_attention(*heads)  # [1, H, L, D]
            out[a:b] = attended[0].transpose(0, 1).reshape(b - a, -1)
        return out


class BertEmbeddingModel(nn.Module):
    """`BertModel`: the last layer's states, pooled by the runner (CLS or mean)."""

    is_encoder = True
    prefix = "bert."  # of a classifier checkpoint's encoder tensors
    classify = False

    @classmethod
    def sliding_windows(cls, config: Any) -> tuple[int | None, ...]:
        return (None,) * config.num_hidden_layers

    def __init__(self, config: Any, attn_backend_cls: type | None = None) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            EncoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.position_offset = 0
        self.token_type_ids: torch.Tensor | None = None  # [T] set by the runner each step

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, attn_metadata
    ) -> torch.Tensor:
        # attn_metadata: the step's CommonAttentionMetadata (an encoder reads no cache)
        n = attn_metadata.num_actual_tokens
        ids, positions = input_ids[:n], self.embedding_positions(input_ids[:n], positions[:n])
        types = self.token_type_ids
        types = torch.zeros_like(ids) if types is None or len(types) != n else types
        x = self.embeddings(ids, positions, types)  # [T, hidden]
        qsl = attn_metadata.query_start_loc_cpu
        use_slices = RequestSlices.use_slices(qsl, x.device)
        layout = RequestSlices(qsl) if use_slices else PaddedLayout(qsl, n, x.device)
        for layer in self.encoder.layer:
            x = layer(x, layout)
        return x

    def embedding_positions(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The position embeddings' indices of the step's tokens (each prompt whole)."""
        return positions + self.position_offset

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no LM head: it does not sample")

    def prepack_cpu_weights(self, batch_hint: int) -> None:
        """The layers' Linears packed for our CPU GEMMs (x86), query | key | value fused
        first; the heads stay plain (they see only the pooled rows)."""
        for module in self.encoder.modules():
            if isinstance(module, SelfAttention):
                module.fuse_qkv()
        for module in self.encoder.modules():
            if isinstance(module, Linear):
                module.prepack(batch_hint)

    def load_weights(self, weights: Any) -> set[str]:
        own = {name for name, _ in self.named_parameters()}
        renamed = ((self._name(name), tensor) for name, tensor in weights)
        return load_packed_weights(self, renamed, {}, lambda name: name not in own)

    def _name(self, name: str) -> str:
        return name.removeprefix(self.prefix)


class BertForSequenceClassification(BertEmbeddingModel):
    """The CLS state through BERT's pooler (dense, tanh), then the classifier Linear."""

    classify = True

    def __init__(self, config: Any, attn_backend_cls: type | None = None) -> None:
        super().__init__(config, attn_backend_cls)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, num_labels(config))

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        # pooled: [N, hidden] float32 (the CLS states) -> [N, num_labels]
        dense = self.pooler.dense
        x = torch.tanh(F.linear(pooled, dense.weight.float(), dense.bias.float()))
        return F.linear(x, self.classifier.weight.float(), self.classifier.bias.float())


class XLMRobertaEmbeddingModel(BertEmbeddingModel):
    prefix = "roberta."

    def __init__(self, config: Any, attn_backend_cls: type | None = None) -> None:
        super().__init__(config, attn_backend_cls)
        self.pad = config.pad_token_id
        self.position_offset = self.pad + 1  # HF counts from padding_idx + 1

    def embedding_positions(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """As HF's RoBERTa: padding_idx + the count of non-pad tokens up to each token, and
        padding_idx for a pad id (one inside a text shifts the positions after it)."""
        real = (ids != self.pad).long()
        counts = torch.cumsum(real, 0)
        starts = torch.arange(len(ids), device=ids.device) - positions  # each prompt's first
        before = torch.where(starts > 0, counts[(starts - 1).clamp(min=0)], 0)
        return (counts - before) * real + self.pad


class XLMRobertaForSequenceClassification(XLMRobertaEmbeddingModel):
    """RoBERTa's head on the first token: dense, tanh, out_proj."""

    classify = True

    def __init__(self, config: Any, attn_backend_cls: type | None = None) -> None:
        super().__init__(config, attn_backend_cls)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = nn.Linear(config.hidden_size, num_labels(config))

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        dense, out = self.classifier.dense, self.classifier.out_proj
        x = torch.tanh(F.linear(pooled, dense.weight.float(), dense.bias.float()))
        return F.linear(x, out.weight.float(), out.bias.float())
