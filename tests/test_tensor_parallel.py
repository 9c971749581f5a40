"""Tensor parallelism on the CPU: gloo, one worker process per rank (MultiprocExecutor).

- Each rank's shard of a model is the slice of the one-rank model it should hold (heads,
  MLP columns, vocabulary rows; KV heads replicated when fewer than ranks), from
  safetensors, GGUF and random weights, built in this process as each rank would.
- tensor_parallel_size=2 gives the same greedy token ids as 1, with chunked prefill, prefix
  cache hits and preemptions in the batch, and ngram drafts verified (rank 0's tokens sent
  to every rank); without drafts, with async scheduling: the server test and the Ray test
  (`test_tensor_parallel_ray.py`).
- The embedded SmolLM2 (9 heads, 3 KV heads) cannot be split in 2: a clear ValueError.
- A killed worker: EngineDeadError at once, no process or socket file left behind.
- `pagellm serve -tp 2` answers as the one-rank engine does.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import tempfile
import threading
import time

import httpx
import pytest
import torch
from conftest import PROMPTS
from draft_prompts import looping_prompt
from model_utils import hf_model, load_our_model, make_tiny_hf_model, write_tiny_gguf
from timing import scaled, slowdown, wait_until

from pagellm import LLM, EngineArgs, SamplingParams, StructuredOutputsParams
from pagellm.cli import build_parser, engine_args_from
from pagellm.distributed.parallel_state import building_rank
from pagellm.engine.core_client import EngineDeadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SHARED = list(range(40, 80))  # 40 tokens: two full blocks of 16 shared by every prompt
TOKEN_PROMPTS = [SHARED + [5 + i, 17, 33, 99, 200 + i, 7] * (i + 1) for i in range(6)]
# a step budget of 24 tokens cuts every prompt into chunks; 12 blocks of 16 cannot hold the
# batch's ~100-token requests at once: preemptions
STRESS = dict(max_num_batched_tokens=24, num_gpu_blocks_override=12)
SMALL_KV = 1 << 22
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def _token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(inputs, GREEDY, use_tqdm=False)]


def _one_rank_reference(folder: str, monkeypatch, **kwargs) -> list[list[int]]:
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")  # quick to start
    with LLM(
        dtype="float32", model=folder, max_model_len=256, kv_cache_memory_bytes=SMALL_KV, **kwargs
    ) as llm:
        ids = _token_ids(llm, TOKEN_PROMPTS)
    monkeypatch.delenv("PAGELLM_ENABLE_MULTIPROCESSING")
    return ids


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    # biases: q/k/v's are split with their rows, o_proj's is added once, after the all-reduce
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"), attention_bias=True)


# ---- configuration ---------------------------------------------------------------------


def test_backend_resolution_and_errors(monkeypatch, tiny_llama):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def parallel(**kwargs):
        return EngineArgs(model=tiny_llama, **kwargs).create_engine_config().parallel_config

    assert parallel().distributed_executor_backend == "uni"
    assert parallel(tensor_parallel_size=2).distributed_executor_backend == "mp"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert parallel(tensor_parallel_size=2).distributed_executor_backend == "ray"
    assert parallel(tensor_parallel_size=2).ray_address == "127.0.0.1:6379"
    assert parallel(tensor_parallel_size=2, distributed_executor_backend="mp").ray_address is None
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        parallel(distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        parallel(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match=r"must divide the model's num_attention_heads \(4\)"):
        parallel(tensor_parallel_size=3)
    ns = build_parser().parse_args(["serve", "-tp", "4", "--distributed-executor-backend", "ray"])
    args = engine_args_from(ns)
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (4, "ray")


def test_smollm2_heads_do_not_split_in_two():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide .*heads \(9\)"):
        LLM(dtype="float32", max_model_len=256, tensor_parallel_size=2)


# ---- each rank's shard ------------------------------------------------------------------


def _expected_shard(name: str, full: torch.Tensor, cfg, rank: int, tp: int) -> torch.Tensor:
    """What rank `rank` of `tp` should hold of one-rank parameter `name` (written out here,
    independently of the layers)."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if kv_heads >= tp:
        mine = slice(rank * kv_heads // tp, (rank + 1) * kv_heads // tp)
    else:  # replicated: ranks tp / kv_heads apart share a head
        head = rank // (tp // kv_heads)
        mine = slice(head, head + 1)
    if "qkv_proj" in name:
        q, k, v = full.split([heads * d, kv_heads * d, kv_heads * d])
        q = q.unflatten(0, (heads, d))[rank * heads // tp : (rank + 1) * heads // tp]
        k, v = (x.unflatten(0, (kv_heads, d))[mine] for x in (k, v))
        return torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])
    if name.endswith("q_norm.weight") and full.shape[0] == heads * d:  # OLMo 2: whole q
        return full.chunk(tp)[rank]
    if name.endswith("k_norm.weight") and full.shape[0] == kv_heads * d:
        return full.unflatten(0, (kv_heads, d))[mine].flatten()
    if name.endswith("experts.w13"):  # [E, 2I, H]: each expert's gate and up rows
        return torch.cat([x.chunk(tp, dim=1)[rank] for x in full.chunk(2, dim=1)], dim=1)
    if name.endswith("experts.w2"):  # [E, H, I]: each expert's down columns
        return full.chunk(tp, dim=2)[rank]
    if "gate_up_proj" in name:
        return torch.cat([x.chunk(tp)[rank] for x in full.chunk(2)])
    if "c_fc" in name:  # StarCoder2's column-parallel MLP input: weight and bias rows
        return full.chunk(tp)[rank]
    if name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):
        return full.chunk(tp, dim=1)[rank]
    if "embed_tokens" in name or "lm_head" in name:
        rows = -(-full.shape[0] // tp)
        padded = torch.cat([full, full.new_zeros(rows * tp - full.shape[0], full.shape[1])])
        return padded[rank * rows : (rank + 1) * rows]
    return full  # norms, row-parallel biases: every rank holds all


@pytest.mark.parametrize(
    "case",
    [
        "llama-safetensors",
        "qwen3-tied-replicated-kv",
        "llama-gguf",
        "llama-dummy-padded-vocab",
        "qwen2_moe-shared-expert",
        "qwen3_moe-dummy",
        "gemma2-tied-softcap",
        "phi3-fused-checkpoint",
        "olmo2-replicated-kv",
        "starcoder2-biases",
    ],
)
def test_each_rank_holds_its_slice(case, tmp_path):
    arch = case.split("-")[0]
    overrides = {
        "qwen3-tied-replicated-kv": dict(num_key_value_heads=1, tie_word_embeddings=True),
        "llama-dummy-padded-vocab": dict(vocab_size=509),
        "qwen2_moe-shared-expert": dict(MOE, shared_expert_intermediate_size=48),
        "qwen3_moe-dummy": dict(MOE, head_dim=32),
        "gemma2-tied-softcap": dict(attn_logit_softcapping=20.0, final_logit_softcapping=15.0),
        "olmo2-replicated-kv": dict(num_key_value_heads=1),
        "starcoder2-biases": dict(use_bias=True),
    }.get(case, {})
    folder = make_tiny_hf_model(arch, tmp_path, **overrides)
    path, load_format, tp = folder, "auto", 2
    if case.endswith("gguf"):
        path = write_tiny_gguf(folder, str(tmp_path / "tiny.gguf"), "F32", arch)
    if "dummy" in case:
        load_format, tp = "dummy", 4  # 4 ranks: the 2 KV heads are replicated too
    full = load_our_model(path, load_format=load_format)
    for rank in range(tp):
        with building_rank(rank, tp):
            shard = load_our_model(path, load_format=load_format)
        full_params = dict(full.named_parameters())
        for name, param in shard.named_parameters():
            want = _expected_shard(name, full_params[name], full.config, rank, tp)
            assert torch.equal(param, want), f"rank {rank}: {name}"


# ---- the same tokens as one rank ----------------------------------------------------------


def _worker_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "pagellm-workers-*")))


