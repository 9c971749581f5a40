"""vLLM on pagellm's GPU workloads: the same shapes, requests and adapters as
`throughput.py` and `lora.py --device cuda`, so the two engines can be timed back to back on
one machine.

The model is one of pagellm's shipped configs (`pagellm/model_configs/NAME/config.json`,
e.g. `llama-3.1-8b`, `gpt-oss-20b`, `deepseek-v2-lite`) with dummy weights. `--quantization
gptq|awq` adds an int4 group-128 `quantization_config` to it (vLLM then picks its Marlin
kernels, as it does for a downloaded GPTQ / AWQ checkpoint), `mxfp4` gpt-oss's own (pagellm's
`--quantization mxfp4` on the shipped config), `fp8` asks for vLLM's online fp8. `--lora N`
serves N rank-`--lora-rank` adapters over every projection (written by `lora.py`'s
`make_adapter`, same seeds) with request i under adapter i mod N. vLLM runs with its
defaults (torch.compile, CUDA graphs, prefix caching, chunked prefill, async scheduling),
`max_model_len=4096`, the prefix cache reset before each round.

    PYTHONPATH=<vllm site> python benchmarks/vllm_peer.py --model llama-3.1-8b \
        --quantization gptq --workloads batch1,standard
    PYTHONPATH=<vllm site> python benchmarks/vllm_peer.py --model llama-3.1-8b --lora 8

The pagellm side of each figure: `throughput.py --workload W --model NAME --load-format
dummy [--quantization Q]` and `lora.py --device cuda`. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# run as a script, this folder leads sys.path: a script named like a package would shadow it
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
CONFIGS = _HERE.parent / "pagellm" / "model_configs"
QUANT_CONFIGS = {  # the `quantization_config` of a checkpoint of each kind, as published
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm"},
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]},  # gpt-oss's own
}  # fmt: skip


def _sibling(name: str):
    """A script of this folder, by path (the folder is not on sys.path)."""
    from pagellm.benchmarks.scripts import load_script

    return load_script(_HERE / f"{name}.py", f"vllm_peer_{name}")


def model_folder(name: str, quantization: str | None, root: Path) -> Path:
    config = json.loads((CONFIGS / name / "config.json").read_text())
    if quantization in QUANT_CONFIGS:
        config["quantization_config"] = QUANT_CONFIGS[quantization]
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def requests(workload: str) -> tuple[list[list[int]], list[int]]:
    """throughput.py's requests for `workload` (standard, fixed512, batch1)."""
    if workload == "batch1":
        rng = random.Random(0)
        return [[rng.randint(0, 10000) for _ in range(128)]], [512]
    return _sibling("throughput").standard_requests(512 if workload == "fixed512" else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a pagellm/model_configs name")
    ap.add_argument("--quantization", default=None, help="gptq | awq | mxfp4 | fp8 (None: bf16)")
    ap.add_argument("--workloads", default="standard,batch1", help="comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lora", type=int, default=0, help="adapters spread over the requests")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--out", default=None, help="also write the JSON there")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="vllm_peer_"))
    folder = model_folder(args.model, args.quantization, tmp)
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    kw = dict(model=str(folder), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=4096, seed=0, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    if args.quantization == "fp8":
        kw["quantization"] = "fp8"
    loras = None
    if args.lora:
        from transformers import AutoConfig
        from vllm.lora.request import LoRARequest

        kw.update(enable_lora=True, max_loras=args.lora, max_lora_rank=args.lora_rank)
        hf_config = AutoConfig.from_pretrained(folder)
        make = _sibling("lora").make_adapter
        loras = [LoRARequest(f"adapter{i}", i + 1,
                             make(hf_config, tmp / f"a{i}", args.lora_rank, seed=i))
                 for i in range(args.lora)]  # fmt: skip
    llm = LLM(**kw)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "model": args.model,
        "quantization": args.quantization,
        "lora": args.lora,
        "startup_s": round(time.perf_counter() - t0, 1),
        "output_tok_s": {},
        "runs_s": {},
    }
    warm = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], warm, use_tqdm=False)
    for workload in args.workloads.split(","):
        prompts, max_tokens = requests(workload)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False)
                  for m in max_tokens]  # fmt: skip
        spread = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
        times = []
        for r in range(args.rounds):
            llm.reset_prefix_cache()  # every round computes its prompts
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False, lora_request=spread)  # fmt: skip
            times.append(time.perf_counter() - start)
            assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
            print(f"round {r}: vllm {workload} {sum(max_tokens) / times[-1]:9.1f} output tok/s "
                  f"({times[-1]:.2f} s)", flush=True)  # fmt: skip
        result["output_tok_s"][workload] = round(sum(max_tokens) / statistics.median(times), 1)
        result["runs_s"][workload] = [round(t, 2) for t in times]
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    os._exit(0)  # vLLM's engine-core process and compile workers: no slow teardown


if __name__ == "__main__":
    main()
