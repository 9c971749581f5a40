"""Reasoning parsers (`--reasoning-parser`): a reply's `<think>...</think>` span goes to
`reasoning_content`, the rest to `content`.

- qwen3: the model opens the span itself (`<think>`); a reply without it is all content
  (thinking off: the chat template closed an empty span in the prompt).
- deepseek_r1: the prompt opens the span; everything up to `</think>` is reasoning, all of
  it while `</think>` has not come.
- openai_gptoss: gpt-oss's harmony messages (`harmony.py`; the reply's special tokens kept):
  the `analysis` channel is reasoning; the `final` channel's text is content, and a tool
  call (a message `to=functions.NAME`) stays in the content as written, for the `openai`
  tool parser.

`split(text, final)` reads the whole text so far; while streaming (`final` False) a suffix
that may be the start of a tag is held back, so a tag split across chunks is never shown.
`ReasoningStream` turns successive splits into deltas.
"""

from __future__ import annotations

from pagellm.entrypoints.openai.harmony import harmony_messages, has_harmony, may_become_harmony
from pagellm.entrypoints.openai.tool_parsers import held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    opens_in_prompt = False  # deepseek_r1: the reply starts inside the span

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content) of the text so far."""
        body = text
        if not self.opens_in_prompt:
            stripped = text.lstrip()
            if not stripped.startswith(START):
                maybe_tag = not final and START.startswith(stripped)
                return None, "" if maybe_tag else text
            body = stripped[len(START) :]
        cut = body.find(END)
        if cut < 0:
            return (body if final else held_back(body, END)), ""
        return body[:cut], body[cut + len(END) :]


class Qwen3ReasoningParser(ReasoningParser):
    opens_in_prompt = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    opens_in_prompt = True

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        return super().split(text.removeprefix(START), final)


class GptOssReasoningParser(ReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        if not has_harmony(text):  # a reply opens with `<|channel|>`: wait for it
            maybe_header = not final and may_become_harmony(text)
            return None, "" if maybe_header else text
        messages = harmony_messages(text, final)
        # a message to functions.NAME is a call (whatever its channel): kept whole for the tool
        # parser; the other analysis messages (builtin tools' too) are the thinking
        calls = [m.recipient is not None and m.recipient.startswith("functions.") for m in messages]
        thinking = [m.channel == "analysis" and not call for m, call in zip(messages, calls)]
        thoughts = [m.content for m, think in zip(messages, thinking) if think]
        content = "".join(
            m.raw if m.recipient else m.content for m, think in zip(messages, thinking) if not think
        )
        return ("\n".join(thoughts) if thoughts else None), content


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
}


class ReasoningStream:
    """Successive splits of a growing text -> (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = [0, 0]  # reasoning, content characters given out

    def update(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.split(self.text, final)
        parts = (reasoning or "", content)
        out = tuple(part[sent:] for part, sent in zip(parts, self.sent))
        self.sent = [max(s, len(p)) for s, p in zip(self.sent, parts)]
        return out
