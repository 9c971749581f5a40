"""Structured outputs through `LLM`: every output of 33 JSON schemas, 7 regexes and 3 choice
lists parses and validates, greedy and sampled, batched with unconstrained requests (which
the masks leave alone), with n > 1, logprobs, stop strings, prefix caching; under async
scheduling with chunked prefill and preemption; bad schemas fail alone with a clear error."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from structured_cases import CHOICES, REGEXES, SCHEMAS, check_json, check_regex

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.engine import input_processor
from pagellm.structured_output.bitmask import apply_token_bitmask

MAX_TOKENS = 96  # every case here completes well within it (asserted: finish_reason "stop")
UNCONSTRAINED = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]


def _chat(llm: LLM, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return llm.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def _constrained(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)


def _cases() -> list[tuple[dict, str, object]]:
    """(constraint kwargs, check kind, expected) for every schema, regex and choice list."""
    cases = [({"json": s}, "json", s) for s in SCHEMAS]
    cases += [({"regex": r}, "regex", r) for r in REGEXES]
    cases += [({"choice": c}, "choice", c) for c in CHOICES]
    return cases


def _check(text: str, kind: str, expected) -> None:
    if kind == "json":
        check_json(text, expected)
    elif kind == "regex":
        check_regex(text, expected)
    else:
        assert text in expected, (text, expected)


@pytest.fixture(scope="module")
def batch(llm):
    """One generate call: every case greedy and sampled, three with n=2 and logprobs, one
    regex with a stop string, and unconstrained prompts between them."""
    prompt = _chat(llm, "Reply in JSON.")
    prompts, params, expected = [], [], []
    for i, (kwargs, kind, spec) in enumerate(_cases()):
        for temperature in (0.0, 0.7):
            prompts.append(prompt)
            params.append(
                SamplingParams(
                    temperature=temperature, seed=i, max_tokens=MAX_TOKENS,
                    structured_outputs=_constrained(**kwargs),
                    logprobs=2 if i % 10 == 0 else None,
                )
            )  # fmt: skip
            expected.append((kind, spec))
        if i % 12 == 0:
            prompts.append(prompt)
            params.append(
                SamplingParams(
                    n=2, temperature=0.7, seed=100 + i, max_tokens=MAX_TOKENS,
                    structured_outputs=_constrained(**kwargs),
                )
            )  # fmt: skip
            expected.append((kind, spec))
        if i % 11 == 0:
            prompts.append(UNCONSTRAINED[i // 11 % 3])
            params.append(SamplingParams(temperature=0.0, max_tokens=16))
            expected.append(("free", None))
    stop = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, stop=["-"],
        structured_outputs=_constrained(regex=r"\d{3}-[a-z]{4}"),
    )  # fmt: skip
    outputs = llm.generate([*prompts, prompt], [*params, stop], use_tqdm=False)
    return outputs[:-1], params, expected, outputs[-1]


def test_every_output_validates(batch):
    outputs, params, expected, _ = batch
    checked = 0
    for out, p, (kind, spec) in zip(outputs, params, expected):
        if kind == "free":
            continue
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (p, repr(completion.text[:200]))
            _check(completion.text, kind, spec)
            checked += 1
    assert checked >= 2 * (len(SCHEMAS) + len(REGEXES) + len(CHOICES))


def test_sampled_outputs_differ_from_greedy(batch):
    """The seeded, sampled runs really sample (within the grammar)."""
    outputs, _, expected, _ = batch
    texts = [o.outputs[0].text for o, (kind, _) in zip(outputs, expected) if kind == "json"]
    greedy, sampled = texts[0::2], texts[1::2]
    assert sum(g != s for g, s in zip(greedy, sampled)) >= len(SCHEMAS) // 3


def test_logprobs_of_constrained_tokens(batch):
    outputs, params, _, _ = batch
    with_logprobs = [(o, p) for o, p in zip(outputs, params) if p.logprobs]
    assert with_logprobs
    for out, _ in with_logprobs:
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            assert math.isfinite(entry[token_id].logprob)  # a sampled token was allowed


def test_stop_string_ends_a_constrained_request(batch):
    stopped = batch[3].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "-"
    assert len(stopped.text) == 3 and stopped.text.isdigit()


def test_unconstrained_rows_are_untouched(llm, batch):
    """The unconstrained requests of the mixed batch got the tokens they get alone."""
    outputs, _, expected, _ = batch
    mixed = [o for o, (kind, _) in zip(outputs, expected) if kind == "free"]
    alone = llm.generate(
        [o.prompt for o in mixed], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]


def test_prefix_cache_shared_by_constrained_requests(batch):
    assert any(o.num_cached_tokens > 0 for o in batch[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "JSON schema"),
        ({"regex": "([a-z"}, "regex"),
        ({"grammar": 'root ::= "a" undefined_rule'}, "grammar"),
        ({"grammar": "root ::= root"}, "matches no string"),
        ({"regex": "(a|b){1,100000}"}, "over the limit max_repetition=1000"),
        ({"json": {"$ref": "https://example.com/s.json"}}, "points outside the schema"),
    ],
)
def test_invalid_constraint_is_a_value_error_before_queueing(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("Hi", SamplingParams(structured_outputs=_constrained(**kwargs)))
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def _step_to_the_end(engine) -> tuple[list[str], dict]:
    """Step until every request is done: the failed ones' errors, the finished outputs."""
    errors, finished = [], {}
    while engine.has_unfinished_requests():
        try:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        except ValueError as e:
            errors.append(str(e))
    return errors, finished


