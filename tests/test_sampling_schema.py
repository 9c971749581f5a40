"""Sampling settings are validated in one place: `SamplingParams` (its `RANGES`), and the
server's request schema states the same bounds, narrower only where the server says so."""

from __future__ import annotations

import pytest

from pagellm.sampling_params import INT32_MAX, LOGIT_BIAS, RANGES, TOKEN_ID, SamplingParams

pytest.importorskip("pydantic")  # the server's extra

from pagellm.entrypoints.openai import protocol  # noqa: E402

# request field -> the SamplingParams field it becomes (`to_sampling_params`, the servings)
RENAMED = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}
# the server's own, narrower limits: (low, high) of the request field
NARROWER = {"n": (1, protocol.MAX_N), "logprobs": (0, protocol.MAX_LOGPROBS)}
NARROWER["top_logprobs"] = NARROWER["logprobs"]


def _bounds(schema: dict) -> tuple[object, object, bool] | None:
    """(low, high, low_open) of a numeric property (or of its numeric branch)."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") in ("integer", "number") and "const" not in branch:
            if "exclusiveMinimum" in branch:
                return branch["exclusiveMinimum"], branch["maximum"], True
            return branch.get("minimum"), branch.get("maximum"), False
    return None


def _numeric_properties(model) -> dict[str, tuple[object, object, bool]]:
    properties = model.model_json_schema()["properties"]
    found = {name: _bounds(schema) for name, schema in properties.items()}
    return {name: bounds for name, bounds in found.items() if bounds is not None}


@pytest.mark.parametrize("model", [protocol.CompletionRequest, protocol.ChatCompletionRequest])
def test_request_schema_bounds_are_sampling_params_ranges(model):
    checked = []
    for name, (low, high, low_open) in _numeric_properties(model).items():
        field = RENAMED.get(name, name)
        if field not in RANGES:
            continue
        checked.append(field)
        if name in NARROWER:
            assert (low, high, low_open) == (*NARROWER[name], False)
            assert low in RANGES[field] and high in RANGES[field], name
            continue
        allowed = RANGES[field]
        assert (low, high, low_open) == (allowed.low, allowed.high, allowed.low_open), name
    assert {"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens"} <= set(checked)
    assert {"presence_penalty", "frequency_penalty", "repetition_penalty"} <= set(checked)


def test_every_numeric_sampling_field_of_the_request_has_a_range():
    sampling_fields = set(SamplingParams.__struct_fields__)
    for model in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
        numeric = _numeric_properties(model)
        for name in numeric:
            field = RENAMED.get(name, name)
            if field in sampling_fields:
                assert field in RANGES, f"{name}: a SamplingParams field without a range"


def test_token_ids_and_biases_share_the_ranges():
    properties = protocol.CompletionRequest.model_json_schema()["properties"]
    stop_ids = properties["stop_token_ids"]["anyOf"][0]["items"]
    assert (stop_ids["minimum"], stop_ids["maximum"]) == (TOKEN_ID.low, TOKEN_ID.high)
    bias = properties["logit_bias"]["anyOf"][0]["additionalProperties"]
    assert (bias["minimum"], bias["maximum"]) == (LOGIT_BIAS.low, LOGIT_BIAS.high)


@pytest.mark.parametrize("name", sorted(RANGES))
def test_each_range_is_what_sampling_params_accepts(name):
    allowed = RANGES[name]
    edge = {"max_tokens": INT32_MAX} if name == "min_tokens" else {}  # min_tokens <= max_tokens
    SamplingParams(**{name: allowed.high, **edge})
    if not allowed.low_open:
        SamplingParams(**{name: allowed.low})
    below = (
        allowed.low if allowed.low_open else allowed.low - (1 if type(allowed.low) is int else 1e-3)
    )
    if name == "truncate_prompt_tokens":
        below = -2  # -1 is the model's length
    with pytest.raises(ValueError, match=f"SamplingParams.{name} "):
        SamplingParams(**{name: below})


@pytest.mark.parametrize("word", ["", " ", "\t\n", "\x1c", "\ufeff", "ok", " ok "])
def test_bad_words_schema_is_what_the_server_accepts(word):
    """A bad word must hold a character that neither Python's str.strip (SamplingParams'
    check) nor ECMA-262's \\s (a JSON Schema client's) takes for whitespace: the schema's
    pattern and the request model agree, and what they take SamplingParams takes (U+FEFF alone
    is refused here, where SamplingParams would take it: a narrower limit, stated)."""
    import re

    import pydantic

    items = protocol.CompletionRequest.model_json_schema()["properties"]["bad_words"]
    pattern = items["anyOf"][0]["items"]["pattern"]
    body = {"model": "m", "prompt": "hi", "bad_words": [word]}
    if re.search(pattern, word):
        protocol.CompletionRequest.model_validate(body)
        SamplingParams(bad_words=[word])
    else:
        with pytest.raises(pydantic.ValidationError):
            protocol.CompletionRequest.model_validate(body)
    assert bool(re.search(pattern, word)) == (word.strip() not in ("", "\ufeff"))
