"""PEFT adapters for the LoRA tests: made with `peft` on an HF model, A and B both random (PEFT
starts B at zero, which would leave the output unchanged), saved as a PEFT folder."""

from __future__ import annotations

import torch
from model_utils import hf_model


def make_peft_adapter(base, config: dict, path, seed: int, std: float = 0.3):
    """An adapter of `peft.LoraConfig(**config)` over `base` (an HF folder or model), saved at
    `path`; returns (its folder, the HF + PEFT model in eval mode)."""
    import peft

    model = hf_model(base) if isinstance(base, str) else base
    model = peft.get_peft_model(model, peft.LoraConfig(**config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "lora_" in pname:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(path)
    return str(path), model.base_model.model.eval()
