"""DeepSeek V2 / V3's MoE block: a router with grouped top-k, the routed experts as the
stacked `FusedMoE`, and shared experts (one `GatedMLP` of n_shared_experts x
moe_intermediate_size) added for every token. Names follow HF (`gate`, `experts`,
`shared_experts`).

Routing, as HF computes it (router logits in float32):

- V2 (`topk_method` "greedy"): softmax over the experts, the top k;
  "group_limited_greedy": the `topk_group` groups (of `n_group`) with the highest best
  expert, the top k among theirs. HF's V2 never renormalizes (whatever `norm_topk_prob`).
- V3 (`noaux_tc`): sigmoid scores; the choice uses scores + `e_score_correction_bias`, groups
  ranked by the sum of their two best; the weights are the chosen experts' plain scores,
  divided by their sum with `norm_topk_prob`.

Both multiply the weights by `routed_scaling_factor`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.mlp import GatedMLP
from pagellm.layers.moe import FusedMoE, check_routing

if TYPE_CHECKING:
    from transformers import PretrainedConfig  # the child process never imports transformers


def group_mask(
    choice: torch.Tensor,  # [T, E]
    n_group: int,
    topk_group: int,
    per_group: str,  # "max" (V2) or "top2" (V3): a group's score
) -> torch.Tensor:  # [T, E] bool: the experts of each token's kept groups
    grouped = choice.view(choice.shape[0], n_group, -1)  # [T, G, E / G]
    if per_group == "max":
        scores = grouped.max(dim=-1).values
    else:
        scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.topk(scores, k=topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, kept, True)
    return mask[:, :, None].expand_as(grouped).reshape(choice.shape)


class DeepseekRouter(nn.Module):
    """The gate: its float32 weight [E, H] (and V3's `e_score_correction_bias` [E])."""

    def __init__(self, config: PretrainedConfig, sigmoid: bool) -> None:
        super().__init__()
        e, h = config.n_routed_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(e, h, dtype=torch.float32), requires_grad=False)
        self.sigmoid = sigmoid
        if sigmoid:
            bias = torch.empty(e, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        self.top_k = config.num_experts_per_tok
        self.n_group = getattr(config, "n_group", None) or 1
        self.topk_group = getattr(config, "topk_group", None) or self.n_group
        self.grouped = sigmoid or getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        self.renormalize = sigmoid and bool(getattr(config, "norm_topk_prob", False))
        self.scaling = float(getattr(config, "routed_scaling_factor", None) or 1.0)
        check_routing(e, self.top_k, self.n_group if self.grouped else None, self.topk_group,
                      per_group=2 if sigmoid else 1)  # fmt: skip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, K] float32, ids [T, K] int32
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        if self.sigmoid:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            mask = group_mask(choice, self.n_group, self.topk_group, "top2")
            choice = choice.masked_fill(~mask, float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
        else:
            scores = logits.softmax(dim=-1)
            if self.grouped:
                mask = group_mask(scores, self.n_group, self.topk_group, "max")
                scores = scores.masked_fill(~mask, 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids.to(torch.int32)


class DeepseekMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, sigmoid: bool) -> None:
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size
        self.gate = DeepseekRouter(config, sigmoid)
        self.experts = FusedMoE(config.n_routed_experts, self.gate.top_k, h, i, renormalize=False)
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = GatedMLP(h, i * shared, bias=mlp_bias(config)) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = self.gate(x)
        out = self.experts.run(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def is_moe_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Dense before `first_k_dense_replace`, sparse from there on. HF transformers' V2 and V3
    ignore `moe_layer_freq` (DeepSeek's own code reads it; every released config has 1), and
    HF is the reference for the checkpoint's layout."""
    if not getattr(config, "n_routed_experts", None):
        return False
    return layer_idx >= (getattr(config, "first_k_dense_replace", None) or 0)


def mlp_bias(config: PretrainedConfig) -> bool:
    """V2's `mlp_bias`: biases on the dense MLP and the shared experts (V3 has none)."""
    return bool(getattr(config, "mlp_bias", False))
