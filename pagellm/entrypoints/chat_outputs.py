"""`LLM.chat`'s replies split as the server splits them: the same parsers
(`LLM(tool_call_parser=..., reasoning_parser=...)`, the server's `--tool-call-parser` and
`--reasoning-parser`) through the same `ChatReply` (`openai/chat_reply.py`).

A completion's `text` becomes the reply's content (the server's message `content`, "" where
that is null), its `reasoning_content` and `tool_calls` are set. Tool calls are parsed when
the conversation has `tools` (the server's tool_choice "auto"), the thinking whenever a
reasoning parser is set. Without either, outputs stay as the engine made them.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

from pagellm.entrypoints.openai.chat_reply import ChatReply, check_parsers, make_reply
from pagellm.entrypoints.openai.tool_parsers import SPECIAL_TOKEN_PARSERS
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams


class ChatParsing:
    """The parser names of one `LLM`, checked when it is made."""

    def __init__(self, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
        check_parsers(tool_call_parser, reasoning_parser)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    def keep_special_tokens(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """Copies that keep special tokens in the text where a parser reads them (gpt-oss's
        harmony markers); the same list otherwise."""
        if not {self.tool_call_parser, self.reasoning_parser} & set(SPECIAL_TOKEN_PARSERS):
            return params
        kept = [p.clone() for p in params]
        for p in kept:
            p.skip_special_tokens = False
        return kept

    def reply(self, tools: list[dict[str, Any]] | None) -> ChatReply | None:
        """A fresh splitter for one completion, or None where nothing is parsed."""
        mode = "auto" if tools and self.tool_call_parser else None
        if mode is None and self.reasoning_parser is None:
            return None
        return make_reply(mode, self.tool_call_parser, self.reasoning_parser)

    def final(
        self, outputs: list[RequestOutput], tools: list[dict[str, Any]] | None
    ) -> list[RequestOutput]:
        """Whole replies split, in place (as the server's non-streaming message)."""
        for out in outputs:
            for completion in out.outputs:
                reply = self.reply(tools)
                if reply is None:
                    return outputs
                reasoning, content, calls = reply.final(completion.text)
                completion.text = content or ""
                completion.reasoning_content = reasoning
                completion.tool_calls = calls if reply.tool_parser is not None else None
        return outputs

    def deltas(
        self, outputs: Generator[RequestOutput, None, None], tools: list[dict[str, Any]] | None
    ) -> Iterator[RequestOutput]:
        """DELTA outputs split as they come (as the server's stream): `text` the content
        delta, `reasoning_content` the thinking's (None: none this time), `tool_calls` the
        server's tool-call deltas (a call's index, id and name first, then its arguments).
        Closing this iterator closes `outputs` (which aborts what is unfinished)."""
        replies: dict[tuple[str, int], ChatReply | None] = {}
        try:
            for out in outputs:
                for completion in out.outputs:
                    key = (out.request_id, completion.index)
                    if key not in replies:
                        replies[key] = self.reply(tools)
                    if replies[key] is not None:
                        _split_delta(replies[key], completion)
                yield out
        finally:
            outputs.close()


def _split_delta(reply: ChatReply, completion: Any) -> None:
    final = completion.finish_reason is not None
    reasoning, content, calls = reply.update(completion.text, final)
    completion.text = content
    completion.reasoning_content = reasoning or None
    completion.tool_calls = calls if reply.tool_parser is not None else None
