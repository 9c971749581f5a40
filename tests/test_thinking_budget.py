"""thinking_token_budget: N thinking tokens, then the reasoning parser's end tag, then the answer.

A tiny random Llama whose tokenizer (the embedded model's) has `<think>` and `</think>` as
added tokens, as Qwen3's has, and a chat template that opens the thinking in the prompt (as
DeepSeek-R1's does). A random model never closes its thinking by itself; a logit bias on
`</think>` makes it close after a few tokens where a test needs a natural end. Engines: the
default (synchronous) one, and one with async scheduling, chunked prefill and a KV cache small
enough to preempt. `ThinkingSpan`, what the runner and the EngineCore both decide with, is
checked against a plain re-reading of the tokens, with the in-flight token unknown.
"""

from __future__ import annotations

import random

import httpx
import pytest
from server_utils import error_of, post, start_server, stop_server, wait_healthy

from pagellm import LLM, SamplingParams
from pagellm.sample.logits_processor.thinking_budget import ThinkingSpan, opens_in

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
QUESTIONS = ["What is 2+2?", "Name a color.", "Why is the sky blue?", "Count to three."]
OPEN = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n" for q in QUESTIONS]
MAX_TOKENS = 16
ENGINE = dict(dtype="float32", max_model_len=256, reasoning_parser="deepseek_r1", seed=0)
# async scheduling; 32-token steps (prompts in chunks); 10 blocks of 16 for 20 requests of
# ~34 tokens (preempted)
TIGHT = dict(async_scheduling=True, max_num_batched_tokens=32, num_gpu_blocks_override=10)


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(llm: LLM, prompts: list, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def think_model(tmp_path_factory) -> str:
    from model_utils import make_tiny_chat_model

    # added, not special: the tags stay in the text, as Qwen3's do
    return make_tiny_chat_model(tmp_path_factory.mktemp("think"), ("<think>", "</think>"), TEMPLATE)


@pytest.fixture(scope="module", params=["sync", "async"])
def think_llm(request, think_model):
    extra = TIGHT if request.param == "async" else {}
    with LLM(think_model, **ENGINE, **extra) as engine:
        yield engine


@pytest.fixture(scope="module")
def tags(think_model) -> tuple[int, int]:
    from pagellm.loader import load_tokenizer, resolve_model_source

    tokenizer = load_tokenizer(resolve_model_source(think_model, "auto", None))
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert tokenizer.encode("<think></think>", add_special_tokens=False) == [start, end]
    return start, end


@pytest.fixture(scope="module")
def unbudgeted(think_llm, tags) -> list[list[int]]:
    ids = token_ids(think_llm, OPEN, greedy())
    assert all(tags[1] not in out for out in ids)  # the model never closes its thinking alone
    return ids


# ---- the engine ----------------------------------------------------------------------------


def test_the_end_tag_comes_after_n_thinking_tokens_then_the_answer(think_llm, tags, unbudgeted):
    end = tags[1]
    budgets = [0, 1, 3, 8]
    prompts = [p for p in OPEN for _ in budgets] + OPEN  # the last four have no budget
    params = [greedy(thinking_token_budget=n) for _ in OPEN for n in budgets]
    outputs = token_ids(think_llm, prompts, params + [greedy()] * len(OPEN))
    assert outputs[-len(OPEN) :] == unbudgeted  # a request without a budget: unchanged
    tokenizer = think_llm.get_tokenizer()
    answers = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs[: len(params)])):
        n, base = budgets[i % len(budgets)], unbudgeted[i // len(budgets)]
        assert len(out) == MAX_TOKENS
        assert out[:n] == base[:n] and out[n] == end, (n, out)  # n thinking tokens, then </think>
        assert end not in out[n + 1 :]
        answers.append({"prompt_token_ids": tokenizer.encode(prompt) + out[: n + 1]})
    # the answer is what the model says after those tokens and </think>, unforced
    again = token_ids(
        think_llm, answers, [greedy(MAX_TOKENS - 1 - n) for _ in OPEN for n in budgets]
    )
    for i, out in enumerate(outputs[: len(params)]):
        assert again[i] == out[budgets[i % len(budgets)] + 1 :]


def _natural_end(think_llm, end: int) -> tuple[float, list[int]]:
    """The smallest logit bias on </think> that closes the thinking of OPEN[0] after 2 to 12
    tokens, and that output."""
    biases = [float(b) for b in range(4, 20, 2)]
    params = [greedy(logit_bias={end: b}) for b in biases]
    for bias, out in zip(biases, token_ids(think_llm, [OPEN[0]] * len(biases), params)):
        if end in out and 2 <= out.index(end) <= 12:
            return bias, out
    pytest.fail("no bias on </think> closes the thinking after 2 to 12 tokens")


def test_a_budget_the_thinking_stays_within_changes_nothing(think_llm, tags):
    end = tags[1]
    bias, natural = _natural_end(think_llm, end)
    k = natural.index(end)  # thinking tokens before the model's own </think>
    # k + 1: the last token in flight may be the model's </think> (async: the core waits)
    budgets = [k, k + 1, k + 5, 10_000]
    outputs = token_ids(
        think_llm,
        [OPEN[0]] * 5,
        [greedy(logit_bias={end: bias}, thinking_token_budget=n) for n in [*budgets, k - 2]],
    )
    assert outputs[:4] == [natural] * 4
    cut = outputs[4]  # a smaller budget cuts the thinking short
    assert cut[: k - 2] == natural[: k - 2] and cut[k - 2] == end


def test_budget_zero_closes_at_once_and_n_samples_each_keep_it(think_llm, tags):
    end = tags[1]
    assert [out[0] for out in token_ids(think_llm, OPEN, greedy(thinking_token_budget=0))] == [
        end
    ] * len(OPEN)
    params = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, thinking_token_budget=4
    )
    for request in think_llm.generate(OPEN[:2], params, use_tqdm=False):
        samples = [c.token_ids for c in request.outputs]
        assert len(samples) == 3 and len({tuple(s) for s in samples}) == 3  # random, distinct
        for out in samples:
            assert out[4] == end and end not in out[:4], out