def test_core_fails_a_bad_grammar_alone(llm, monkeypatch):
    """A constraint that reaches the core and fails to compile fails that request only."""
    monkeypatch.setattr(input_processor, "check_structured_outputs", lambda key, limits: None)
    engine = llm.llm_engine
    bad = SamplingParams(structured_outputs=_constrained(regex="(unclosed"), max_tokens=8)
    good = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=_constrained(regex=r"\d{4}")
    )
    engine.add_request("bad-grammar", "Hi", bad)
    engine.add_request("good-grammar", "Hi", good)
    errors, finished = _step_to_the_end(engine)
    assert len(errors) == 1 and "bad-grammar" in errors[0] and "regex" in errors[0]
    check_regex(finished["good-grammar"].outputs[0].text, r"\d{4}")
    num_blocks = engine.call_utility("get_num_kv_blocks")
    assert engine.call_utility("get_num_free_blocks") == num_blocks - 1  # all but the null block


def test_a_constraint_that_allowed_token_ids_empties_fails_alone(llm):
    """A choice whose tokens allowed_token_ids excludes leaves the mask empty: that request
    fails in words (it returned token 0 as finish_reason "stop", the grammar refusing it);
    the one beside it finishes and every KV block is free again."""
    engine = llm.llm_engine
    empty = SamplingParams(max_tokens=4, allowed_token_ids=[5],
                           structured_outputs=_constrained(choice=["hello"]))  # fmt: skip
    good = SamplingParams(temperature=0.0, max_tokens=4)
    engine.add_request("empty-mask", "Hi", empty)
    engine.add_request("beside-it", "Hi", good)
    errors, finished = _step_to_the_end(engine)
    assert len(errors) == 1 and "empty-mask" in errors[0]
    assert "allows no token here that allowed_token_ids, bad_words and min_tokens" in errors[0]
    assert len(finished["beside-it"].outputs[0].token_ids) == 4
    num_blocks = engine.call_utility("get_num_kv_blocks")
    assert engine.call_utility("get_num_free_blocks") == num_blocks - 1


def test_bad_words_never_appear(llm):
    prompt = _chat(llm, "Name the three primary colors.")
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    free = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    words = [w.strip(".,") for w in free.text.split()[:6] if len(w.strip(".,")) > 3][:1]
    words.append(" ".join(free.text.split()[1:3]))  # a phrase: several tokens
    assert len(words) == 2, free.text
    banned = SamplingParams(temperature=0.0, max_tokens=32, bad_words=words)
    out = llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0]
    sequences = input_processor.bad_words_token_ids(llm.get_tokenizer(), words)
    assert any(len(s) > 1 for s in sequences)  # the multi-token path runs too
    for seq in sequences:
        ids = out.token_ids
        assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids))), (seq, out.text)
    assert out.token_ids != free.token_ids


def test_apply_token_bitmask_matches_a_reference():
    """Rows named are masked bit by bit (padding columns past the bitmask's 32 W included);
    other rows are untouched."""
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # 4 words of 32 bits: the last 28 bits cover no token
    logits = torch.randn(5, vocab, generator=gen)
    bits = torch.randint(0, 2, (2, 128), generator=gen, dtype=torch.int32)
    words = (bits.view(2, 4, 32) << torch.arange(32, dtype=torch.int32)).sum(-1, dtype=torch.int64)
    bitmask = torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))  # [2, 4]
    expected = logits.clone()
    for k, row in enumerate((3, 1)):
        expected[row][bits[k, :vocab] == 0] = float("-inf")
    apply_token_bitmask(logits, bitmask, torch.tensor([3, 1]))
    assert torch.equal(logits, expected)


@pytest.fixture(scope="module")
def async_llm():
    """Async scheduling on the CPU, 32-token chunks, and a KV cache small enough to preempt."""
    with LLM(
        dtype="float32", max_model_len=512, async_scheduling=True, max_num_batched_tokens=32,
        num_gpu_blocks_override=12, block_size=16,
    ) as engine:  # fmt: skip
        yield engine


def test_async_scheduling_chunked_prefill_preemption(async_llm):
    prompt = _chat(async_llm, "Reply in JSON with a person's name and age, and nothing else.")
    schemas = [SCHEMAS[0], SCHEMAS[10], SCHEMAS[28]]
    params = [
        SamplingParams(
            n=2, temperature=0.9, seed=i, max_tokens=MAX_TOKENS,
            structured_outputs=_constrained(json=s),
        )
        for i, s in enumerate(schemas)
    ]  # fmt: skip
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = async_llm.generate([prompt] * 4, [*params, free], use_tqdm=False)
    for out, schema in zip(outputs, schemas):
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion.text
            check_json(completion.text, schema)
    assert len(outputs[-1].outputs[0].token_ids) == 24
    assert async_llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0


