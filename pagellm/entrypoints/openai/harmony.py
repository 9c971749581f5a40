"""gpt-oss's harmony format, read from a reply's text (its special tokens kept): the messages
the model wrote after the prompt's `<|start|>assistant`:

    <|channel|>analysis<|message|>We need ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>    (one line: wrapped here)
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A message is a header (role, `<|channel|>` name, an optional recipient `to=...` before or
after the channel, a content type) then `<|message|>` and its text up to `<|end|>`,
`<|call|>` or `<|return|>`. `harmony_messages(text, final)` reads them from a text that may
be cut anywhere: while streaming a message whose header has not reached `<|message|>` is
not reported, and a body's suffix that may begin a marker is held back.

The server's `openai_gptoss` reasoning parser (`reasoning_parsers.py`) and `openai` tool
parser (`tool_parsers.py`) read replies through this, as vLLM names them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, *ENDS)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"\s*([\w.-]+)")
# the reply's first header begins in the prompt (`<|start|>assistant`): a recipient the model
# writes in the role section comes before its `<|channel|>`
_ROLE_RECIPIENT = re.compile(r"\s*to=[^\s<]+\s*")


@dataclass
class HarmonyMessage:
    channel: str | None  # analysis, commentary, final (None: no channel given)
    recipient: str | None  # "functions.get_weather" for a tool call
    content: str  # its text so far
    done: bool  # its end marker came
    raw: str  # the whole message as written (header, markers, text so far)


def harmony_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of `text` in order (see the module doc); text outside any message
    (before a header: what a parser already took out of its messages) as a message without
    channel or recipient."""
    messages, i = [], 0
    while i < len(text):
        at = text.find(MESSAGE, i)
        part = text[i:] if at < 0 else text[i:at]
        head = min((k for k in (part.find(START), part.find(CHANNEL)) if k >= 0), default=-1)
        loose = part if head < 0 else part[:head]
        if i == 0 and _ROLE_RECIPIENT.fullmatch(loose) and head >= 0:
            loose = ""  # ` to=functions.NAME<|channel|>...`: part of the first header
        if at < 0 and head < 0 and not final:
            loose = held_back_markers(loose)
        if loose:
            messages.append(HarmonyMessage(None, None, loose, True, loose))
        if at < 0:
            break  # a header still being written, or none
        header, body = part[len(loose) :], at + len(MESSAGE)
        end, marker = _first_end(text, body)
        if end < 0:  # the last message, cut off or unterminated
            content = text[body:] if final else held_back_markers(text[body:])
            messages.append(_message(header, content, final, header + MESSAGE + content))
            break
        messages.append(
            _message(header, text[body:end], True, header + text[at : end + len(marker)])
        )
        i = end + len(marker)
    return messages


def has_harmony(text: str) -> bool:
    """Whether the text holds harmony markup (so the parsers apply)."""
    return any(marker in text for marker in (CHANNEL, MESSAGE))


def may_become_harmony(text: str) -> bool:
    """Streaming: whether a text without markers yet may still open with a header (a
    marker, or a role-section recipient ` to=functions.NAME` before `<|channel|>`)."""
    start = text.lstrip()
    if any(marker.startswith(start) or start.startswith(marker) for marker in (START, CHANNEL)):
        return True
    return start.startswith("to=") or "to=".startswith(start)


def held_back_markers(text: str) -> str:
    """`text` less a suffix that may be the start of any marker (streaming)."""
    for k in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-k:]) for marker in MARKERS):
            return text[:-k]
    return text


def _first_end(text: str, start: int) -> tuple[int, str]:
    found = [(text.find(m, start), m) for m in ENDS]
    found = [(at, m) for at, m in found if at >= 0]
    return min(found) if found else (-1, "")


def _message(header: str, content: str, done: bool, raw: str) -> HarmonyMessage:
    channel = None
    if CHANNEL in header:
        name = _CHANNEL_NAME.match(header.split(CHANNEL, 1)[1])
        channel = name.group(1) if name else None
    recipient = _RECIPIENT.search(header)
    return HarmonyMessage(channel, recipient.group(1) if recipient else None, content, done, raw)