def test_without_an_open_span_the_budget_waits_for_the_start_tag(think_llm, tags):
    start, end = tags
    closed = [p + "\n</think>\n\n" for p in OPEN]  # thinking off: the template closed the span
    plain = [p.removesuffix("<think>\n") for p in OPEN]  # no span at all
    prompts = closed[:2] + plain[:2]
    baseline = token_ids(think_llm, prompts, greedy())
    assert token_ids(think_llm, prompts, greedy(thinking_token_budget=0)) == baseline
    # the model opens the span itself (a bias makes it write <think>): 2 tokens, then </think>
    opened = greedy(logit_bias={start: 100.0})
    assert token_ids(think_llm, plain[:1], opened)[0] == [start] * MAX_TOKENS
    budgeted = greedy(logit_bias={start: 100.0}, thinking_token_budget=2)
    out = token_ids(think_llm, plain[:1], budgeted)[0]
    assert out[:4] == [start, start, start, end] and out[4:] == [start] * (MAX_TOKENS - 4)


def test_llm_chat_separates_n_tokens_of_reasoning(think_llm, tags):
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    out = think_llm.chat(messages, greedy(thinking_token_budget=3), use_tqdm=False)[0].outputs[0]
    ids, decode = out.token_ids, think_llm.get_tokenizer().decode
    assert ids[3] == tags[1] and tags[1] not in ids[4:]
    assert out.reasoning_content == decode(ids[:3]) and out.text == decode(ids[4:])


def test_every_block_is_free_after_and_the_tight_engine_preempted(think_llm, request):
    engine = think_llm.llm_engine
    num_blocks = engine.call_utility("get_num_kv_blocks")
    assert engine.call_utility("get_num_free_blocks") == num_blocks - 1  # all but the null block
    if request.node.callspec.id == "async":  # the tests above ran preempted, async, chunked
        assert engine.call_utility("get_stats")["num_preemptions"] > 0


