"""A request's output constraint, from whichever field names it, and the fields we refuse.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` body
and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` all become one
`StructuredOutputsParams`; naming two is an error. `tool_choice` "required" or a named
function is a constraint too (`tool_constraint`): the reply is then a JSON array of calls,
or the named function's arguments.

Fields a request may carry that this server ignores because they change nothing it returns
are listed in `IGNORED_FIELDS`; any other field it does not know is refused with a 400 naming
it, rather than silently ignored (a `guided_*` or other vLLM extra this server lacks would
otherwise give unconstrained output).
"""

from __future__ import annotations

from typing import Any

from pagellm.structured_output.params import StructuredOutputsParams

# OpenAI fields with no effect on the output (bookkeeping, hints, defaults we keep)
IGNORED_FIELDS = frozenset(
    {
        "user", "metadata", "store", "service_tier",
        "prompt_cache_key", "safety_identifier", "modalities", "function_call_hints",
    }
)  # fmt: skip

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def unknown_field(extra: dict[str, Any] | None) -> str | None:
    """The first field of a request's extras that is neither known nor harmless."""
    return next((name for name in extra or {} if name not in IGNORED_FIELDS), None)


def structured_outputs(request: Any) -> StructuredOutputsParams | None:
    """The one constraint a request names (ValueError naming the fields if it names two)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = from_response_format(request.response_format)
    if response_format is not None:
        found.append(("response_format", response_format))
    if request.structured_outputs is not None:
        found.append(("structured_outputs", _params(request.structured_outputs.fields())))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(request, field)
        if value is not None:
            found.append((field, _params({kind: value})))
    if len(found) > 1:
        raise ValueError(f"only one output constraint at a time, got {[f for f, _ in found]}")
    return found[0][1] if found else None


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise ValueError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )


def _params(fields: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(**fields)


def named_tool(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any] | None:
    """The function a named tool_choice ({"type": "function", "function": {"name"}}) picks."""
    if not isinstance(tool_choice, dict):
        return None
    name = function_name(tool_choice)
    if name is None:
        raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
    for tool in tools:
        if function_name(tool) == name:
            return tool["function"]
    raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")


def function_name(tool: dict[str, Any]) -> str | None:
    """The name of a tool's (or a named tool_choice's) function, if it has one."""
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


def tool_constraint(
    tools: list[dict[str, Any]], tool_choice: Any, parallel: bool = True
) -> StructuredOutputsParams:
    """tool_choice "required": a JSON array of one or more calls of the tools (exactly one
    with `parallel` false: parallel_tool_calls); a named function: its arguments object."""
    named = named_tool(tools, tool_choice)
    if named is not None:
        return StructuredOutputsParams(json=_parameters(named))
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "parameters": _parameters(tool["function"]),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}