def test_a_compiling_grammar_is_waited_for_not_polled(monkeypatch):
    """Async scheduling with nothing to run but a grammar compiling: every step waits on the
    compile, leaving the interpreter lock to the compile thread. Steps that queued empty steps
    in a loop starved it: the first constrained request on a GPU waited ~130 s for the backend
    (its imports: each I/O gives the lock up and waits for it back)."""
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    with LLM(dtype="float32", max_model_len=256, async_scheduling=True) as llm:
        core = llm.llm_engine.engine_core.engine_core
        manager = core.structured_output
        release, waits = threading.Event(), []
        compile_now, wait = manager._compile_now, manager.wait_for_compiles
        monkeypatch.setattr(manager, "_compile_now", lambda k: release.wait(60) and compile_now(k))
        monkeypatch.setattr(manager, "wait_for_compiles", lambda f: waits.append(wait(f)))
        params = SamplingParams(max_tokens=4, structured_outputs=_constrained(regex="[a-z]{4}"))
        llm.llm_engine.add_request("held", "A word:", params)
        for _ in range(10):
            assert not core.step().outputs
        assert len(waits) == 10  # each step waited (up to 20 ms) instead of spinning
        release.set()
        finished = []
        while llm.llm_engine.has_unfinished_requests():
            finished += [o for o in llm.llm_engine.step() if o.finished]
        check_regex(finished[0].outputs[0].text, "[a-z]{4}")


THINK, END = 100, 101  # stand-ins for <think> and </think>


@pytest.fixture(scope="module")
def regex_ab(llm):
    """(a factory of requests constrained to "ab" after a thinking span, backend, a, b)."""
    from concurrent.futures import Future

    from pagellm.structured_output.backend import XgrammarBackend, tokenizer_info
    from pagellm.structured_output.request import StructuredOutputRequest

    tokenizer = llm.get_tokenizer()
    backend = XgrammarBackend(tokenizer_info(tokenizer, 49152, [tokenizer.eos_token_id]))
    params = _constrained(regex="ab")
    compiled = backend.compile(params.key())

    def request(prompt: list[int]) -> StructuredOutputRequest:
        future: Future = Future()
        future.set_result((compiled, (THINK, END)))
        so = StructuredOutputRequest(params, future, prompt)
        assert so.poll()
        return so

    a, b = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")
    return request, backend, a, b


def test_constraint_starts_after_the_thinking(llm, regex_ab):
    """With a reasoning parser, tokens up to </think> are not the grammar's, and no mask is
    filled for them; a prompt that closed its thinking starts constrained."""
    request, _, a, b = regex_ab
    tokenizer = llm.get_tokenizer()
    think, end = THINK, END
    thinking = request([1, 2, think])
    assert not thinking.constrains_next
    for token in (5, 6, b, end):  # b would be refused by the grammar: it is thinking
        assert not thinking.accept(token)
    assert thinking.constrains_next and thinking.num_matched == 0
    assert not thinking.accept(a) and thinking.accept(b) is False
    assert thinking.accept(tokenizer.eos_token_id)  # the grammar has terminated
    closed = request([1, think, 7, end, 3])
    assert closed.constrains_next and not closed.accept(a)


def test_drafts_get_a_mask_at_each_constrained_position_and_are_rolled_back(llm, regex_ab):
    """Speculative decoding: a verify step masks the position after each draft the grammar
    takes (none inside the thinking, none past the end), drafts after a refused one are
    dropped, and the matcher is left as it was."""
    request, backend, a, b = regex_ab
    eos = llm.get_tokenizer().eos_token_id
    so = request([1, 2, THINK])
    bitmask = backend.allocate_bitmask(8)
    drafts = [5, END, a, b, eos, 7]
    assert so.fill_positions(bitmask, 0, drafts) == [2, 3, 4]  # after </think>, a, b

    def allows(row: int, token: int) -> bool:
        return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)

    assert allows(0, a) and not allows(0, b)
    assert allows(1, b) and not allows(1, a)
    assert allows(2, eos) and not allows(2, a)
    assert so.valid_drafts(drafts) == drafts[:5]  # nothing after the grammar's end
    assert so.valid_drafts([END, b, a]) == [END]  # b refused: what follows would be rejected
    assert so.num_matched == 0 and not so.constrains_next  # still thinking
    for token in (END, a, b):
        assert not so.accept(token)
    assert so.accept(eos)


def test_chat_passes_tools_and_template_kwargs(llm):
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{{ messages[0].content }}|{{ flag }}|"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = llm.chat(
        [{"role": "user", "content": "Hi"}],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        tools=tools,
        chat_template=template,
        chat_template_kwargs={"flag": "on"},
    )[0]
    assert out.prompt == "[get_weather]Hi|on|"
