"""How often bf16 greedy continuations equal HF transformers' own bf16 ones, and how often
HF's bf16 agrees with itself when only its GEMMs sum in another order.

    python benchmarks/bf16_vs_hf.py [--num-prompts 64] [--max-tokens 32]

On the embedded SmolLM2-135M (its dequantized weights, `quantization="none"`), over
`accuracy.PROMPTS`, free-running greedy decoding, each pair compared by the share of prompts
whose tokens are all identical and the mean length of the common start:

- pagellm bf16 against HF bf16 (issue 17's check);
- HF bf16 against HF bf16 whose `nn.Linear` runs in float32 arithmetic on the same bf16
  values (exact products, float32 sums in MKL's / oneDNN's order, one rounding to bf16):
  the same model and rounding points, only the GEMMs' summation order changed. This is the
  ceiling of agreement that any implementation not replaying HF's own GEMM kernel can expect;
- both against HF float32 (how far bf16 is from the float32 model, either way).

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import accuracy
import torch
import torch.nn as nn
import torch.nn.functional as F

from pagellm import LLM, SamplingParams
from pagellm.loader import resolve_model_source


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """HF's forward with its KV cache, argmax of each step's logits as HF's own dtype gives
    them (EOS not special, as `ignore_eos=True`), one prompt at a time."""
    ids, past, out = torch.tensor([prompt]), None, []
    with torch.inference_mode():
        while len(out) < max_tokens:
            res = model(input_ids=ids, use_cache=True, past_key_values=past)
            past, token = res.past_key_values, int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def float32_arithmetic_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else self.bias.float()
    return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    common = [accuracy.common_prefix(x, y) for x, y in zip(a, b, strict=True)]
    n = len(a[0])
    return {
        "identical": round(sum(c == n for c in common) / len(common), 4),
        "mean_common_prefix": round(sum(common) / len(common), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(resolve_model_source(None, "auto", None).path)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    with LLM(dtype="bfloat16", quantization="none", max_model_len=1024) as llm:
        prompts = accuracy.prompt_ids(llm, accuracy.PROMPTS[: args.num_prompts])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ours = [o.outputs[0].token_ids for o in outs]
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
        runs[dtype] = [hf_greedy(hf, p, args.max_tokens) for p in prompts]
        if dtype == torch.bfloat16:
            plain = nn.Linear.forward
            nn.Linear.forward = float32_arithmetic_linear
            try:
                reordered = [hf_greedy(hf, p, args.max_tokens) for p in prompts]
            finally:
                nn.Linear.forward = plain
    hf_bf16, hf_fp32 = runs[torch.bfloat16], runs[torch.float32]
    result = {
        "cpu": platform.processor() or platform.machine(),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "pagellm_bf16_vs_hf_bf16": compare(ours, hf_bf16),
        "hf_bf16_reordered_gemms_vs_hf_bf16": compare(reordered, hf_bf16),
        "pagellm_bf16_vs_hf_fp32": compare(ours, hf_fp32),
        "hf_bf16_vs_hf_fp32": compare(hf_bf16, hf_fp32),
        "seconds": round(time.perf_counter() - start, 1),
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
