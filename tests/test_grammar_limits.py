"""The checks a constraint passes before the EngineCore compiles it (no model needed): the
limits of StructuredOutputsConfig (each refused with the limit's name and how to raise it, each
before xgrammar sees the text where the text shows it), grammars that match no string, $refs
that leave the schema, errors in our words, and the validator in a worker process with the
model's vocabulary."""

from __future__ import annotations

import contextlib
import json
import re
import time

import pytest
from structured_cases import CHOICES, REGEXES, SCHEMAS

from pagellm.config import EngineConfig, StructuredOutputsConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.structured_output import backend
from pagellm.structured_output.limits import json_depth, regex_repetition
from pagellm.structured_output.params import StructuredOutputsParams
from pagellm.structured_output.validator import validate, write_vocabulary

LIMITS = StructuredOutputsConfig()
# what must never reach a user: C++ log lines and checks, Python exception names, tracebacks
INTERNAL = re.compile(
    r"\.cc:|\.h:|Check failed|is false|\[\d\d:\d\d:\d\d\]|Traceback|Error\b|Exception|"
    r"Expecting value|char \d+|TokenIds|xgrammar::|std::"
)


def key(**constraint) -> tuple[str, str]:
    return StructuredOutputsParams(**constraint).key()


def refused(limits: StructuredOutputsConfig = LIMITS, **constraint) -> str:
    with pytest.raises(ValueError) as info:
        validate(key(**constraint), limits)
    message = str(info.value)
    assert not INTERNAL.search(message), message
    return message


