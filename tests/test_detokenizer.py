"""Incremental detokenization: multi-byte characters, held-back stop-string prefixes."""

from __future__ import annotations

import pytest

from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.sampling_params import SamplingParams

TEXTS = ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 and ünïcödé", "naïve café — “quotes”"]


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams())
    seen = []
    for i, token in enumerate(ids):
        detok.update([token], i + 1)
        seen.append(detok.text)
        assert "\ufffd" not in detok.text  # never a half character
    assert detok.text == tokenizer.decode(ids)
    assert len(ids) > len(text.split())  # some characters really span several tokens


def test_multi_byte_character_split_across_tokens(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    detok.update(ids[:1], 1)
    assert detok.text == ""
    detok.update(ids[1:], len(ids))
    assert detok.text == "🎉"


def test_stop_string_prefix_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["STOP"]))
    ids = tokenizer.encode("abc ST")
    assert detok.update(ids, len(ids)) is None
    assert detok.output_text(finished=False) == "abc"  # "ST" might start "STOP"
    more = tokenizer.encode("OP and more")
    assert detok.update(more, len(ids) + len(more)) == "STOP"
    assert detok.output_text(finished=True) == "abc "


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("stop here")
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["stop"], min_tokens=10))
    assert detok.update(ids, len(ids)) is None
