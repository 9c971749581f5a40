"""Speculative decoding with a draft model (`method: "draft_model"`), on the CPU in float32 with
tiny random Llamas of one vocabulary: a 2-layer target, its own first layer as a 1-layer draft
(a few drafts accepted) and the target as its own draft (every draft accepted).

Greedy outputs equal speculation off token for token, with prompts batched, prefilled in
chunks (the draft's catch-up too: prompts longer than the step buffers), preempted by a small
KV cache, max_tokens small and prefix-cache hits; seeded random sampling draws the same tokens
whatever the draft; a draft of another tokenizer or vocabulary, or of fewer positions, is a
start-up error; the scheduler's lookahead slots (where the draft writes its drafts' K/V) are
held past the scheduled tokens and never cached.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from model_utils import make_tiny_hf_model, save_tiny_tokenizer

from pagellm import LLM, SamplingParams
from pagellm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagellm.core.request import Request
from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.engine.arg_utils import EngineArgs
from pagellm.spec_decode.draft_model import first_uncached

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# 32-token steps and 32-token step buffers (max_num_seqs 4): prompts prefill in chunks and the
# draft catches up in chunks; 60 blocks of 4 tokens hold two or three requests: a batch of
# seven preempts
SMALL = dict(
    dtype="float32", block_size=4, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4,
    num_gpu_blocks_override=60,
)  # fmt: skip


def _spec(draft: str) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": K, "adaptive": False}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="module")
def layer0_draft(target, tmp_path_factory) -> str:
    """The target's embeddings, first layer, norm and head: a draft some of whose guesses
    the target makes too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    folder = str(tmp_path_factory.mktemp("draft") / "layer0")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = (5, 17, 33, 70, 3, 40, 120)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(target):
    with LLM(model=target, dtype="float32", block_size=4, max_model_len=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def self_drafted(target):
    """The target drafting for itself, with async scheduling."""
    with LLM(model=target, speculative_config=_spec(target), async_scheduling=True, **SMALL) as llm:
        yield llm


@pytest.fixture(scope="module")
def layer0_drafted(target, layer0_draft):
    with LLM(model=target, speculative_config=_spec(layer0_draft), **SMALL) as llm:
        yield llm


def _run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs


def _counts(outs) -> tuple[int, int]:
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    return drafted, sum(o.metrics.num_accepted_tokens for o in outs)


def test_target_as_its_own_draft_has_every_draft_accepted(reference, self_drafted, prompts):
    want, _ = _run(reference, prompts)
    got, outs = _run(self_drafted, prompts)
    assert got == want
    drafted, accepted = _counts(outs)
    assert drafted > 100 and accepted == drafted
    stats = self_drafted.llm_engine.engine_core.call_utility("get_stats")
    assert stats["num_preemptions"] > 0  # the draft caught up again after each
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == stats["spec_decode_num_draft_tokens"]  # every position's, all


def test_a_smaller_draft_keeps_greedy_outputs_exact(reference, layer0_drafted, prompts):
    want, _ = _run(reference, prompts)
    got, outs = _run(layer0_drafted, prompts)
    assert got == want
    drafted, accepted = _counts(outs)
    assert drafted > 100 and 0 < accepted < drafted
    stats = layer0_drafted.llm_engine.engine_core.call_utility("get_stats")
    assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_max_tokens_is_never_exceeded(reference, self_drafted, layer0_drafted, prompts, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want, _ = _run(reference, prompts[:3], params)
    for llm in (self_drafted, layer0_drafted):
        got, _ = _run(llm, prompts[:3], params)
        assert got == want
        assert all(len(c[0]) == max_tokens for c in got)


def test_prefix_cache_hits_with_a_draft(reference, self_drafted, prompts):
    want, _ = _run(reference, prompts[3:4])
    _run(self_drafted, prompts[3:4])
    got, outs = _run(self_drafted, prompts[3:4])
    assert got == want
    assert outs[0].num_cached_tokens >= 64
    drafted, accepted = _counts(outs)  # the draft computed the cached prompt itself
    assert drafted > 0 and accepted == drafted


def test_seeded_draws_are_the_same_whatever_the_draft(self_drafted, layer0_drafted, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, n=2, seed=11)
    first, _ = _run(self_drafted, prompts[:4], params)
    second, _ = _run(layer0_drafted, prompts[:4], params)
    assert first == second
    assert any(c[0] != c[1] for c in first)  # the two completions of a prompt differ


def test_every_proposal_is_the_drafts_own_greedy_continuation(target, layer0_draft, prompts):
    """In the EngineCore (in this process), after every step: each request's drafts are what
    HF's copy of the draft model decodes greedily after the request's tokens, however its
    draft K/V came about (catch-up chunks, drafts kept from the last proposal, preemption).
    Adaptive drafts: a request skips proposals, so what it decoded in between is checked
    against its last proposal's drafts before their K/V are kept."""
    from conftest import hf_greedy
    from transformers import AutoModelForCausalLM

    hf_draft = AutoModelForCausalLM.from_pretrained(layer0_draft, dtype=torch.float32).eval()
    spec = {**_spec(layer0_draft), "adaptive": True}
    args = EngineArgs(model=target, speculative_config=spec, **SMALL)
    checked, preemptions = check_every_proposal(
        args, prompts, functools.partial(hf_greedy, hf_draft)
    )
    assert checked > 100 and preemptions > 0


def check_every_proposal(
    args: EngineArgs, prompts: list[list[int]], expected: Callable[[list[int], int], list[int]]
) -> tuple[int, int]:
    """`prompts` (greedy) through an EngineCore in this process; as each step's outputs are
    taken in (async scheduling: before the next step is scheduled), each request's drafts
    equal `expected(its tokens, how many)`: (proposals checked, preemptions)."""
    from pagellm.engine.core import EngineCore
    from pagellm.protocol import EngineCoreRequest

    core = EngineCore(args.create_engine_config())
    scheduler, checked = core.scheduler, [0]
    update = scheduler.update_from_output

    def update_and_check(*args):
        outputs = update(*args)
        for request in scheduler.requests.values():
            drafts = request.spec_token_ids
            if drafts:
                assert drafts == expected(request.all_token_ids, len(drafts))
                checked[0] += 1
        return outputs

    scheduler.update_from_output = update_and_check
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), prompt, GREEDY, [], 0.0))
    try:
        while core.has_unfinished_requests():
            core.step()
        return checked[0], scheduler.num_preemptions
    finally:
        core.shutdown()


