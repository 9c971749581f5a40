"""`pagellm chat`: an interactive chat in the terminal on an in-process engine, streaming.

Each line read is a user message; the reply is printed as it is generated and the
conversation is kept for the next turn. `/reset` starts over; `/exit` or end of input quits;
Ctrl-C during a reply stops that reply.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.chat_template import render_chat
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import RequestOutputKind, SamplingParams

_PROMPT = "> "


def run_chat(engine_args: EngineArgs, ns: argparse.Namespace) -> int:
    engine = LLMEngine.from_engine_args(engine_args)
    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        output_kind=RequestOutputKind.DELTA,
    )
    print("pagellm chat: type a message; /reset starts over, /exit quits.", flush=True)
    try:
        _loop(engine, params, ns.system)
    finally:
        engine.shutdown()
    return 0


def _loop(engine: LLMEngine, params: SamplingParams, system: str | None) -> None:
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    for turn in itertools.count():
        line = _read_line()
        if line is None or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = _reply(engine, messages, params, f"chat-{turn}")
        if reply is None:
            messages.pop()  # not answered: forget the question
        else:
            messages.append({"role": "assistant", "content": reply})


def _read_line() -> str | None:
    try:
        return input(_PROMPT)
    except EOFError:
        print()
        return None


def _reply(
    engine: LLMEngine, messages: list[dict[str, Any]], params: SamplingParams, request_id: str
) -> str | None:
    """Streams the assistant's reply to stdout; None if it could not be made."""
    try:
        prompt = render_chat(engine.get_tokenizer(), messages)
        engine.add_request(request_id, prompt, params)
    except ValueError as e:  # e.g. the conversation outgrew the context
        print(f"[error: {e}; /reset starts a new conversation]", flush=True)
        return None
    parts: list[str] = []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                parts.append(out.outputs[0].text)
                print(parts[-1], end="", flush=True)
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        print(" [stopped]", end="")
    print(flush=True)
    return "".join(parts)
