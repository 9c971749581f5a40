"""StructuredOutputsParams: what a request's output must match (vLLM's names).

Exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice`, `grammar`
(EBNF, xgrammar's dialect) or `json_object` (any JSON object). `key()` is the canonical form
the compile cache is keyed by: a schema's key does not depend on its spacing.
Only plain data lives here: xgrammar is imported where grammars are parsed or compiled.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

# the constraint kinds, in the order a request names them
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only: no whitespace between tokens but a single space after ':' and ','
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        for name, (kind, what) in _TYPES.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"StructuredOutputsParams.{name} must be {what}")
        named = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(named) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar or "
                f"json_object, got {len(named)}" + (f" ({', '.join(named)})" if named else "")
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")
        if isinstance(self.json, str):
            _read_json(self.json)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): equal for requests that compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            schema = _read_json(self.json) if isinstance(self.json, str) else self.json
            spec = _compact(schema)
        elif kind == "choice":
            spec = choice_grammar(self.choice)
            kind = "grammar"
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        if kind in ("json", "json_object") and self.disable_any_whitespace:
            kind += ":compact"
        return kind, spec


_TYPES = {  # field -> (type, what it must be)
    "json": ((str, dict), "a JSON schema (an object or its text)"),
    "regex": (str, "a string"),
    "choice": (list, "a non-empty list of strings"),
    "grammar": (str, "a string"),
    "json_object": (bool, "a boolean"),
    "disable_any_whitespace": (bool, "a boolean"),
}


def _read_json(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("StructuredOutputsParams.json nests too deeply to be read") from None
    except ValueError as e:
        at = f" (at line {e.lineno}, column {e.colno})" if hasattr(e, "lineno") else ""
        raise ValueError(f"StructuredOutputsParams.json is not valid JSON{at}") from None


def _compact(schema: Any) -> str:
    """The schema as compact JSON text; key order is kept (it is the output's order)."""
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except RecursionError:
        raise ValueError("StructuredOutputsParams.json nests too deeply to be read") from None
    except (TypeError, ValueError):
        raise ValueError("StructuredOutputsParams.json must hold only JSON values") from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (string literals escaped as JSON)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