def nested_arrays(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


# ---- limits ----------------------------------------------------------------------------------

OVER_LIMITS = [
    # (constraint, the limit it is over, a value of that limit that lets it through)
    ({"regex": "a" * (LIMITS.max_spec_chars + 1)}, "max_spec_chars", 1 << 20),
    ({"json": nested_arrays(64)}, "max_json_depth", 70),  # 65 levels of objects
    ({"json": {"anyOf": [{"type": "null"}, {"allOf": [nested_arrays(70)]}]}}, "max_json_depth", 80),
    ({"regex": "(a|b){1,100000}"}, "max_repetition", 100000),
    ({"regex": "((a{1,100}){1,100}){1,100}"}, "max_repetition", 10**6),
    ({"regex": r"(\d{3}-){1,500}"}, "max_repetition", 1500),
    ({"json": {"type": "string", "pattern": "^((a?){1,100}){1,100}$"}}, "max_repetition", None),
    ({"json": {"patternProperties": {"^x{5000}$": {}}}}, "max_repetition", 5000),
    ({"grammar": 'root ::= a{1,1000}\na ::= b{1,1000}\nb ::= "x"'}, "max_repetition", 10**6),
    ({"grammar": 'root ::= ("x" | "y"){2000,}'}, "max_repetition", 2000),
    ({"grammar": 'root ::= Regex("[a-z]{1,5000}")'}, "max_repetition", 5000),
    ({"choice": [f"c{i}" for i in range(5000)]}, "max_enum_values", 5000),
    ({"json": {"enum": list(range(5000))}}, "max_enum_values", 5000),
    ({"grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(5000))}, "max_enum_values", 5000),
]


@pytest.mark.parametrize("constraint, limit, enough", OVER_LIMITS)
def test_a_constraint_over_a_limit_names_it_and_how_to_raise_it(constraint, limit, enough):
    message = refused(**constraint)
    assert f"over the limit {limit}={getattr(LIMITS, limit)}" in message, message
    flag = "--structured-outputs-config." + limit.replace("_", "-")
    assert f"structured_outputs_config={{'{limit}': N}}" in message and flag in message
    if enough is not None:  # raised, the same constraint passes
        validate(key(**constraint), StructuredOutputsConfig(**{limit: enough}))


def test_limits_that_the_text_shows_are_checked_before_xgrammar(monkeypatch):
    """The issue's 899-level schema (95 s in xgrammar) and the 101 s pattern: refused in
    milliseconds, xgrammar never called."""
    monkeypatch.setattr(backend, "parse", lambda key: pytest.fail(f"xgrammar parsed {key[0]}"))
    deep = {"json": nested_arrays(899)}
    assert len(json.dumps(deep["json"])) > 25_000
    pattern = {"json": {"type": "string", "pattern": "((a?){1,100}){1,100}"}}
    for constraint in (deep, pattern, {"regex": "a" * 300_000}, {"regex": "a{99999999999}"}):
        start = time.perf_counter()
        refused(**constraint)
        assert time.perf_counter() - start < 0.5


def test_the_default_limits_let_real_shapes_through():
    """Every schema, regex and choice list the structured-output tests generate with, and
    shapes near each limit (cheap: measured in docs/structured_outputs.md)."""
    for schema in SCHEMAS:
        validate(key(json=schema), LIMITS)
    for regex in REGEXES:
        validate(key(regex=regex), LIMITS)
    for choice in CHOICES:
        validate(key(choice=choice), LIMITS)
    validate(key(json=nested_arrays(63)), LIMITS)
    validate(key(regex="((a{1,10}){1,10}){1,10}"), LIMITS)
    validate(key(regex=r"[0-9a-f]{1000}|\d{1,1000}"), LIMITS)
    validate(key(json={"type": "array", "items": {"type": "string", "maxLength": 10**6},
                       "minItems": 10, "maxItems": 10**6}), LIMITS)  # fmt: skip
    validate(key(choice=[f"c{i}" for i in range(4096)]), LIMITS)
    validate(key(json_object=True), LIMITS)


def test_regex_repetition_counts_nesting_not_neighbours():
    assert regex_repetition(r"\d{3}-\d{4}") == 4
    assert regex_repetition(r"(ab){2}(cd){300}") == 300
    assert regex_repetition(r"((a{1,10}){2,}){1,7}") == 140
    assert regex_repetition(r"[{]{5}\{9999}x{3}") == 5  # a class and an escaped brace
    assert regex_repetition(r"\p{L}{3}|a{2,}") == 3
    assert regex_repetition(r"(a(b){4}c)*") == 4  # *, +, ? count 1
    assert regex_repetition("a{" + "9" * 40 + "}") == 10**12


def test_json_depth_skips_strings():
    assert json_depth('{"a": "[[[[{{{{", "b": [[1], {"c": []}]}') == 4
    assert json_depth(json.dumps(nested_arrays(10))) == 11


# ---- grammars that match nothing -------------------------------------------------------------

EMPTY = [
    {"grammar": "root ::= root"},
    {"grammar": 'root ::= "a" root'},
    {"grammar": 'root ::= a\na ::= "(" b ")"\nb ::= a | "x" a'},
    {"grammar": 'root ::= "x" [^\\0-\\U0010FFFF]'},
    {"grammar": 'root ::= "x" a{1,3}\na ::= "y" a'},
    {"json": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}},
    {"json": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
    {
        "json": {
            "$defs": {
                "n": {"type": "array", "prefixItems": [{"$ref": "#/$defs/n"}], "minItems": 1}
            },
            "$ref": "#/$defs/n",
        }
    },
]


@pytest.mark.parametrize("constraint", EMPTY)
def test_a_grammar_that_matches_no_string_is_refused(constraint):
    assert "matches no string" in refused(**constraint)


VALID_GRAMMARS = [
    'root ::= "a" root | "b"',
    'root ::= x\nx ::= "(" x ")" | ""',
    'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
    'factor ::= [0-9]+ | "(" expr ")"',
    'root ::= item ("," item){0,3}\nitem ::= [a-z]{1,8} | "[" root "]"',
    'root ::= a\na ::= "x" b | "y"\nb ::= "z" a',
    'root ::= [^\\0-\\x7f] | "ascii"',
    'root ::= "x"?',
    'root ::= ""',
    'root ::= TagDispatch(("<t>", body))\nbody ::= "ok"',
    'root ::= Regex("[a-z]+") "!"',
    'root ::= ("a" "b"*){2,3}',
]


@pytest.mark.parametrize("grammar", VALID_GRAMMARS)
def test_grammars_that_terminate_are_kept(grammar):
    validate(key(grammar=grammar), LIMITS)


def test_recursive_schemas_with_a_way_out_are_kept():
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"]}  # fmt: skip
    linked = {
        "$defs": {
            "n": {
                "type": "object",
                "required": ["next"],
                "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
            }
        },
        "$ref": "#/$defs/n",
    }
    for schema in (tree, linked):
        validate(key(json=schema), LIMITS)


def test_the_checks_know_this_xgrammar():
    """A new serialization version would skip the grammar checks silently: fail here first."""
    import xgrammar as xgr

    from pagellm.structured_output.grammar_check import KNOWN_VERSIONS

    serialized = json.loads(xgr.Grammar.from_ebnf('root ::= "a"').serialize_json())
    assert serialized["__VERSION__"] in KNOWN_VERSIONS


# ---- $ref ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ref, says",
    [
        ("https://example.com/schema.json", "points outside the schema"),
        ("http://example.com/s#/a", "points outside the schema"),
        ("file:///etc/passwd", "points outside the schema"),
        ("other.json#/$defs/a", "points outside the schema"),
        ("#/$defs/missing", "does not resolve inside it"),
        ("#/properties/a/items", "does not resolve inside it"),
        ("#anchor", "is not a JSON pointer"),
    ],
)
def test_a_ref_that_leaves_or_misses_the_schema_is_refused(ref, says):
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "$defs": {"b": {}}}
    message = refused(json=schema)
    assert says in message and json.dumps(ref) in message, message


def test_refs_inside_the_schema_resolve():
    schema = {
        "$defs": {"a/b": {"type": "integer"}, "list": {"type": "array", "items": {"$ref": "#"}}},
        "type": "object",
        "properties": {
            "x": {"$ref": "#/$defs/a~1b"},
            "y": {"$ref": "#/$defs/list"},
            "const": {"const": {"$ref": "https://not.a/ref"}},  # data, not a schema
            "$ref": {"type": "string"},  # a property named $ref
        },
    }
    validate(key(json=schema), LIMITS)


def test_json_object_mode_is_an_object_and_compact_when_asked():
    """json_object is any JSON *object* (OpenAI's mode; vLLM compiles {"type": "object"}),
    with disable_any_whitespace honoured: xgrammar's builtin JSON grammar took `[1]` (the
    model's greedy reply) and any spacing."""
    import xgrammar.testing as xt

    spaced = backend.parse(key(json_object=True))
    compact = backend.parse(key(json_object=True, disable_any_whitespace=True))
    for grammar in (spaced, compact):
        assert xt._is_grammar_accept_string(grammar, '{"a": [1, {"b": null}]}')
        for not_an_object in ("[1]", "5", '"x"', "null"):
            assert not xt._is_grammar_accept_string(grammar, not_an_object)
    assert xt._is_grammar_accept_string(spaced, '{ "a" :\n 1 }')
    assert not xt._is_grammar_accept_string(compact, '{ "a" :\n 1 }')


# ---- keywords xgrammar drops ------------------------------------------------------------------

_INT = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.mark.parametrize(
    "schema, keyword, violating",
    [
        ({"type": "array", "items": _INT, "maxItems": 3, "uniqueItems": True}, "uniqueItems",
         "[1, 1]"),
        ({"type": "array", "items": _INT, "maxItems": 3, "contains": {"const": 7}}, "contains",
         "[1]"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf", "5"),
        ({**_INT, "not": {"const": 0}}, "not", "0"),
        ({"type": "object", "properties": {"k": _INT}, "if": {"properties": {"k": {"const": 1}}},
          "then": {"required": ["k"]}, "else": {"maxProperties": 0}}, "if", '{"k": 2}'),
        ({"type": "object", "properties": {"a": _INT, "b": _INT},
          "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a": 1}'),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf", "1.2"),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength", '"abcdef"'),
        ({"type": "string", "format": "email", "maxLength": 6}, "maxLength", '"abcdefgh@x.com"'),
        ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "maxLength",
         '"abc"'),
        ({"type": "string", "pattern": "^(?=b)a+$"}, "(?=...)", '"a"'),
    ],
)  # fmt: skip
def test_a_keyword_xgrammar_would_drop_is_refused(schema, keyword, violating):
    """xgrammar parses these and drops them: its grammar takes a text the schema refuses (the
    output ignored the keyword, finish_reason "stop"). Refused, naming the keyword."""
    import jsonschema
    import xgrammar.testing as xt

    grammar = backend.parse(key(json=schema))
    assert xt._is_grammar_accept_string(grammar, violating)  # what xgrammar would let through
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(violating))
    message = refused(json=schema)
    assert keyword in message and "not enforced" in message, message


def test_keywords_xgrammar_keeps_are_not_refused():
    for schema in [
        {"type": ["integer", "null"], "multipleOf": 5},
        {"type": "array", "items": _INT, "uniqueItems": False},
        {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": _INT}},
        {"$ref": "#/$defs/a", "$defs": {"a": _INT}, "description": "d", "default": 1},
        {"type": "string", "format": "date"},
        {"type": "string", "pattern": "^a+$"},
        {"type": "object", "properties": {"not": _INT, "uniqueItems": _INT}},  # names, not keywords
        *SCHEMAS,
    ]:
        validate(key(json=schema), LIMITS)


# ---- errors in our words ---------------------------------------------------------------------

BAD = [
    ({"regex": "([a-z"}, "invalid regex: a '[' is not closed (at position 6)"),
    ({"regex": "a{3,1}"}, "invalid regex: a repetition {m,n} has m > n"),
    ({"regex": "(?=a)b"}, "invalid regex: lookarounds are not supported"),
    ({"grammar": 'root ::= "a" b'}, "invalid grammar: the rule 'b' is not defined (at line 1"),
    ({"grammar": 'root ::= ("a"'}, "invalid grammar: a '(' is not closed (at line 1, column 14)"),
    ({"grammar": 'rot ::= "a"'}, "invalid grammar: it has no rule named root"),
    ({"json": {"type": "nonsense"}}, "invalid JSON schema: a type is not one of JSON's"),
    ({"json": {"type": "integer", "minimum": 1e308}}, "an integer bound is outside the 64-bit"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "its bounds leave no value"),
    ({"json": {"type": "string", "minLength": 2**40}}, "a count (minItems, maxLength, ...)"),
    ({"json": {"type": "string", "pattern": "([a-z"}}, "invalid JSON schema: a '[' is not closed"),
    ({"json": {"properties": {"a": False}, "required": ["a"]}}, "no value satisfies it"),
    ({"json": '{"type": '}, "json is not valid JSON (at line 1, column 10)"),
    ({"json": {"a": float("nan")}}, "StructuredOutputsParams.json must hold only JSON values"),
    ({"json": 5}, "StructuredOutputsParams.json must be a JSON schema"),
    ({"regex": ["a"]}, "StructuredOutputsParams.regex must be a string"),
]


@pytest.mark.parametrize("constraint, says", BAD)
def test_errors_are_in_our_words(constraint, says):
    with pytest.raises(ValueError) as info:
        validate(key(**constraint), LIMITS)
    message = str(info.value)
    assert says in message and not INTERNAL.search(message), message


def test_an_unknown_xgrammar_error_says_less_but_nothing_internal():
    from pagellm.structured_output.errors import user_message

    error = RuntimeError("[01:02:03] /project/cpp/x.cc:12: Check failed: (a < b) is false: boom")
    assert user_message("grammar", error) == (
        "invalid grammar: xgrammar cannot turn it into a grammar"
    )


def test_a_deeply_nested_schema_object_is_a_value_error():
    deep: dict = {}
    for _ in range(5000):
        deep = {"not": deep}
    with pytest.raises(ValueError, match="nests too deeply"):
        StructuredOutputsParams(json=deep).key()


# ---- configuration ---------------------------------------------------------------------------


def test_the_config_is_validated_and_crosses_the_process_boundary():
    with pytest.raises(ValueError, match="unknown field"):
        StructuredOutputsConfig.of({"max_depth": 3})
    with pytest.raises(ValueError, match="max_json_depth must be a positive integer"):
        StructuredOutputsConfig(max_json_depth=0)
    with pytest.raises(ValueError, match="compile_timeout_s must be a positive number"):
        StructuredOutputsConfig(compile_timeout_s=-1)
    config = EngineArgs(
        load_format="dummy", model="smollm2-135m", structured_outputs_config={"max_repetition": 7}
    ).create_engine_config()
    assert config.structured_outputs_config == StructuredOutputsConfig(max_repetition=7)
    wire = EngineConfig.from_wire(config.to_wire())
    assert wire.structured_outputs_config == config.structured_outputs_config


def test_serve_has_a_flag_per_limit():
    import argparse

    from pagellm.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--structured-outputs-config.max-json-depth", "9",
                            "--structured-outputs-config.compile-timeout-s", "2.5"])  # fmt: skip
    limits = StructuredOutputsConfig.of(engine_args_from(ns).structured_outputs_config)
    assert limits == StructuredOutputsConfig(max_json_depth=9, compile_timeout_s=2.5)


