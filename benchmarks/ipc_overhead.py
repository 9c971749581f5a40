"""Per-step cost of the process boundary, with a model so small that compute is negligible.

64 requests decode together on a 1-layer dummy Llama (hidden 64, vocab 512) for 256 steps,
once with the EngineCore in a child process (ZMQ + msgspec) and once in-process, interleaved
A B A B. The difference of the per-step wall times is what the boundary costs a step (it can
be negative: the child steps while the caller detokenizes). The raw round trip of one
64-request EngineCoreOutputs message over an ipc:// socket pair is timed too.

    python benchmarks/ipc_overhead.py
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

NUM_REQS, STEPS, ROUNDS = 64, 256, 3
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def step_time(llm) -> float:
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1 + i, 2, 3, 4]} for i in range(NUM_REQS)]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start) / STEPS


def round_trip_us(n: int = 2000) -> float:
    import msgspec
    import zmq

    from pagellm.protocol import EngineCoreOutput, EngineCoreOutputs

    outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(f"req-{i}", [1234]) for i in range(NUM_REQS)], timestamp=1.0
    )
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutputs)
    ctx = zmq.Context()
    path = f"ipc://{tempfile.mkdtemp()}/rt"
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(path)
    push.connect(path)
    start = time.perf_counter()
    for _ in range(n):
        push.send_multipart((b"O", enc.encode(outs)))
        dec.decode(pull.recv_multipart()[1])
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    from pagellm import LLM

    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY, f)
    kwargs = dict(model=folder, load_format="dummy", dtype="float32", max_num_seqs=NUM_REQS)
    mp = LLM(**kwargs)
    os.environ["PAGELLM_ENABLE_MULTIPROCESSING"] = "0"
    inproc = LLM(**kwargs)
    times: dict[str, list[float]] = {"multiprocess": [], "inprocess": []}
    for llm in (mp, inproc):
        step_time(llm)  # warm-up
    for _ in range(ROUNDS):
        times["multiprocess"].append(step_time(mp))
        times["inprocess"].append(step_time(inproc))
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "running_requests": NUM_REQS,
        "step_us": {k: round(v, 1) for k, v in med.items()},
        "boundary_us_per_step": round(med["multiprocess"] - med["inprocess"], 1),
        "raw_round_trip_us": round(round_trip_us(), 1),
    }
    for k, v in result["step_us"].items():
        print(f"{k:13s} {v:8.1f} us/step (median of {ROUNDS})")
    print(
        f"boundary cost: {result['boundary_us_per_step']} us/step; "
        f"raw message round trip: {result['raw_round_trip_us']} us"
    )
    print(json.dumps(result))
    mp.shutdown()


if __name__ == "__main__":
    main()