def test_the_last_proposals_drafts_are_kept_only_where_the_tokens_repeat_them():
    tokens = np.array([5, 6, 7, 8, 9, 10, 11])
    # nothing proposed yet: from the first uncached token, at most the last token
    assert first_uncached(tokens, 0, (0, [])) == 0
    assert first_uncached(tokens, 7, (0, [])) == 6
    # proposed at 4: drafts 9, 10, 12 (K/V written for 9 and 10 at positions 4 and 5)
    assert first_uncached(tokens, 4, (4, [9, 10, 12])) == 6
    assert first_uncached(tokens, 4, (4, [9, 3, 12])) == 5  # the second draft was wrong
    assert first_uncached(tokens, 4, (4, [1, 10, 12])) == 4  # the first too
    assert first_uncached(tokens[:6], 4, (4, [9, 10, 12])) == 5  # the last token: computed
    assert first_uncached(tokens, 4, (4, [9])) == 4  # a lone draft was never fed
    assert first_uncached(tokens, 4, (2, [9, 10])) == 4  # an older proposal: not these


@pytest.mark.parametrize("arch", ["mistral", "phi3", "gemma3", "starcoder2"])
def test_families_drafting_for_themselves_equal_hf(arch, tmp_path):
    """A family's draft K/V as its target's: every layer windowed (Mistral, Phi-3, StarCoder2:
    the blocks before the window freed), longrope crossing its switch (Phi-3: the request
    recomputed with the long factors, the draft too), a rotary table per layer type (Gemma 3).
    Enough blocks not to preempt: a windowed request readmitted on a prefix hit lacks the keys
    before its window, which the draft's catch-up would read (drafts, not outputs, suffer)."""
    from model_utils import hf_generate_greedy, hf_model
    from test_spec_decode_families import ARCHS, _prompts, _run

    folder = make_tiny_hf_model(arch, tmp_path, **ARCHS[arch])
    want = hf_generate_greedy(hf_model(folder), _prompts(), 40)
    got, drafted, accepted = _run(folder, _spec(folder), 64)
    assert got == want
    assert drafted > 100 and accepted == drafted


# ---- start-up errors ---------------------------------------------------------------------


