"""Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` renders
them, from the template's text and the tokenizer's special-token strings alone.

It imports jinja2 and the standard library only (no tokenizer, transformers or torch), so a
sandbox worker (`pagellm/sandbox.py`) runs it in a few MB; `LLM.chat` runs it in-process. The
environment is transformers': a sandboxed, immutable Jinja environment with `trim_blocks`,
`lstrip_blocks`, loop controls, the `{% generation %}` tag, `tojson` without HTML escaping,
`raise_exception`, `strftime_now`, and the guarded `dict` and `namespace`. So are the inputs'
preparation (keys whose value is None dropped, reasoning aliased to `thinking` and
`reasoning_content`, special tokens under their names, `continue_final_message`).
`tests/test_chat_template.py` compares the two on several templates.

Every failure is a ValueError in our own words; a template's `raise_exception` message is the
template's own and is quoted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagellm.sandbox_worker import LimitExceeded

# apply_chat_template's own arguments and the variables the render sets: not template kwargs
RENDER_ARGUMENTS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "add_generation_prompt",
        "continue_final_message", "chat_template", "tokenize", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
        "padding", "truncation", "max_length", "return_tensors",
    }
)  # fmt: skip
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_MAX_KWARGS_DEPTH = 32
_REFUSED = "messages: the model's chat template refuses them"


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    special_tokens: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool | str = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    max_output_chars: int | None = None,
) -> str:
    """The prompt text of one conversation. `special_tokens`: the tokenizer's
    `special_tokens_map` (`bos_token`, ...), which `template_kwargs` may override. Past
    `max_output_chars` characters the render stops with `LimitExceeded("output")`."""
    if not messages:
        raise ValueError("messages: the conversation is empty")
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be set: one continues "
            "the last message, the other starts a new one"
        )
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("tools: each tool must be a JSON object")
    if documents is not None and not all(isinstance(doc, dict) for doc in documents):
        raise ValueError("documents: each document must be a JSON object")
    chat = _aliased(_plain([_without_nones(m) for m in messages]))
    variables = _plain({**(special_tokens or {}), **(template_kwargs or {})})
    compiled = _compiled(template)
    final = None
    if continue_final_message:
        final = _tag_final_message(chat, template, continue_final_message)
    parts = compiled.generate(
        messages=chat,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    text = _joined(parts, max_output_chars)
    return text if final is None else _cut_at_tag(text, final)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """In-process rendering (`LLM.chat`, `pagellm chat`): the tokenizer's template (or
    `chat_template`, a template or the name of one of the tokenizer's) and special tokens."""
    check_template_kwargs(template_kwargs or {}, json_like=False)
    return render_chat_template(
        template_of(tokenizer, chat_template, tools),
        messages,
        special_tokens_of(tokenizer),
        add_generation_prompt,
        tools=tools,
        template_kwargs=template_kwargs,
    )