def test_a_budget_needs_a_reasoning_parser_and_a_valid_value(llm):
    # `llm`: the embedded model, no reasoning parser
    with pytest.raises(ValueError, match="reasoning parser"):
        llm.generate(["Hi"], SamplingParams(thinking_token_budget=4), use_tqdm=False)
    for bad in (-1, 1.5, "4", 2**31):
        with pytest.raises(ValueError, match="SamplingParams.thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)  # still serving


# ---- the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def think_server(think_model, tmp_path_factory):
    args = [think_model, "--dtype", "float32", "--max-model-len", "256"]
    srv = start_server(
        [*args, "--reasoning-parser", "deepseek_r1"],
        str(tmp_path_factory.mktemp("think-server") / "server.log"),
    )
    try:
        wait_healthy(srv)
        yield srv
    finally:
        stop_server(srv)


def test_the_server_separates_n_tokens_of_reasoning(think_server, think_model, tags):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    body = dict(messages=messages, max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    got = post(think_server, "/v1/chat/completions", {**body, "thinking_token_budget": 3})
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert len(tokens) == 12 and tokens.index("</think>") == 3  # 3 thinking tokens
    assert tokens[3:].count("</think>") == 1
    message = choice["message"]
    assert message["reasoning_content"] + "</think>" + message["content"] == "".join(tokens)
    unbudgeted = post(think_server, "/v1/chat/completions", body).json()["choices"][0]
    assert unbudgeted["message"]["content"] in ("", None)  # all thinking: never closed
    integer = _budget_schema(think_server, "ChatCompletionRequest")["anyOf"][0]
    assert (integer["type"], integer["minimum"], integer["maximum"]) == ("integer", 0, 2**31 - 1)
    for bad in (-1, 1.5, "3"):
        error = error_of(
            post(think_server, "/v1/chat/completions", {**body, "thinking_token_budget": bad}), 400
        )
        assert "thinking_token_budget" in error["message"]


def test_the_server_refuses_a_budget_without_a_reasoning_parser(api_server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    error = error_of(
        post(api_server, "/v1/chat/completions", {**body, "thinking_token_budget": 2}), 400
    )
    assert "--reasoning-parser" in error["message"]
    completion = {"prompt": "Hi", "max_tokens": 4, "thinking_token_budget": 2}
    assert (
        "--reasoning-parser"
        in error_of(post(api_server, "/v1/completions", completion), 400)["message"]
    )
    assert post(api_server, "/v1/chat/completions", body).status_code == 200
    # the server's document says so: only null
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert _budget_schema(api_server, name) == {"anyOf": [{"type": "null"}]}


def _budget_schema(server, model: str) -> dict:
    document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    schema = document["components"]["schemas"][model]["properties"]["thinking_token_budget"]
    return {k: v for k, v in schema.items() if k == "anyOf"}


# ---- ThinkingSpan: the runner's and the EngineCore's decisions ------------------------------


def _reference(prompt, output, budget, start, end) -> int | None:
    """The token forced after `output`, from scratch: the first span, counted in the output."""

    def ends_at(ids, stop, tag, lo):
        return stop - len(tag) >= lo and list(ids[stop - len(tag) : stop]) == tag

    if opens_in(prompt, start, end):
        span = 0
    else:
        span = next((s for s in range(len(output) + 1) if ends_at(output, s, start, 0)), None)
        if span is None:
            return None
    if any(ends_at(output, s, end, span) for s in range(len(output) + 1)):
        return None
    k = len(output) - span - budget
    return end[k] if 0 <= k < len(end) else None


TAGS = [([1], [2]), ([1, 3], [2, 4, 2]), ([5], [2, 2])]


@pytest.mark.parametrize("start, end", TAGS)
def test_the_span_decides_as_a_rereading_would_with_the_last_token_unknown(start, end):
    """Step by step as the runner sees a row: its last output token is a placeholder (any id)
    unless the EngineCore waited for it; a decision never depends on a placeholder, and the
    core waits only at the budget's end (len(end) steps at most)."""
    rng = random.Random(0)
    alphabet = [0, 1, 2, 3, 4, 5]
    for trial in range(400):
        budget = rng.choice([0, 1, 2, 3, 5])
        prompt = rng.choice([[0, 0], [0, *start], [*start, 0, *end], [*start, 3]])
        output = [rng.choice(alphabet) for _ in range(rng.randint(0, 14))]
        runner = ThinkingSpan(budget, start, end, prompt)
        core = ThinkingSpan(budget, start, end, prompt)
        waits = 0
        for m in range(len(output) + 1):
            seen = output[:m]
            if m and not core.must_see_last_token(output[: m - 1], 1):
                seen = [*output[: m - 1], rng.choice(alphabet)]  # the placeholder
            else:
                waits += m > 0
            want = _reference(prompt, output[:m], budget, start, end)
            assert runner.next_forced(seen) == want, (trial, prompt, output[:m], seen)
        if budget > 0:
            assert waits <= len(end), (prompt, output, budget)


@pytest.mark.parametrize("start, end", TAGS)
def test_drafts_after_the_known_tokens_are_looked_at_never_taken_in(start, end):
    """A verify step asks for the token forced after the known output and each draft; the
    drafts may be rejected, so the span must decide later as if it had never seen them."""
    rng = random.Random(1)
    alphabet = [0, 1, 2, 3, 4, 5]
    for trial in range(300):
        budget = rng.choice([0, 1, 2, 4])
        prompt = rng.choice([[0, 0], [0, *start], [*start, 0, *end]])
        output = [rng.choice(alphabet) for _ in range(rng.randint(0, 10))]
        span = ThinkingSpan(budget, start, end, prompt)
        for m in range(len(output) + 1):
            drafts = [rng.choice(alphabet) for _ in range(rng.randint(0, 4))]
            for j in range(len(drafts) + 1):  # the verify rows of a step after output[:m]
                ahead = [*output[:m], *drafts[:j]]
                want = _reference(prompt, ahead, budget, start, end)
                assert span.next_forced(ahead, m) == want, (trial, output[:m], drafts[:j])
