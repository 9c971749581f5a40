"""What is checked on a constraint's text before xgrammar sees it: the limits of
`StructuredOutputsConfig` that the text shows (its size, a JSON schema's nesting, counted
repetitions in a regex or a schema's patterns) and a JSON schema's `$ref`s (inside the schema,
and resolving there). Pure Python, linear in the text; `grammar_check.py` checks what only the
parsed grammar shows.

A counted repetition `{m,n}` costs xgrammar in proportion to its count, and repetitions nested
in one another in proportion to the product of their counts (its parser keeps a state per
combination of counters): `((a?){1,100}){1,100}` as a JSON pattern compiles in 101 s and takes
0.4 s a token as a regex; under 1000, any shape measured compiles in under a second.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

if TYPE_CHECKING:
    from pagellm.config import StructuredOutputsConfig

NAMES = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "json_object": "JSON"}
_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_BRACED_ESCAPES = "xuUpPkN"  # \x{41}, \p{L}, \k<name>: skipped whole
# keywords whose value is data, not a schema: never read as keywords
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# keywords whose value maps names (of properties, of definitions) to schemas
_NAMED_SCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
_MAX_SHOWN = 80  # characters of a user's text quoted back in an error
# keywords xgrammar parses and then drops (its grammar does not follow them): refused, as vLLM
# refuses them for its xgrammar backend, rather than an output that need not validate
_DROPPED = ("uniqueItems", "contains", "minContains", "maxContains", "not",
            "dependentRequired", "dependentSchemas", "dependencies")  # fmt: skip
_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")
# what a $ref may stand beside (xgrammar drops any other keyword next to a $ref)
_BESIDE_REF = frozenset(
    {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description",
     "default", "examples", "deprecated", "readOnly", "writeOnly"}
)  # fmt: skip


def limit_message(what: str, limit: str, limits: StructuredOutputsConfig) -> str:
    """'<what>, over the limit <limit>=<value> (raise it with ...)'."""
    value = getattr(limits, limit)
    return f"{what}, over the limit {limit}={value} ({limits.how_to_raise(limit)})"


def over_limit(what: str, limit: str, limits: StructuredOutputsConfig) -> None:
    """Raise the ValueError for a constraint over the limit `limit`, saying how to raise it."""
    raise ValueError(limit_message(what, limit, limits))


def check_limits(key: tuple[str, str], limits: StructuredOutputsConfig) -> None:
    """ValueError if the constraint (StructuredOutputsParams.key()) is over a limit its text
    shows, or is a JSON schema whose $refs leave it."""
    kind, spec = key[0].split(":")[0], key[1]
    name = NAMES[kind]
    if len(spec) > limits.max_spec_chars:
        over_limit(f"the {name} is {len(spec)} characters", "max_spec_chars", limits)
    if kind == "regex":
        _check_regex(spec, f"the {name}", limits)
    elif kind == "json":
        depth = json_depth(spec)
        if depth > limits.max_json_depth:
            over_limit(f"the {name} nests {depth} levels deep", "max_json_depth", limits)
        _check_schema(json.loads(spec), limits)


def json_depth(text: str) -> int:
    """How deep a JSON text's objects and arrays nest (strings skipped), without parsing it."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def _check_regex(pattern: str, what: str, limits: StructuredOutputsConfig) -> None:
    product = regex_repetition(pattern)
    if product > limits.max_repetition:
        message = f"{what} repeats {product} times over (counted repetitions {{m,n}}, nested)"
        over_limit(message, "max_repetition", limits)


def regex_repetition(pattern: str) -> int:
    """The largest count of a counted repetition `{m,n}` (n, or m for `{m}` and `{m,}`) times
    the counts of the repetitions around it; `*`, `+` and `?` count 1. A scan of the text that
    knows escapes, character classes and groups; what it does not know is a plain character."""
    inside = [1]  # per open group: the largest product inside it so far
    last = 1  # the product of the atom a quantifier would apply to
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i = _skip_escape(pattern, i)
            last = 1
            continue
        if c == "[":
            i = _skip_class(pattern, i)
            last = 1
            continue
        if c == "(":
            inside.append(1)
            last = 1
        elif c == ")" and len(inside) > 1:
            last = inside.pop()
            inside[-1] = max(inside[-1], last)
        elif c == "{" and (count := _COUNT.match(pattern, i)) is not None:
            last *= max(_count(count), 1)
            inside[-1] = max(inside[-1], last)
            i = count.end()
            continue
        elif c not in "*+?":
            last = 1
        i += 1
    return max(inside)


