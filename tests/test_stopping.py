"""When requests stop (strings, token ids, EOS, lengths) and how bad input is refused."""

from __future__ import annotations

import pytest
from conftest import PROMPTS

from pagellm import SamplingParams

PROMPT = "The history of the Roman Empire begins"
CHAT = [{"role": "user", "content": "Say hello."}]


def _greedy(llm, prompt=PROMPT, **kw):
    params = SamplingParams(temperature=0.0, **{"max_tokens": 40, **kw})
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_stop_string_truncates_text(llm):
    full = _greedy(llm)
    stop = full.text[20:26]
    out = _greedy(llm, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids


def test_stop_string_included_when_asked(llm):
    full = _greedy(llm)
    stop = full.text[20:26]
    out = _greedy(llm, stop=stop, include_stop_str_in_output=True)
    assert out.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_id(llm):
    full = _greedy(llm)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = _greedy(llm, stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    tokenizer = llm.get_tokenizer()
    assert out.text == tokenizer.decode(full.token_ids[:first], skip_special_tokens=True)


def test_eos_min_tokens_ignore_eos_max_tokens(llm):
    natural = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0]
    done = natural.outputs[0]
    assert done.finish_reason == "stop" and done.stop_reason is None
    eos = llm.get_tokenizer().eos_token_id
    assert done.token_ids[-1] == eos and eos not in done.token_ids[:-1]
    n = len(done.token_ids)
    longer = llm.chat(
        CHAT, SamplingParams(temperature=0.0, max_tokens=64, min_tokens=n + 3), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= n + 3 and eos not in longer.token_ids[: n + 2]
    ignored = llm.chat(
        CHAT, SamplingParams(temperature=0.0, max_tokens=n + 5, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(ignored.token_ids) == n + 5 and ignored.finish_reason == "length"
    short = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert short.outputs[0].token_ids == done.token_ids[:2]
    assert short.outputs[0].finish_reason == "length"


def test_max_model_len_caps_output(llm):
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.encode("word " * 1020)[:1020]
    out = llm.generate(
        {"prompt_token_ids": prompt_ids},
        SamplingParams(max_tokens=100, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 1024 - 1020  # prompt + output reach max_model_len
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("temperature", {"temperature": -0.5}),
        ("top_p", {"top_p": 0.0}),
        ("top_k", {"top_k": -3}),
        ("max_tokens", {"max_tokens": 0}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 2}),
        ("n", {"n": 0}),
        ("stop", {"stop": [""]}),
        ("seed", {"seed": 2**70}),  # the engine could not encode it
        ("logit_bias", {"logit_bias": {5: float("nan")}}),
    ],
)
def test_invalid_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_engine_keeps_serving(llm):
    good = _greedy(llm, max_tokens=8)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum model length of 1024"):
        llm.generate({"prompt_token_ids": [1] * 1025}, SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):  # all or nothing: the good one is withdrawn
        llm.generate([PROMPT, ""], SamplingParams(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert _greedy(llm, max_tokens=8).token_ids == good.token_ids


def test_bad_request_does_not_disturb_running_ones(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = _greedy(llm, max_tokens=12).token_ids
    engine.add_request("keep", PROMPT, params)
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", "", params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["keep"]
    assert outputs[-1].outputs[0].token_ids == expected
    blocks = engine.call_utility("get_num_kv_blocks")
    assert engine.call_utility("get_num_free_blocks") == blocks - 1


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=30))
    engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    engine.step()
    blocks = engine.call_utility("get_num_kv_blocks")
    assert engine.call_utility("get_num_free_blocks") == blocks - 1


def test_logprobs_only_where_asked(llm):
    params = [SamplingParams(max_tokens=3, logprobs=2), SamplingParams(max_tokens=3)]
    with_lp, without = (
        o.outputs[0] for o in llm.generate(["Hello", "World"], params, use_tqdm=False)
    )
    assert without.logprobs is None and without.cumulative_logprob is None
    assert len(with_lp.logprobs) == 3
    for token, entry in zip(with_lp.token_ids, with_lp.logprobs):
        assert token in entry and 2 <= len(entry) <= 3
    total = sum(e[t].logprob for t, e in zip(with_lp.token_ids, with_lp.logprobs))
    assert with_lp.cumulative_logprob == pytest.approx(total)
    greedy = SamplingParams(max_tokens=3, logprobs=2, temperature=0.0)
    (out,) = llm.generate(["Hello"], greedy, use_tqdm=False)
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert entry[token].rank == 1  # the argmax is the top-1 entry, with its rank
        assert sorted(lp.rank for lp in entry.values()) == [1, 2]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer().encode(" ".join(PROMPTS))
    greedy = dict(temperature=0.0, max_tokens=6)
    cut = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(truncate_prompt_tokens=9, **greedy),
        use_tqdm=False,
    )[0]
    tail = llm.generate({"prompt_token_ids": ids[-9:]}, SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-9:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    long = ids * (1100 // len(ids) + 1)  # longer than max_model_len (1024): refused, unless cut
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.generate({"prompt_token_ids": long}, SamplingParams(**greedy), use_tqdm=False)
    params = SamplingParams(truncate_prompt_tokens=1000, **greedy)
    out = llm.generate({"prompt_token_ids": long}, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-1000:] and len(out.outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