@pytest.fixture(scope="module")
def llama_tp2(tiny_llama):
    before = _worker_dirs()
    llm = LLM(
        dtype="float32",
        model=tiny_llama,
        max_model_len=256,
        tensor_parallel_size=2,
        kv_cache_memory_bytes=SMALL_KV,
        speculative_config=NGRAM,
        **STRESS,
    )
    llm.worker_dirs = _worker_dirs() - before  # the executor's socket directory
    yield llm
    llm.shutdown()


def test_random_samples_are_rank0s_on_every_rank(llama_tp2, tiny_llama, monkeypatch):
    """Rank 0 samples and broadcasts the ids: every rank then extends the same sequence, so
    the logprobs the engine reports for random samples are the one-rank model's logprobs of
    those tokens (teacher-forced). Ranks that drifted apart would compute other logits."""
    params = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, ignore_eos=True)
    prompts = TOKEN_PROMPTS[:3]
    sampled = llama_tp2.generate([{"prompt_token_ids": p} for p in prompts], params)
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)
    with LLM(
        dtype="float32", model=tiny_llama, max_model_len=256, kv_cache_memory_bytes=SMALL_KV
    ) as one:
        for prompt, out in zip(prompts, sampled):
            got = out.outputs[0]
            full = {"prompt_token_ids": prompt + list(got.token_ids)}
            want = one.generate(full, score, use_tqdm=False)[0].prompt_logprobs[len(prompt) :]
            for token, mine, ref in zip(got.token_ids, got.logprobs, want, strict=True):
                assert mine[token].logprob == pytest.approx(ref[token].logprob, abs=1e-3)