# ---- the validator in a sandbox lane ----------------------------------------------------------


def test_the_validator_runs_in_a_sandbox_lane(tmp_path):
    """As the server's lane will run it: a worker process of pagellm.sandbox, the vocabulary
    tables loaded once by the lane's initializer from a file, `validate` by import path with
    plain data (the key a list, the limits a dict); its ValueErrors come back as ValueErrors.
    A Token(...) id outside the vocabulary only the compile catches."""
    import asyncio
    import dataclasses

    from pagellm.loader import load_tokenizer
    from pagellm.sandbox import Lane
    from pagellm.sandbox_worker import LaneSpec

    model_config = EngineArgs(dtype="float32").create_engine_config().model_config
    vocabulary = str(tmp_path / "vocabulary.json")
    write_vocabulary(load_tokenizer(model_config.source), model_config, vocabulary)
    spec = LaneSpec(
        "structured_outputs", timeout_s=60, memory_limit_mb=512,
        initializer="pagellm.structured_output.validator:init_worker",
        initializer_args=(vocabulary,),
    )  # fmt: skip
    validate_by_name = "pagellm.structured_output.validator:validate"
    limits = dataclasses.asdict(LIMITS)

    async def run() -> None:
        lane = Lane(spec)
        await lane.start()
        try:
            good = list(key(json=SCHEMAS[0]))
            assert await lane.call(validate_by_name, good, limits, vocabulary) is None
            validate(key(grammar="root ::= Token(100000)"), LIMITS)  # parses: no vocabulary
            for grammar, says in (("root ::= Token(100000)", "outside the vocabulary"),
                                  ("root ::= root", "matches no string")):  # fmt: skip
                bad = list(key(grammar=grammar))
                with pytest.raises(ValueError, match=says):
                    await lane.call(validate_by_name, bad, limits, vocabulary)
        finally:
            await lane.close()

    asyncio.run(run())


