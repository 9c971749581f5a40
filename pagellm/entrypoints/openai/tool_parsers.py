"""Tool-call parsers: a model's text -> content and OpenAI tool calls (`--tool-call-parser`).

Every parser reads the whole text so far, cut off or not, and returns the content that is
certain and the calls found, each with its name (once complete) and its arguments' JSON text
as far as it goes. The arguments are the model's own text of the JSON value (validated to
parse once complete), so streamed deltas concatenate to exactly the non-streaming arguments.
`ToolCallStream` turns successive parses into OpenAI deltas: a call's name first, then its
arguments piece by piece.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after the content.
- llama3_json: the whole reply is `{"name": ..., "parameters": {...}}` (`; `-separated for
  several, optionally after `<|python_tag|>`).
- mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.
- pythonic: the whole reply is a Python list of calls, `[f(a=1), g(b="x")]`.
- openai: gpt-oss's harmony messages addressed `to=functions.NAME` (their text is the
  arguments); the other non-analysis messages' text is content (`harmony.py`).
- json_list (internal, tool_choice "required"): a JSON array of `{"name", "parameters"}`.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field

from pagellm.entrypoints.openai.harmony import (
    harmony_messages,
    has_harmony,
    held_back_markers,
    may_become_harmony,
)


@dataclass
class ParsedCall:
    name: str | None  # None until its string is complete
    arguments: str = ""  # the arguments' JSON text so far
    done: bool = False  # the arguments are complete


@dataclass
class Parsed:
    content: str  # the reply's text that is not a tool call (certain so far)
    calls: list[ParsedCall] = field(default_factory=list)


def scan_value(text: str, i: int) -> int | None:
    """The end of the JSON value starting at text[i], or None where the text cuts it off."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _scan_string(text, i)
    if text[i] in "{[":
        return _scan_container(text, i)
    j = i
    while j < len(text) and text[j] not in ",}] \n\t\r":
        j += 1
    return j if j < len(text) else None