def test_two_ranks_same_tokens_as_one(llama_tp2, tiny_llama, monkeypatch):
    want = _one_rank_reference(tiny_llama, monkeypatch)
    assert _token_ids(llama_tp2, TOKEN_PROMPTS) == want
    again = llama_tp2.generate([{"prompt_token_ids": p} for p in TOKEN_PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == want
    assert all(o.num_cached_tokens >= 32 for o in again)  # the shared prefix hit the cache
    assert llama_tp2.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
    ranks = llama_tp2.llm_engine.call_utility("collective_rpc", "describe", [])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks}) == 2 and os.getpid() not in {r["pid"] for r in ranks}
    assert all(r["num_kv_heads"] == 1 for r in ranks)  # 2 KV heads, one per rank
    # drafts verified over two ranks: a prompt that loops, whose drafts are often right
    prompt, want = looping_prompt(hf_model(tiny_llama))
    (out,) = llama_tp2.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == want
    assert 3 <= out.metrics.num_accepted_tokens < out.metrics.num_draft_tokens


def _two_rank_ids(folder: str) -> list[list[int]]:
    """Greedy ids of TOKEN_PROMPTS from `folder`'s model split over two ranks."""
    with LLM(dtype="float32", model=folder, max_model_len=256, tensor_parallel_size=2,
             kv_cache_memory_bytes=SMALL_KV) as llm:  # fmt: skip
        return _token_ids(llm, TOKEN_PROMPTS)


def test_moe_experts_split_over_two_ranks(tmp_path, monkeypatch):
    """Qwen3-MoE: each expert's intermediate rows split over the ranks, one all-reduce."""
    folder = make_tiny_hf_model("qwen3_moe", tmp_path, **MOE, head_dim=32, mlp_only_layers=[0])
    assert _two_rank_ids(folder) == _one_rank_reference(folder, monkeypatch)


def test_deepseek_latent_attention_over_two_ranks(tmp_path, monkeypatch):
    """DeepSeek V3: each rank holds half the heads of q_b_proj, kv_b_proj and o_proj, the
    latent projections and cache row replicated; grouped top-k experts split as Qwen's."""
    from test_deepseek import make_tiny_deepseek

    folder = make_tiny_deepseek("deepseek_v3", tmp_path / "deepseek_v3")
    assert _two_rank_ids(folder) == _one_rank_reference(folder, monkeypatch)


def test_gpt_oss_over_two_ranks(tmp_path, monkeypatch):
    """gpt-oss: each rank its heads' sinks and its part of the experts and their gate | up
    biases; the down biases once (rank 0's), the router replicated."""
    layers = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    folder = make_tiny_hf_model("gpt_oss", tmp_path, num_local_experts=4, num_experts_per_tok=2,
                                head_dim=16, sliding_window=8, std=0.3, **layers)  # fmt: skip
    assert _two_rank_ids(folder) == _one_rank_reference(folder, monkeypatch)


def test_olmo2_whole_projection_norms_over_two_ranks(tmp_path, monkeypatch):
    """OLMo 2 RMS-normalizes q and k over all heads, which the ranks split: one all-reduce of
    the sums of squares; its one KV head, replicated on both ranks, is counted once."""
    folder = make_tiny_hf_model("olmo2", tmp_path, num_key_value_heads=1)
    assert _two_rank_ids(folder) == _one_rank_reference(folder, monkeypatch)