# ---- the matcher's cost a token -----------------------------------------------------------------


def test_an_ambiguous_grammar_fails_once_a_token_costs_more_than_its_budget():
    """`root ::= root root | "a"` compiles at once, but every "aaaa" makes its matcher's next
    bitmask and accept dearer (~0.6 s a token after 150 tokens here): past max_matcher_ms of
    CPU the request fails at its next token (ValueError: the scheduler fails it alone) instead
    of stalling every step of the engine. An unambiguous grammar stays far below."""
    from concurrent.futures import Future

    import xgrammar as xgr

    from pagellm.loader import load_tokenizer
    from pagellm.structured_output.request import StructuredOutputRequest

    model_config = EngineArgs(dtype="float32").create_engine_config().model_config
    tokenizer = load_tokenizer(model_config.source)
    info = backend.tokenizer_info(tokenizer, model_config.vocab_size, [tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    aaaa = tokenizer.convert_tokens_to_ids("aaaa")
    bitmask = xgr.allocate_token_bitmask(1, model_config.vocab_size)
    budget = 0.005  # 5 ms
    for grammar, fails in (('root ::= root root | "a"', True), ('root ::= "a"+', False)):
        future: Future = Future()
        future.set_result((compiler.compile_grammar(grammar), None))
        so = StructuredOutputRequest(StructuredOutputsParams(grammar=grammar), future,
                                     max_matcher_s=budget)  # fmt: skip
        assert so.poll()
        with pytest.raises(ValueError) if fails else contextlib.nullcontext() as info:
            for _ in range(400):
                so.fill(bitmask, 0)
                so.accept(aaaa)
        if fails:
            assert "max_matcher_ms=5" in str(info.value) and not INTERNAL.search(str(info.value))
            assert so.num_seen < 400


def test_the_checks_matcher_probe_refuses_an_ambiguous_grammar_and_keeps_real_ones(tmp_path):
    """With the vocabulary (the server's lane), the check follows PROBE_TOKENS of the longest
    tokens a grammar allows: an ambiguous one is a 400 naming max_matcher_ms before it runs,
    every real case of structured_cases passes."""
    from pagellm.loader import load_tokenizer
    from pagellm.structured_output.validator import init_worker

    model_config = EngineArgs(dtype="float32").create_engine_config().model_config
    vocabulary = str(tmp_path / "vocabulary.json")
    write_vocabulary(load_tokenizer(model_config.source), model_config, vocabulary)
    init_worker(vocabulary)
    for grammar in ('root ::= root root | "a"', 'root ::= ("a"{1,1000})+'):
        with pytest.raises(ValueError, match="max_matcher_ms") as info:
            validate(key(grammar=grammar), LIMITS, vocabulary)
        assert not INTERNAL.search(str(info.value))
    cases = [{"json": s} for s in SCHEMAS] + [{"regex": r} for r in REGEXES]
    for constraint in [*cases, *({"choice": c} for c in CHOICES), {"json_object": True}]:
        validate(key(**constraint), LIMITS, vocabulary)
