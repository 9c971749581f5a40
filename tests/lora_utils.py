"""PEFT adapters for the LoRA tests: made with `peft` on an HF model, A and B both random (PEFT
starts B at zero, which would leave the output unchanged), saved as a PEFT folder."""

from __future__ import annotations

import torch
from model_utils import hf_generate_greedy, hf_model


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


def assert_mixed_equal_hf_peft(llm, prompts, assigned, loras, refs, new_tokens: int, label=""):
    """One greedy `generate` of `prompts`, each under its adapter (`assigned`: keys of `loras`
    and `refs`, None: the base model): every request's ids equal its HF + PEFT model's, and
    each adapter changes the base model's."""
    from pagellm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False,
        lora_request=[None if a is None else loras[a] for a in assigned],
    )  # fmt: skip
    for prompt, lora, out in zip(prompts, assigned, outs):
        want = hf_generate_greedy(refs[lora], [prompt], new_tokens)[0]
        assert out.outputs[0].token_ids == want, (label, lora)
        if lora is not None:  # the adapter changes the output
            assert want != hf_generate_greedy(refs[None], [prompt], new_tokens)[0], (label, lora)
