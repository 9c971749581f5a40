"""The server's OpenAPI document: FastAPI's, made to state what the server does (its 400s, not
FastAPI's 422s; the API key; exact integer bounds; the served model's vocabulary; the
structured-output limits a document can state). `tests/test_server_fuzz.py` holds requests
that fit it to being served."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagellm.config import EngineConfig
from pagellm.entrypoints.openai.request_guard import PROTECTED_PATHS
from pagellm.sampling_params import INT64_MAX


def openapi_document(app: FastAPI, with_key: bool, description: str | None) -> dict[str, Any]:
    """FastAPI's document, without the 422 it declares for every body (this server sends 400),
    with the API key declared as a bearer scheme where it is required, integer bounds exact,
    token ids bounded by the served model's vocabulary, the structured-output limits this
    server enforces and, without a reasoning parser, no thinking budget."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, routes=app.routes, description=description
        )
        _exact_integer_bounds(schema)
        engine = getattr(app.state, "engine", None)
        if engine is not None:
            _bound_token_ids(schema, engine.config.model_config.vocab_size)
            _state_limits(schema["components"]["schemas"], engine.config)
        components = schema.setdefault("components", {})
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if with_key and path.startswith(PROTECTED_PATHS):
                    operation["security"] = [{"bearer": []}]
        for name in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(name, None)
        if with_key:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _exact_integer_bounds(node: Any) -> None:
    """FastAPI writes every bound as a float: 2^63 - 1 becomes 2^63, a value this server
    refuses. An integer's bounds go back to exact integers."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in _BOUNDS:
                if isinstance(node.get(key), float):
                    node[key] = min(int(node[key]), INT64_MAX)  # float(2^63 - 1) is 2^63
        for value in node.values():
            _exact_integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _exact_integer_bounds(value)


def _state_limits(models: dict[str, Any], config: EngineConfig) -> None:
    """The structured-output limits a document can state: a regex's or grammar's length and
    a choice list's size (the rest, a schema's nesting or cost, only the server can tell);
    thinking_token_budget only null without --reasoning-parser."""
    limits = config.structured_outputs_config
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest",
                 "StructuredOutputsBody"):  # fmt: skip
        for field, node in models.get(name, {}).get("properties", {}).items():
            if field == "thinking_token_budget" and config.reasoning_parser is None:
                node["anyOf"] = [{"type": "null"}]
            for branch in node.get("anyOf", [node]):
                if field in _TEXT_CONSTRAINTS and branch.get("type") == "string":
                    branch["maxLength"] = limits.max_spec_chars
                elif field in _CHOICES and branch.get("type") == "array":
                    branch["maxItems"] = limits.max_enum_values


_TEXT_CONSTRAINTS = {"regex", "grammar", "guided_regex", "guided_grammar"}
_CHOICES = {"choice", "guided_choice"}


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    """Every token id (an integer in [0, int64 max]) becomes one in [0, vocab_size)."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("maximum") == INT64_MAX:
            if node.get("minimum") == 0:
                node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)
