"""An assistant reply's parts: reasoning (`--reasoning-parser`), content and tool calls.

The text first loses its thinking span (to `reasoning_content`); what follows is content, or
tool calls found by the tool-call parser the request's tool mode picks:

- "auto": the server's `--tool-call-parser` (the model chose to call or not);
- "required": the reply was constrained to a JSON array of `{"name", "parameters"}`;
- "named": the reply was constrained to the named function's arguments: one call.

`final(text)` splits a whole reply; `update(delta, final)` the same incrementally, for a
stream: reasoning, content and tool-call deltas (a call's name first, then its arguments).
The server (`serving_chat.py`) and `LLM.chat` (`entrypoints/chat_outputs.py`) both split
replies here (`make_reply`): no FastAPI or pydantic below this module.
"""

from __future__ import annotations

from pagellm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStream
from pagellm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    JsonListToolParser,
    OpenAIToolParser,
    Parsed,
    ParsedCall,
    ToolCallStream,
    ToolParser,
    final_calls,
    tool_call_id,
)


class NamedToolParser(ToolParser):
    """tool_choice names a function: the whole reply is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [ParsedCall(self.name, text, final)])


def tool_parser_for(mode: str | None, parser_name: str | None, named: str | None):
    if mode == "auto":
        return TOOL_PARSERS[parser_name]()
    if mode == "required":
        return JsonListToolParser()
    if mode == "named":
        return NamedToolParser(named)
    return None


def check_parsers(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """A ValueError naming the known parsers for a name that is not one of them."""
    for what, name, known in (
        ("tool_call_parser", tool_call_parser, TOOL_PARSERS),
        ("reasoning_parser", reasoning_parser, REASONING_PARSERS),
    ):
        if name is not None and name not in known:
            raise ValueError(f"{what} must be one of {sorted(known)}, got {name!r}")


def make_reply(
    mode: str | None,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    named: str | None = None,
) -> ChatReply:
    """The splitter of one reply: `mode` None, "auto", "required" or "named" (see above)."""
    return ChatReply(tool_parser_for(mode, tool_call_parser, named), reasoning_parser)


class ChatReply:
    def __init__(self, tool_parser: ToolParser | None, reasoning_parser: str | None) -> None:
        self.tool_parser = tool_parser
        self.reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        self.reasoning_stream = ReasoningStream(self.reasoning) if self.reasoning else None
        self.tool_stream = ToolCallStream(tool_parser) if tool_parser else None
        # harmony: the tool parser reads the reply as written (it skips the analysis channel
        # itself); re-reading the reasoning split's content would parse the final channel's
        # text as markup, and a failed parse must not turn the markup into content
        self.harmony = isinstance(tool_parser, OpenAIToolParser)
        self.max_calls: int | None = None  # parallel_tool_calls false: 1 (later calls dropped)

    def final(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning_content, content, tool_calls) of a whole reply."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, final=True)
        if self.tool_parser is not None:
            parsed = self.tool_parser.parse(text if self.harmony else content, final=True)
            calls = [_openai_call(call) for call in final_calls(parsed)][: self.max_calls]
            if calls:
                return reasoning, parsed.content or None, calls
            content = parsed.content if self.harmony else content  # nothing parsed: content
        if self.reasoning is not None and not content:  # all thinking: null, as vLLM's parsers
            content = None
        return reasoning, content, []

    def update(self, delta: str, final: bool) -> tuple[str, str, list[dict]]:
        """(reasoning delta, content delta, tool-call deltas) for the next piece of text."""
        reasoning, content = "", delta
        if self.reasoning_stream is not None:
            reasoning, content = self.reasoning_stream.update(delta, final)
        if self.tool_stream is None:
            return reasoning, content, []
        content, calls = self.tool_stream.update(delta if self.harmony else content, final)
        if self.max_calls is not None:
            calls = [call for call in calls if call["index"] < self.max_calls]
        return reasoning, content, calls


def _openai_call(call: ParsedCall) -> dict:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": tool_call_id(), "type": "function", "function": function}
