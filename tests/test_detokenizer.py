"""Incremental detokenization: multi-byte characters, held-back stop-string prefixes."""

from __future__ import annotations

import pytest

from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.sampling_params import SamplingParams

TEXTS = ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 and ünïcödé", "naïve café — “quotes”"]


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer, without its engine."""
    from pagellm.loader import load_tokenizer, resolve_model_source

    return load_tokenizer(resolve_model_source(None, "auto", None))


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams())
    seen = []
    for token in ids:
        detok.update([token])
        seen.append(detok.text)
        assert "\ufffd" not in detok.text  # never a half character
    assert detok.text == tokenizer.decode(ids)
    assert len(ids) > len(text.split())  # some characters really span several tokens


def test_multi_byte_character_split_across_tokens(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    detok.update(ids[:1])
    assert detok.text == ""
    detok.update(ids[1:])
    assert detok.text == "🎉"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("tail", ["€".encode()[:2], b"\xa1", b"\xe6\x97", b"\xf0\x9f\x8e"])
def test_a_prompt_ending_in_part_of_a_character_stays_out_of_the_output(
    tokenizer, tail, skip_special_tokens
):
    """A prompt of byte tokens that ends mid-character, or in a byte no character starts
    with, then special tokens: the output's text is its own tokens' (HF's decode of the
    output ids), not the prompt's stray bytes as U+FFFD in front of it. Other prompts keep
    their context (the first word's leading space)."""
    byte_tokens = [tokenizer.convert_tokens_to_ids(_byte_char(b)) for b in tail]
    prompt = tokenizer.encode("Hello") + byte_tokens + [7, 9]  # <gh_stars>, <issue_comment>
    output = tokenizer.encode(" ixtzburg wörld", add_special_tokens=False)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    for token in output:
        detok.update([token])
    assert detok.text == tokenizer.decode(output) == " ixtzburg wörld"
    clean = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"), params)
    clean.update(output)
    assert clean.text == " ixtzburg wörld"


def _byte_char(b: int) -> str:
    """The byte-level BPE alphabet's character for byte `b` (GPT-2's table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def test_stop_string_prefix_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["STOP"]))
    ids = tokenizer.encode("abc ST")
    assert detok.update(ids) is None
    assert detok.output_text(finished=False) == "abc"  # "ST" might start "STOP"
    more = tokenizer.encode("OP and more")
    assert detok.update(more) == "STOP"
    assert detok.output_text(finished=True) == "abc "


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("stop here")
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["stop"], min_tokens=10))
    assert detok.update(ids) is None


# ---- stop strings at the edges ---------------------------------------------------------------
# Each test pins one edge where an off-by-one or a wrong slice lets a stop string (or a part of
# one) through, or stops too early: the hold-back slice, the search window, min_tokens.


def _ids(tokenizer, *texts: str) -> list[list[int]]:
    """Token ids of each text, encoded on its own: the updates a test feeds one by one."""
    return [tokenizer.encode(t) for t in texts]


def _detok(tokenizer, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, [1], SamplingParams(**params))


def _until_stop(detok: IncrementalDetokenizer, updates: list[list[int]]) -> str | None:
    """Feeds updates until one matches a stop string (the caller stops there too)."""
    return next((s for s in map(detok.update, updates) if s is not None), None)


def test_hold_back_while_the_stop_string_is_longer_than_the_text(tokenizer):
    detok = _detok(tokenizer, stop=["abcdefgh"])  # holds back 7 characters
    assert detok.update(tokenizer.encode("hello")) is None
    assert detok.output_text(finished=False) == ""  # not "hel": len 5 - 7 < 0
    assert detok.update(tokenizer.encode(" world")) is None
    assert detok.output_text(finished=False) == "hell"  # 11 - 7
    assert detok.output_text(finished=True) == "hello world"


def test_stop_string_completed_by_one_character_after_a_hold_back(tokenizer):
    first, last = _ids(tokenizer, "abc STO", "P")
    detok = _detok(tokenizer, stop=["STOP"])
    assert detok.update(first) is None
    assert detok.output_text(finished=False) == "abc "  # "STO" could start "STOP"
    assert detok.update(last) == "STOP"  # it starts exactly hold (3) characters back
    assert detok.text == "abc "


def test_stop_string_early_in_one_update_of_many_tokens(tokenizer):
    detok = _detok(tokenizer, stop=["STOP"])
    assert detok.update(tokenizer.encode("xx STOP and then a good deal more text")) == "STOP"
    assert detok.text == "xx "


def test_the_stop_string_that_ends_first_wins(tokenizer):
    detok = _detok(tokenizer, stop=["STOP", "X"])
    assert detok.update(tokenizer.encode("aXbSTOP")) == "X"  # not "STOP": "X" came first
    assert detok.text == "a"
    inner = _detok(tokenizer, stop=["STOP", "TO"])  # "STOP" starts first, "TO" ends first
    assert inner.update(tokenizer.encode("xSTOP")) == "TO"
    assert inner.text == "xS"
    for stops in (["bc", "abc"], ["abc", "bc"]):  # both end at one character: the longer wins
        tie = _detok(tokenizer, stop=stops)
        assert tie.update(tokenizer.encode("zabc")) == "abc"
        assert tie.text == "z"


def test_hold_back_covers_the_longest_stop_string(tokenizer):
    detok = _detok(tokenizer, stop=["X", "STOP"])
    assert detok.update(tokenizer.encode("abc STO")) is None
    assert detok.output_text(finished=False) == "abc "  # 3 held back, for "STOP", not 0 for "X"


@pytest.mark.parametrize("one_update", [False, True])
def test_stop_strings_ignore_the_first_min_tokens(tokenizer, one_update):
    pieces = ["a", " ST", "OP", " b", " ST", "OP", " c"]  # "STOP" ends with token 3, then 6
    ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(p))[0] for p in pieces]
    assert tokenizer.decode(ids) == "a STOP b STOP c"

    def run(min_tokens: int) -> tuple[str | None, str]:
        detok = _detok(tokenizer, stop=["STOP"], min_tokens=min_tokens)
        found = _until_stop(detok, [ids] if one_update else [[t] for t in ids])
        return found, detok.text

    assert run(0) == ("STOP", "a ")
    assert run(2) == ("STOP", "a ")  # token 3 completes it: after the first 2 tokens
    assert run(3) == ("STOP", "a STOP b ")  # token 3 is one of the first 3: the next one
    assert run(6) == (None, "a STOP b STOP c")


def test_stop_string_across_multi_byte_characters(tokenizer):
    ids = tokenizer.encode("a🎉b 日本語 c")
    emoji = _detok(tokenizer, stop=["🎉"])
    outputs = []
    for token in ids:
        found = emoji.update([token])
        outputs.append(emoji.output_text(finished=found is not None))
        if found:
            break
    assert found == "🎉" and emoji.text == "a"
    assert all("\ufffd" not in text for text in outputs)
    cjk = _detok(tokenizer, stop=["本語"], include_stop_str_in_output=True)
    assert _until_stop(cjk, [[t] for t in ids]) == "本語"
    assert cjk.text == "a🎉b 日本語"


def test_include_stop_str_in_output_holds_back_then_keeps_it(tokenizer):
    first, last = _ids(tokenizer, "abc STO", "P and more")
    detok = _detok(tokenizer, stop=["STOP"], include_stop_str_in_output=True)
    assert detok.update(first) is None
    assert detok.output_text(finished=False) == "abc "
    assert detok.update(last) == "STOP"
    assert detok.text == "abc STOP"


# ---- the output processor: stop strings in DELTA outputs -------------------------------------


def _feed(tokenizer, params: SamplingParams, outputs: list) -> tuple[list, list[str]]:
    """Runs EngineCoreOutputs for one request "r" through an OutputProcessor: its RequestOutputs
    and the ids it asks the core to abort."""
    from pagellm.engine.output_processor import OutputProcessor
    from pagellm.protocol import EngineCoreRequest

    processor = OutputProcessor(tokenizer)
    processor.add_request("p", EngineCoreRequest("r", [1, 2, 3], params, [2], 0.0))
    results, aborts = [], []
    for out in outputs:
        got, to_abort = processor.process_outputs([out])
        results += got
        aborts += to_abort
    assert not processor.has_unfinished_requests()
    return results, aborts


def _token_outputs(tokenizer, text: str, **last) -> list:
    from pagellm.protocol import EngineCoreOutput

    ids = tokenizer.encode(text)
    outs = [EngineCoreOutput("r", [t]) for t in ids]
    for key, value in last.items():
        setattr(outs[-1], key, value)
    return outs


def test_delta_outputs_never_carry_a_part_of_a_stop_string(tokenizer):
    from pagellm.sampling_params import RequestOutputKind

    params = SamplingParams(stop=["STOP", "the end"], output_kind=RequestOutputKind.DELTA)
    text = "once upon a time STO STOP and more"
    results, aborts = _feed(tokenizer, params, _token_outputs(tokenizer, text))
    deltas = [r.outputs[0].text for r in results]
    assert "".join(deltas) == "once upon a time STO "
    assert results[-1].finished and results[-1].outputs[0].finish_reason == "stop"
    assert results[-1].outputs[0].stop_reason == "STOP"
    assert aborts == ["r"]  # the core still runs it: the caller must abort it
    assert len(deltas) > 5  # streamed in many pieces, not all at the end


def test_a_stop_string_in_the_last_tokens_overrides_length(tokenizer):
    from pagellm.protocol import FinishReason

    params = SamplingParams(stop=["STOP"], max_tokens=4)
    outs = _token_outputs(tokenizer, "xx STOP", finish_reason=FinishReason.LENGTH)
    results, aborts = _feed(tokenizer, params, outs)
    final = results[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("xx ", "stop", "STOP")
    assert aborts == []  # the core has already finished it


def test_stop_token_text_is_left_out_unless_asked(tokenizer):
    from pagellm.protocol import FinishReason

    the = tokenizer.encode(" the")[0]
    for include, expected in ((False, "once upon"), (True, "once upon the")):
        params = SamplingParams(stop_token_ids=[the], include_stop_str_in_output=include)
        outs = _token_outputs(
            tokenizer, "once upon the", finish_reason=FinishReason.STOP, stop_reason=the
        )
        final = _feed(tokenizer, params, outs)[0][-1].outputs[0]
        assert (final.text, final.stop_reason) == (expected, the)
