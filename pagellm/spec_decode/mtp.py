"""MTP proposals (`speculative_config={"method": "mtp"}`, vLLM's name; its model-specific
aliases such as "mimo_mtp" too): the target checkpoint's own multi-token-prediction layer
(`pagellm/models/mimo.py`) drafts from the target's output.

It is fed and cached as an EAGLE-3 head is (`Eagle3Proposer`: its own paged K/V at the
target's block ids, position p's input the feature of p and the token after p, the first
draft from position L - 2, k - 1 more from its own outputs), with two differences: the
feature is the target's last hidden state (after its final norm, as the MTP layers were
trained), not three layers' residual streams, and the drafts are scored by the target's own
LM head in its own vocabulary.
"""

from __future__ import annotations

import torch

from pagellm.config import ModelConfig
from pagellm.spec_decode.eagle3 import Eagle3Proposer


class MtpProposer(Eagle3Proposer):
    method = "mtp"

    def attach(self, model_config: ModelConfig) -> None:
        """The head scores with the target's LM head; the target keeps nothing extra."""
        self.model.use_target_head(self.host.target_model.compute_logits)

    def step_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's output, copied: the next forward may reuse its buffer (a CUDA
        graph's replay) before this step's tokens are back."""
        return hidden.clone()  # [T, H]