def _with_tokenizer(folder: str, extra: tuple[str, ...] = ()) -> str:
    from transformers import AutoTokenizer

    save_tiny_tokenizer(folder)
    if extra:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.add_tokens(list(extra))
        tokenizer.save_pretrained(folder)
    return folder


def test_a_draft_with_another_tokenizer_is_a_start_up_error(tmp_path):
    target = _with_tokenizer(make_tiny_hf_model("llama", tmp_path / "t"))
    same = _with_tokenizer(make_tiny_hf_model("llama", tmp_path / "s", num_hidden_layers=1))
    other = _with_tokenizer(make_tiny_hf_model("llama", tmp_path / "o"), ("zebra",))
    args = dict(model=target, dtype="float32", max_model_len=128)
    config = EngineArgs(**args, speculative_config=_spec(same)).create_engine_config()
    assert config.draft_model_config.model == same
    assert config.draft_model_config.dtype == torch.float32
    assert config.draft_model_config.max_model_len == 128
    with pytest.raises(ValueError, match="tokenizer differs") as err:
        LLM(**args, speculative_config=_spec(other))
    assert other in str(err.value) and target in str(err.value) and "'zebra'" in str(err.value)


def test_a_draft_of_another_vocabulary_or_length_is_a_start_up_error(tmp_path):
    target = make_tiny_hf_model("llama", tmp_path / "t")
    wider = make_tiny_hf_model("llama", tmp_path / "w", vocab_size=640)
    shorter = make_tiny_hf_model("llama", tmp_path / "s", max_position_embeddings=128)
    args = dict(model=target, dtype="float32", max_model_len=256)
    with pytest.raises(ValueError, match="vocabulary of 640 tokens") as err:
        EngineArgs(**args, speculative_config=_spec(wider)).create_engine_config()
    assert wider in str(err.value) and target in str(err.value)
    with pytest.raises(ValueError, match="holds 128 positions, fewer than max_model_len=256"):
        EngineArgs(**args, speculative_config=_spec(shorter)).create_engine_config()
    ok = EngineArgs(**{**args, "max_model_len": 128}, speculative_config=_spec(shorter))
    assert ok.create_engine_config().draft_model_config.max_model_len == 128
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only"):
        tp2 = EngineArgs(**args, speculative_config=_spec(target), tensor_parallel_size=2)
        tp2.create_engine_config()


# ---- the scheduler's lookahead slots -----------------------------------------------------


def test_lookahead_slots_are_held_and_never_cached():
    spec = SpeculativeConfig.of(_spec("/draft"))
    assert spec.num_lookahead_tokens == K
    assert SpeculativeConfig.of({"method": "ngram"}).num_lookahead_tokens == 0
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=64),
        CacheConfig(block_size=4), num_kv_blocks=20, speculative=spec,
    )  # fmt: skip
    kv = sched.kv_cache_manager
    request = Request("a", list(range(10, 16)), SamplingParams(max_tokens=8))  # 6 prompt tokens
    sched.add_request(request)
    out = sched.schedule()
    assert kv.num_blocks("a") == 3  # 6 tokens + 3 lookahead slots
    _update(sched, out, [20], {"a": [21, 22, 23]})
    out = sched.schedule()  # 1 + 3 drafts from position 6, 3 slots after: 13 slots
    assert out.num_scheduled_tokens == {"a": 4} and kv.num_blocks("a") == 4
    assert kv._reqs["a"].num_cached_blocks == 1  # 7 known tokens: one full block
    _update(sched, out, [21, 30], {})  # one draft accepted, two rolled back
    assert request.num_computed_tokens == 8 and request.num_tokens == 9
    out = sched.schedule()  # 1 token from position 8, 3 slots after: 12 slots
    assert out.num_scheduled_tokens == {"a": 1} and kv.num_blocks("a") == 3
    assert kv._reqs["a"].num_cached_blocks == 2
    # none past the last token worth computing: 6 prompt tokens and max_tokens=1: 6 slots
    sched.add_request(Request("b", list(range(10, 16)), SamplingParams(max_tokens=1)))
    sched.schedule()
    assert kv.num_blocks("b") == 2


def _update(sched: Scheduler, out, tokens: list[int], drafts: dict[str, list[int]]) -> None:
    mro = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[tokens], spec_token_ids=drafts)
    sched.update_from_output(out, mro)