def _scan_string(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _scan_container(text: str, i: int) -> int | None:
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = _scan_string(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \n\t\r":
        i += 1
    return i


def object_members(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Top-level members of the JSON object at text[start] ('{'), cut off or not:
    key -> (value start, value end or None), and the object's end (None if cut)."""
    members: dict[str, tuple[int, int | None]] = {}
    i = start + 1
    while True:
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
        if i >= len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        key_start = i
        key_end = _scan_string(text, i) if text[i] == '"' else None
        if key_end is None:
            return members, None
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return members, None
        value = _skip_ws(text, i + 1)
        end = scan_value(text, value)
        members[json.loads(text[key_start:key_end])] = (value, end)
        if end is None:
            return members, None
        i = end


def parse_call(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[ParsedCall, int | None]:
    """The call object at text[start] ('{'): its name and arguments; and the object's end."""
    members, end = object_members(text, start)
    call = ParsedCall(name=None)
    if "name" in members and members["name"][1] is not None:
        vs, ve = members["name"]
        call.name = json.loads(text[vs:ve])
    key = next((k for k in args_keys if k in members), None)
    if key is not None:
        vs, ve = members[key]
        call.arguments = text[vs : len(text) if ve is None else ve]
        call.done = ve is not None
    elif end is not None:  # a call without arguments
        call.arguments, call.done = "{}", True
    return call, end


def held_back(text: str, marker: str) -> str:
    """`text` less a suffix that may be the start of `marker` (streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


class ToolParser:
    """Subclasses implement parse(text, final)."""

    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def _calls_from(self, text: str, i: int, separators: str) -> list[ParsedCall]:
        """Call objects from text[i] on, separated by any of `separators` (and spaces)."""
        calls = []
        while True:
            i = _skip_ws(text, i)
            while i < len(text) and text[i] in separators:
                i = _skip_ws(text, i + 1)
            if i >= len(text) or text[i] != "{":
                return calls
            call, end = parse_call(text, i, self.args_keys)
            calls.append(call)
            if end is None:
                return calls
            i = end


class HermesToolParser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            return Parsed(text if final else held_back(text, self.start))
        calls = []
        for block in text[first:].split(self.start)[1:]:
            block = block.split(self.end)[0]
            calls += self._calls_from(block, 0, "")[:1]
        return Parsed(text[:first], calls)


class Llama3JsonToolParser(ToolParser):
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.removeprefix(self.tag) if text.startswith(self.tag) else text
        stripped = body.lstrip()
        if not stripped:
            return Parsed(text if final else "")
        if not stripped.startswith("{"):
            return Parsed(text if final else held_back(text, self.tag))
        return Parsed("", self._calls_from(body, 0, ";"))


class MistralToolParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.marker)
        if first < 0:
            return Parsed(text if final else held_back(text, self.marker))
        i = _skip_ws(text, first + len(self.marker))
        calls = self._calls_from(text, i + 1, ",") if text[i : i + 1] == "[" else []
        return Parsed(text[:first], calls)


class JsonListToolParser(ToolParser):
    """tool_choice "required": the reply is a JSON array of {"name", "parameters"} objects."""

    def parse(self, text: str, final: bool) -> Parsed:
        i = _skip_ws(text, 0)
        if text[i : i + 1] != "[":
            return Parsed(text if final else "")
        return Parsed("", self._calls_from(text, i + 1, ","))


class PythonicToolParser(ToolParser):
    """Calls appear once the list is complete (all at once: Python is not parsed in parts)."""

    def parse(self, text: str, final: bool) -> Parsed:
        stripped = text.strip()
        if not stripped.startswith("["):
            return Parsed(text if final or stripped else "")
        try:
            tree = ast.parse(stripped, mode="eval").body
        except SyntaxError:
            return Parsed(text if final else "")
        if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
            return Parsed(text)
        try:
            return Parsed("", [_python_call(call) for call in tree.elts])
        except ValueError:
            return Parsed(text)


class OpenAIToolParser(ToolParser):
    """gpt-oss (harmony): each message to `functions.NAME` is a call, complete at its end."""

    def parse(self, text: str, final: bool) -> Parsed:
        if not has_harmony(text):
            if final:
                return Parsed(text)
            return Parsed("" if may_become_harmony(text) else held_back_markers(text))
        content, calls = "", []
        for message in harmony_messages(text, final):
            if message.recipient and message.recipient.startswith("functions."):
                name = message.recipient.removeprefix("functions.")
                calls.append(ParsedCall(name, message.content, message.done))
            elif message.channel != "analysis" and not message.recipient:
                content += message.content
        return Parsed(content, calls)


def _python_call(call: ast.Call) -> ParsedCall:
    if not isinstance(call.func, ast.Name) or call.args:
        raise ValueError("a pythonic tool call is name(keyword=value, ...)")
    args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    return ParsedCall(call.func.id, json.dumps(args), True)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "openai": OpenAIToolParser,
}
# parsers that read the reply's special tokens: the server keeps them in its text
SPECIAL_TOKEN_PARSERS = ("openai", "openai_gptoss")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def final_calls(parsed: Parsed) -> list[ParsedCall]:
    """The complete calls whose arguments parse as a JSON object."""
    good = []
    for call in parsed.calls:
        if call.name is None or not call.done:
            continue
        try:
            if isinstance(json.loads(call.arguments), dict):
                good.append(call)
        except ValueError:
            continue
    return good


class ToolCallStream:
    """Successive parses of a growing text -> (content delta, tool-call deltas)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []  # per call index, once its name is sent
        self.sent_args: list[int] = []

    def update(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        content = parsed.content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(parsed.content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self.ids):  # the name first, with the call's id
                self.ids.append(tool_call_id())
                self.sent_args.append(0)
                function = {"name": call.name, "arguments": ""}
                deltas.append({"index": index, "id": self.ids[index], "type": "function",
                               "function": function})  # fmt: skip
            new_args = call.arguments[self.sent_args[index] :]
            if new_args:
                self.sent_args[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": new_args}})
        return content, deltas