def template_of(tokenizer: Any, chat_template: str | None, tools: list | None = None) -> str:
    """The template's text: `chat_template` (text, or the name of one of a tokenizer's named
    templates), else the tokenizer's ("tool_use" with tools, if it has named ones)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so no chat template")
    try:
        return tokenizer.get_chat_template(chat_template, tools)
    except ValueError:
        raise ValueError(
            "this model has no chat template (or several and no default): pass one "
            "(the server's --chat-template FILE)"
        ) from None


def special_tokens_of(tokenizer: Any) -> dict[str, Any]:
    """The special tokens a template sees by name (`bos_token`, `eos_token`, ...), as text."""
    return _plain(dict(getattr(tokenizer, "special_tokens_map", None) or {}))


def check_template_kwargs(kwargs: dict[str, Any], json_like: bool = True) -> None:
    """ValueError naming a key that the render sets itself, or (`json_like`) a value that is
    not JSON data (nested at most 32 deep, integers of at most 64 bits)."""
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise ValueError("chat_template_kwargs: keys must be strings")
        if key in RENDER_ARGUMENTS:
            raise ValueError(
                f"chat_template_kwargs: {key!r} is set by the render itself and cannot be a "
                "template variable"
            )
        if json_like and not _is_json_like(value, _MAX_KWARGS_DEPTH):
            raise ValueError(
                f"chat_template_kwargs: {key!r} must be JSON data (nested at most "
                f"{_MAX_KWARGS_DEPTH} deep, integers of at most 64 bits)"
            )


def _is_json_like(value: Any, depth: int) -> bool:
    if value is None or isinstance(value, (str, bool, float)):
        return True
    if isinstance(value, int):
        return -(1 << 63) <= value < 1 << 64
    if depth <= 0:
        return False
    if isinstance(value, list):
        return all(_is_json_like(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_like(v, depth - 1) for k, v in value.items())
    return False


def _joined(parts: Any, max_chars: int | None) -> str:
    """The render's pieces joined; template errors in our words."""
    out: list[str] = []
    size = 0
    try:
        for part in parts:
            size += len(part)
            if max_chars is not None and size > max_chars:
                raise LimitExceeded("output", f"the render passed {max_chars} characters")
            out.append(part)
    except (LimitExceeded, MemoryError):
        raise
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template: the template does not parse (line {e.lineno})") from None
    except SecurityError:
        raise ValueError(f"{_REFUSED}: the template did something its sandbox forbids") from None
    except TemplateError as e:  # the template's own words (`raise_exception`), if any
        reason = str(e) if type(e) is TemplateError else "the messages do not fit it"
        raise ValueError(f"{_REFUSED}: {reason}") from None
    except Exception:  # not echoed: it is Python's or Jinja's text, not the template's
        raise ValueError("messages: the model's chat template cannot render them") from None
    return "".join(out)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template: the template does not parse (line {e.lineno})") from None
    except MemoryError:
        raise
    except RecursionError:
        raise ValueError("chat_template: the template is too deeply nested to compile") from None
    except Exception:
        raise ValueError("chat_template: the template does not compile") from None


def _tag_final_message(chat: list[dict], template: str, field: bool | str) -> str:
    """Marks the end of the last message's `field` ("content" for True); returns its text."""
    field = field if isinstance(field, str) else "content"
    last = chat[-1]
    final = last.get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the last message has no {field!r} to continue")
    fields = [field]
    if field in _REASONING_FIELDS:  # aliased: tag every copy, the template reads one of them
        fields = [f for f in _REASONING_FIELDS if last.get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message: the chat template never reads {field!r}")
    if isinstance(final, (list, tuple)):
        block = next((b for b in reversed(final) if "text" in b), None)
        if block is None:
            raise ValueError("continue_final_message: the last message has no text to continue")
        final = block["text"]
        block["text"] = block["text"] + _CONTINUE_TAG
    else:
        for f in fields:
            last[f] = last[f] + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message: the chat template drops part of the last message, so it "
            "cannot be continued"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def _without_nones(message: Any) -> dict:
    if not isinstance(message, Mapping):
        raise ValueError("messages: each message must be an object")
    return {key: value for key, value in message.items() if value is not None}


def _aliased(chat: list[dict]) -> list[dict]:
    """A message's reasoning under `thinking` (unless set) and `reasoning_content` as well."""
    out = []
    for message in chat:
        found = (message[f] for f in _REASONING_FIELDS if message.get(f) is not None)
        reasoning = next(found, None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """A copy made of plain data (what a template may see); other objects become "<Type>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# ---- the environment ------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks the span)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore-prefixed names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Namespace's own signature)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a namespace attribute cannot start with an underscore: {name!r}")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` in a template, nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: Any) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
    )
    return env


def warm_up() -> None:
    """A sandbox worker's initializer: Jinja's compiler and runtime imported before the first
    request (and before the worker's memory limit is set)."""
    render_chat_template("{{ messages[0].content }}{% generation %}{% endgeneration %}", [{}])
