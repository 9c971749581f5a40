"""gpt-oss (`GptOssForCausalLM`): Llama's decoder flow with attention sinks (a learned logit
per query head in each softmax's denominator), sliding windows on the layers `layer_types`
marks (every other one), q / k / v / o biases, and a sparse MoE block in every layer: a
biased router whose top-k logits are softmaxed, biased experts with the clamped SwiGLU
(`ClampedSwiGLU`: `swiglu_alpha`, `swiglu_limit`).

Checkpoints store a layer's experts fused, gate and up columns interleaved:

    mlp.experts.gate_up_proj       [E, H, 2I] (x @ W; gate at even columns, up at odd)
    mlp.experts.gate_up_proj_bias  [E, 2I]    (the same interleave)
    mlp.experts.down_proj          [E, I, H]
    mlp.experts.down_proj_bias     [E, H]

or, in OpenAI's MXFP4 checkpoints, each weight as `<name>_blocks` / `<name>_scales` with
its rows (outputs) first (`pagellm/quantization/mxfp4.py`): on CUDA loaded as stored into
the experts' `w13_blocks`, ... (rows de-interleaved), elsewhere dequantized here. All go into
`FusedMoE`'s w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] and biases.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagellm.attention.base import AttentionBackend
from pagellm.layers.activation import ClampedSwiGLU
from pagellm.layers.attention import Attention
from pagellm.layers.linear import Linear
from pagellm.layers.moe import FusedMoE, num_experts_of, use_sparse_mlps
from pagellm.layers.weights import CheckpointTensor
from pagellm.models.llama import LlamaForCausalLM
from pagellm.quantization.mxfp4 import dequantize_mxfp4

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers

_EXPERTS = ".mlp.experts."
_MXFP4 = ("_blocks", "_scales")


class GptOssMoE(nn.Module):
    """A layer's MLP: the biased `router` (never quantized) and the biased experts."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, num_experts_of(config)
        self.router = Linear(hidden, num_experts, bias=True)
        self.router.quantizable = False
        # gpt-oss's checkpoints carry no `swiglu_alpha` (5.25's config supplies 1.702); 5.17's
        # config has neither field (its model hard-codes 1.702 and 7.0, as ClampedSwiGLU does)
        alpha = getattr(config, "swiglu_alpha", ClampedSwiGLU.alpha)
        limit = getattr(config, "swiglu_limit", ClampedSwiGLU.limit)
        activation = ClampedSwiGLU(alpha, limit)
        # softmax over the top-k logits: `renormalize` of a softmax over all, then the top k
        self.experts = FusedMoE(
            num_experts, config.num_experts_per_tok, hidden, config.intermediate_size,
            renormalize=True, bias=True, activation=activation,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        return self.experts(x, self.router(x))


class GptOssForCausalLM(LlamaForCausalLM):
    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> tuple[int | None, ...]:
        """`sliding_window` on the layers `layer_types` marks "sliding_attention"."""
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None) or ["full_attention"] * (
            config.num_hidden_layers
        )
        return tuple(window if kind == "sliding_attention" else None for kind in types)

    def __init__(self, config: PretrainedConfig, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__(config, attn_backend_cls)
        windows = self.sliding_windows(config)
        for layer, window in zip(self.model.layers, windows, strict=True):
            attn = layer.self_attn  # the same attention, now with its sinks
            attn.attn = Attention(
                attn.num_heads, attn.num_kv_heads, attn.head_dim, attn_backend_cls,
                sliding_window=window, sinks=True,
            )  # fmt: skip
        use_sparse_mlps(self, lambda _: GptOssMoE(config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        rest = super().load_weights(self._load_experts(weights, loaded))
        return rest | loaded

    def _load_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Load the experts' tensors (MXFP4 pairs once both are in); yield the others, the
        sinks under their layer's name."""
        modules = dict(self.named_modules())
        pending: dict[str, dict[str, CheckpointTensor]] = {}
        for name, tensor in weights:
            if name.endswith(".self_attn.sinks"):
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
                continue
            if _EXPERTS not in name:
                yield name, tensor
                continue
            prefix, _, leaf = name.partition(_EXPERTS)
            experts = modules.get(f"{prefix}.mlp.experts")
            if not isinstance(experts, FusedMoE):
                raise ValueError(f"unexpected checkpoint tensor {name!r}: no such experts")
            if leaf.endswith(_MXFP4) and experts.quant_method is not None:  # kept as stored
                param, value = _stored_mxfp4(leaf, tensor, name)
                loaded.add(_load_full(experts, f"{prefix}.mlp.experts", param, value, name))
                continue
            if leaf.endswith(_MXFP4):
                stem, kind = leaf[: -len("_blocks")], leaf[-len("blocks") :]
                pair = pending.setdefault(f"{prefix}{_EXPERTS}{stem}", {})
                pair[kind] = tensor
                if len(pair) < 2:
                    continue
                full = pending.pop(f"{prefix}{_EXPERTS}{stem}")
                tensor, leaf = _dequantized(full, f"{prefix}{_EXPERTS}{stem}"), f"{stem}@rows"
            param, value = _expert_tensor(leaf, tensor, name)
            loaded.add(_load_full(experts, f"{prefix}.mlp.experts", param, value, name))
        if pending:
            stem, parts = next(iter(pending.items()))
            raise ValueError(f"MXFP4 tensor {stem}: the checkpoint has only its {sorted(parts)}")


def _load_full(experts: FusedMoE, where: str, param: str, value: torch.Tensor, name: str) -> str:
    """Every expert's part of `param` (of the experts named `where`) from `value`, for
    checkpoint tensor `name`; the parameter's full name, loaded."""
    try:
        experts.load_full(param, value)
    except ValueError as exc:
        raise ValueError(f"checkpoint tensor {name!r}: {exc}") from None
    return f"{where}.{param}"


def _dequantized(pair: dict[str, CheckpointTensor], stem: str) -> torch.Tensor:
    """An MXFP4 projection's weight [E, rows, cols] in the dtype and on the device its
    tensors were read for (the model's)."""
    blocks, scales = (CheckpointTensor(pair[k]) for k in ("blocks", "scales"))
    target = pair["blocks"] if isinstance(pair["blocks"], CheckpointTensor) else None
    dtype = target.dtype if target is not None and target.dtype else torch.float32
    device = target.device if target is not None and target.device else None
    b, s = blocks.read(), scales.read()  # as stored: uint8
    if device is not None and not b.is_meta:
        b, s = b.to(device), s.to(device)
    return dequantize_mxfp4(b, s, dtype, stem)


def _stored_mxfp4(leaf: str, tensor, name: str) -> tuple[str, torch.Tensor]:
    """(FusedMoE parameter, the [E, rows, ...] blocks or scales as stored) for the CUDA
    kernel (`Mxfp4ExpertsMethod`), gate | up rows de-interleaved."""
    stem, kind = leaf[: -len("_blocks")], leaf[-len("blocks") :]
    value = tensor.read() if isinstance(tensor, CheckpointTensor) else tensor
    stacked = {"gate_up_proj": "w13", "down_proj": "w2"}.get(stem)
    if stacked is None:
        raise ValueError(f"unexpected checkpoint tensor {name!r}: no such expert weight")
    if value.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensor {name}: expected uint8, got {value.dtype}")
    if stem == "gate_up_proj":
        value = torch.cat([value[:, 0::2], value[:, 1::2]], dim=1)
    return f"{stacked}_{kind}", value.contiguous()


def _expert_tensor(leaf: str, tensor, name: str) -> tuple[str, torch.Tensor]:
    """(FusedMoE parameter, its [E, ...] tensor in our layout) for checkpoint leaf `leaf`
    (`<projection>@rows`: an MXFP4 weight, already [E, rows, cols])."""
    value = tensor.read() if isinstance(tensor, CheckpointTensor) else tensor
    if leaf in ("gate_up_proj", "down_proj"):  # stored for x @ W: [E, in, out]
        value = value.transpose(1, 2)
        leaf = f"{leaf}@rows"
    if leaf in ("gate_up_proj@rows", "gate_up_proj_bias"):  # interleaved -> gate | up
        value = torch.cat([value[:, 0::2], value[:, 1::2]], dim=1)
    params = {
        "gate_up_proj@rows": "w13",
        "gate_up_proj_bias": "w13_bias",
        "down_proj@rows": "w2",
        "down_proj_bias": "w2_bias",
    }
    if leaf not in params or value.dim() < 2:
        raise ValueError(f"unexpected checkpoint tensor {name!r}: no such expert weight")
    return params[leaf], value.contiguous()