# ---- faults (last: the module's engine dies here) ----------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_worker_raises_engine_dead_error_and_leaves_nothing(llama_tp2):
    client = llama_tp2.llm_engine.engine_core
    ranks = llama_tp2.llm_engine.call_utility("collective_rpc", "describe", [])
    pids = [client.proc.pid] + [r["pid"] for r in ranks]
    ipc_dirs = [client.ipc_dir, *llama_tp2.worker_dirs]
    assert len(ipc_dirs) == 2 and all(os.path.isdir(d) for d in ipc_dirs)
    shm_before = set(os.listdir("/dev/shm"))
    load = slowdown()
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(ranks[1]["pid"], signal.SIGKILL)

    threading.Timer(1.0, kill).start()
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    with pytest.raises(EngineDeadError, match="rank 1"):
        llama_tp2.generate([{"prompt_token_ids": p} for p in TOKEN_PROMPTS * 4], long)
    assert killed_at and time.monotonic() - killed_at[0] < scaled(5.0, load)
    with pytest.raises(EngineDeadError):  # and stays dead
        llama_tp2.generate({"prompt_token_ids": TOKEN_PROMPTS[0]}, GREEDY)
    llama_tp2.shutdown()
    wait_until(lambda: not any(_alive(pid) for pid in pids), 5)
    assert not [pid for pid in pids if _alive(pid)], "orphan processes"
    assert not [d for d in ipc_dirs if os.path.exists(d)], "IPC files left"
    assert set(os.listdir("/dev/shm")) <= shm_before


# ---- through the server -----------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    return [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and _alive(int(p)) and _parent(int(p)) == pid
    ]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


REGEX = r"(ab|cd)[0-9]{2,4}(x|yz)"


def _regex_params() -> SamplingParams:
    regex = StructuredOutputsParams(regex=REGEX)
    return SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=regex)


def _completion_texts(server, body: dict) -> list[str]:
    out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    return [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def test_two_rank_server_answers_as_one_rank_then_dies_whole(tmp_path, monkeypatch):
    """`pagellm serve -tp 2` on random weights (each rank draws the full tensors and keeps its
    part: the same model as one rank's) with SmolLM2's tokenizer, async scheduling (each
    rank keeps one step in flight): the same greedy texts as one rank. Then the server is
    SIGKILLed: its EngineCore follows, the workers follow the EngineCore, no files remain."""
    from server_utils import start_server as _start_server
    from server_utils import wait_healthy as _wait_healthy

    from pagellm.loader import load_tokenizer, resolve_model_source

    folder = make_tiny_hf_model("llama", tmp_path, vocab_size=49152, initializer_range=0.5)
    load_tokenizer(resolve_model_source(None)).save_pretrained(folder)
    engine = ["--load-format", "dummy", "--max-model-len", "256", "--async-scheduling"]
    engine += ["--dtype", "float32"]
    before = _worker_dirs()
    server = _start_server([folder, *engine, "-tp", "2"], str(tmp_path / "server.log"))
    try:
        monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        with LLM(dtype="float32", model=folder, load_format="dummy", max_model_len=256) as llm:
            outputs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
            constrained = llm.generate(PROMPTS[:2], _regex_params(), use_tqdm=False)
        _wait_healthy(server)
        body = {"prompt": PROMPTS[:4], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        assert _completion_texts(server, body) == [o.outputs[0].text for o in outputs]
        # grammar masks reach rank 0 with the step (async: the step waits for them)
        body = {"prompt": PROMPTS[:2], "max_tokens": 24, "temperature": 0, "guided_regex": REGEX}
        texts = _completion_texts(server, body)
        assert texts == [o.outputs[0].text for o in constrained]
        assert all(re.fullmatch(REGEX, t) for t in texts)
        assert "rank1" in server.log()  # the second rank logged its shard
        children = _children(server.proc.pid)
        # the server's sandbox lanes (the constraint check) are its children beside the core
        lanes = [pid for pid in children if "pagellm.sandbox_worker" in _cmdline(pid)]
        (core,) = [pid for pid in children if pid not in lanes]
        assert len(lanes) >= 1
        processes = [core, *_children(core)]
        assert len(processes) == 3
        processes += lanes
        dirs = _worker_dirs() - before
        assert len(dirs) == 1
    finally:
        server.proc.kill()
        server.proc.wait()
    wait_until(lambda: not any(_alive(pid) for pid in processes), 5)
    assert not [pid for pid in processes if _alive(pid)], "orphan processes"
    assert not [d for d in dirs if os.path.exists(d)], "IPC files left"
