"""Property-based tests (hypothesis) of the boundary: any value of any field, in
`SamplingParams` or in the server's request models, either validates (and then crosses the
process boundary and runs engine steps) or raises ValueError naming the field.

Values come near each field's edges (0, -1, int32 / int64 / uint64 limits, NaN, inf) and from
any JSON type, as a client or an attacker would send them. `PAGELLM_FUZZ_EXAMPLES` multiplies
the number of examples for a deeper run than CI's.
"""

from __future__ import annotations

import os
import re

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pagellm import EngineArgs, SamplingParams
from pagellm.engine.output_processor import fan_out
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.protocol import EngineCoreRequest
from pagellm.sampling_params import RequestOutputKind

_SCALE = int(os.environ.get("PAGELLM_FUZZ_EXAMPLES", "1"))
_EDGES = [0, 1, -1, 2, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
INTS = st.sampled_from(_EDGES) | st.integers(-3, 40) | st.integers(-(2**70), 2**70)
FLOATS = st.floats() | st.sampled_from([0.0, 1e-6, 0.5, 1.0, 2.0, 3.5e38, 1e300, -0.0])
STRINGS = st.text(max_size=8) | st.sampled_from(["", "\ud800", "stop", "日本"])
TOKEN_IDS = st.lists(INTS, max_size=4)


def _field_values() -> dict[str, st.SearchStrategy]:
    """Per field: values of its type near its edges (or anything JSON can carry)."""
    number = INTS | FLOATS
    fields = {name: number for name in ("temperature", "top_p", "min_p", "repetition_penalty")}
    fields |= {name: number for name in ("presence_penalty", "frequency_penalty")}
    fields |= {
        name: INTS | st.none()
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs")
    }
    fields |= {"prompt_logprobs": INTS | st.none(), "truncate_prompt_tokens": INTS | st.none()}
    fields |= {"thinking_token_budget": INTS | st.none()}
    fields |= {
        "reasoning_tag_ids": st.tuples(TOKEN_IDS, TOKEN_IDS) | st.lists(TOKEN_IDS, max_size=3)
    }
    fields |= {
        "stop": STRINGS | st.lists(STRINGS, max_size=3) | st.none(),
        "stop_token_ids": TOKEN_IDS | st.none(),
        "allowed_token_ids": TOKEN_IDS | st.none(),
        "logit_bias": st.dictionaries(INTS | STRINGS, number, max_size=3) | st.none(),
        "output_kind": st.sampled_from(list(RequestOutputKind)) | INTS,
    }
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        fields[name] = st.booleans()
    return fields


FIELDS = _field_values()


def _some_fields(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A few fields (so that one bad value is not always hidden by another), one of them
    perhaps of any JSON type."""
    names = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)
    typed = names.flatmap(lambda ns: st.fixed_dictionaries({n: fields[n] for n in ns}))
    any_type = st.fixed_dictionaries({}, optional={n: JSON for n in fields})
    return st.one_of(typed, typed, typed, st.tuples(typed, any_type).map(lambda t: t[0] | t[1]))


PARAMS = _some_fields(FIELDS)


def _validate(kwargs: dict) -> SamplingParams | None:
    """The params, or None for a ValueError that names one of the fields given."""
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        named = re.search(r"SamplingParams\.(\w+)", str(e))
        assert named and named.group(1) in kwargs, f"{e} does not name a field of {kwargs}"
        return None
    decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    request = EngineCoreRequest("r", [1, 2, 3], params, [2], 0.0)
    assert decoder.decode(msgspec.msgpack.encode(request)) == request  # the core can read it
    if params.n <= 8:  # and each child of the fan-out (seeds seed + i)
        for child, _, _ in fan_out(request):
            assert decoder.decode(msgspec.msgpack.encode(child)) == child
    return params


@settings(max_examples=400 * _SCALE, deadline=None, derandomize=True)
@given(PARAMS)
def test_any_sampling_params_validate_or_raise_value_error(kwargs):
    _validate(kwargs)


# ---- validated params run -------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    """An in-process engine on a tiny model: every step is a call, any exception reaches us."""
    from pagellm.engine.llm_engine import LLMEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
        args = EngineArgs(
            model=tiny_chat_model,
            dtype="float32",
            max_model_len=128,
            kv_cache_memory_bytes=1 << 23,
            max_logprobs=5,
        )
        engine = LLMEngine.from_engine_args(args)
    yield engine
    engine.shutdown()


RUNNABLE = _some_fields({**FIELDS, "n": st.integers(-1, 3) | st.none()})


@settings(
    max_examples=40 * _SCALE,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(RUNNABLE)
def test_validated_sampling_params_run_engine_steps(engine, kwargs):
    params = _validate(kwargs)
    if params is None:
        return
    try:
        engine.add_request("fuzz", {"prompt_token_ids": [1, 200, 300, 400]}, params)
    except ValueError:
        return  # the engine's own checks (token ids in the vocabulary, logprob counts)
    for _ in range(3):
        engine.step()  # a request the engine failed would raise ValueError here
    engine.abort_request("fuzz")
    assert not engine.has_unfinished_requests()
    num_blocks = engine.call_utility("get_num_kv_blocks")
    engine.step()
    assert engine.call_utility("get_num_free_blocks") == num_blocks - 1


# ---- the server's request models ---------------------------------------------------------------


def _request_bodies(extra: dict) -> st.SearchStrategy:
    openai_names = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "stop"}
    openai_names |= {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"}
    openai_names |= {"allowed_token_ids", "truncate_prompt_tokens", "ignore_eos", "min_tokens"}
    openai_names |= {"stop_token_ids", "include_stop_str_in_output", "skip_special_tokens"}
    openai_names |= {"thinking_token_budget"}
    fields = {name: FIELDS[name] for name in openai_names}
    fields |= {"stream": st.booleans(), "max_tokens": INTS, **extra}
    return _some_fields(fields)


COMPLETIONS = _request_bodies(
    {"prompt": JSON | STRINGS | TOKEN_IDS, "logprobs": JSON | INTS, "echo": JSON}
)
CHATS = _request_bodies(
    {
        "messages": JSON
        | st.lists(st.fixed_dictionaries({"role": JSON | STRINGS, "content": JSON | STRINGS})),
        "logprobs": JSON | st.booleans(),
        "top_logprobs": JSON | INTS,
    }
)


@settings(max_examples=300 * _SCALE, deadline=None, derandomize=True)
@given(st.sampled_from([CompletionRequest, ChatCompletionRequest]), st.data())
def test_any_request_body_is_a_400_or_valid_sampling_params(model, data):
    body = data.draw(COMPLETIONS if model is CompletionRequest else CHATS)
    try:
        request = model.model_validate(body)  # FastAPI's check: a ValidationError is a 400
    except ValidationError:
        return
    max_tokens = getattr(request, "max_tokens", None) or 16
    logprobs = request.logprobs if model is CompletionRequest else request.top_logprobs
    try:
        params = request.to_sampling_params(max_tokens, logprobs)
    except ValueError as e:
        assert re.search(r"SamplingParams\.\w+|not supported", str(e)), e
        return
    _validate({f: getattr(params, f) for f in params.__struct_fields__})