def _count(match: re.Match) -> int:
    """n of {m,n}; m of {m} and {m,}. Absurdly long numbers count as 10^12."""
    digits = match.group(3) or match.group(1)
    return int(digits) if len(digits) <= 12 else 10**12


def _skip_escape(pattern: str, i: int) -> int:
    """The index after the escape at i (`\\x{...}`, `\\p{...}`, `\\k<...>` whole)."""
    if i + 2 < len(pattern) and pattern[i + 1] in _BRACED_ESCAPES and pattern[i + 2] in "{<":
        close = pattern.find("}" if pattern[i + 2] == "{" else ">", i + 3)
        return len(pattern) if close < 0 else close + 1
    return i + 2


def _skip_class(pattern: str, i: int) -> int:
    """The index after the character class that opens at i (a first ']' is a member)."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _check_schema(schema: Any, limits: StructuredOutputsConfig) -> None:
    """Every pattern under the repetition limit, every $ref inside the schema (iterative: the
    depth is already bounded, but a stack costs nothing)."""
    stack: list[tuple[Any, bool]] = [(schema, False)]  # (node, maps names to schemas)
    while stack:
        node, named = stack.pop()
        if isinstance(node, list):
            stack.extend((item, False) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if not named:
            _check_enforced(node)
        for key, value in node.items():
            if named:
                stack.append((value, False))
            elif key == "$ref" and isinstance(value, str):
                _check_ref(schema, value)
            elif key == "pattern" and isinstance(value, str):
                _check_regex(value, "a pattern of the JSON schema", limits)
                if _LOOKAROUND.search(value):  # xgrammar drops it (refuses it in a regex)
                    raise ValueError(
                        "unsupported JSON schema: a pattern's lookaround (?=...) is not "
                        "enforced by the grammar backend (xgrammar drops it)"
                    )
            elif key not in _DATA_KEYWORDS:
                if key == "patternProperties" and isinstance(value, dict):
                    for pattern in value:
                        _check_regex(pattern, "a patternProperties key", limits)
                stack.append((value, key in _NAMED_SCHEMAS))


def _check_enforced(node: dict[str, Any]) -> None:
    """ValueError if a schema uses a keyword that xgrammar would silently drop."""
    dropped = next((k for k in _DROPPED if k in node and node[k] not in (False, None)), None)
    if dropped is None and isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        dropped = "allOf"  # of two or more schemas: xgrammar allows any JSON value
    if dropped is None and "if" in node and ("then" in node or "else" in node):
        dropped = "if"
    if dropped is None and "multipleOf" in node:
        value, types = node["multipleOf"], node.get("type")
        types = set(types) if isinstance(types, list) else {types}
        if "integer" not in types or "number" in types or type(value) is not int:
            dropped = "multipleOf"  # kept only on an integer type with an integer divisor
    if dropped is None and ("pattern" in node or "format" in node):
        dropped = next((k for k in ("minLength", "maxLength") if k in node), None)
        if dropped is not None:
            dropped += f"' beside '{'pattern' if 'pattern' in node else 'format'}"
    if dropped is None and "$ref" in node:
        dropped = next((k for k in node if k not in _BESIDE_REF), None)
        if dropped is not None:
            dropped += "' beside '$ref"
    if dropped is not None:
        raise ValueError(
            f"unsupported JSON schema: '{dropped}' is not enforced by the grammar backend "
            "(xgrammar drops it, so the output would not follow it)"
        )


def _check_ref(schema: Any, ref: str) -> None:
    """A $ref must be a JSON pointer into the schema itself ('#', '#/$defs/name') that
    resolves: xgrammar would ignore a remote one and fail on a dangling one."""
    shown = json.dumps(ref[:_MAX_SHOWN], ensure_ascii=False)
    if not ref.startswith("#"):
        raise ValueError(
            f"invalid JSON schema: $ref {shown} points outside the schema (only refs inside it, "
            "such as '#/$defs/name', are followed)"
        )
    if ref != "#" and not ref.startswith("#/"):
        raise ValueError(
            f"invalid JSON schema: $ref {shown} is not a JSON pointer ('#/$defs/name')"
        )
    node = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"invalid JSON schema: $ref {shown} does not resolve inside it")
