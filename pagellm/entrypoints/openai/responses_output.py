"""A response's output, built as the reply comes: its output items, its token counts, and for a
stream the typed server-sent events that tell each step, numbered by `sequence_number`.

The reply's text goes through the chat path's `ChatReply` (reasoning parser, then tool-call
parser) one engine output at a time, whether the client streams or not, so a streamed response
and a whole one have the same items. Each piece opens an item of its kind if the open item is of
another kind (closing that one):

- reasoning -> a `reasoning` item (`response.reasoning_text.delta`);
- content -> a `message` item with one `output_text` part (`response.output_text.delta`);
- a tool call -> a `function_call` item (`response.function_call_arguments.delta`).

An item opens with `response.output_item.added` (and `response.content_part.added`) and closes
with its `.done` events; a reply cut by `max_output_tokens` leaves its last item, and the
response, `incomplete`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from pagellm.entrypoints.openai.chat_reply import ChatReply
from pagellm.entrypoints.openai.protocol import OpenAIModel
from pagellm.outputs import RequestOutput

_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}
_DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


def item_id(kind: str) -> str:
    return f"{_PREFIX[kind]}_{uuid.uuid4().hex}"


def _new_item(kind: str) -> dict[str, Any]:
    if kind == "message":
        return {"id": item_id(kind), "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}  # fmt: skip
    return {"id": item_id(kind), "type": "reasoning", "summary": [], "status": "in_progress",
            "content": []}  # fmt: skip


def _new_part(kind: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": ""}


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


# ---- the response object (what the OpenAPI document states) ---------------------------------


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(OpenAIModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(OpenAIModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoning(OpenAIModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = []
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[
    OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")
]


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0  # tokens generated while the reasoning span was open


class ResponseUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(OpenAIModel):
    code: str
    message: str


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: Any = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = {}
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None


class OutputItems:
    """A reply's output items from its (reasoning, content, tool-call) deltas; with `stream`,
    the events of each change, serialized when they happen (`drain` takes them)."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the last item, while deltas may extend it
        self.calls: dict[int, tuple[int, dict[str, Any]]] = {}  # tool-call index -> its item
        self.frames: list[str] = []
        self.sequence_number = 0
        self.spaces = ""  # whitespace that would open a message: held until text follows it

    def emit(self, kind: str, **fields: Any) -> None:
        if not self.stream:
            return
        data = json.dumps({"type": kind, "sequence_number": self.sequence_number, **fields})
        self.frames.append(f"event: {kind}\ndata: {data}\n\n")
        self.sequence_number += 1

    def drain(self) -> str:
        frames, self.frames = "".join(self.frames), []
        return frames

    def add(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> None:
        if reasoning:
            self._text("reasoning", reasoning)
        if content:
            self._content(content)
        for call in calls:
            self.spaces = ""  # the line breaks a model writes before its calls: no message
            self._call(call)

    def _content(self, delta: str) -> None:
        opening = self.open is None or self.open["type"] != "message"
        if opening and delta.isspace():
            self.spaces += delta
            return
        delta, self.spaces = self.spaces + delta, ""
        self._text("message", delta)

    def _open(self, item: dict[str, Any]) -> int:
        self.close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        self.emit("response.output_item.added", output_index=index, item=item)
        return index

    def _text(self, kind: str, delta: str) -> None:
        item, index = self.open, len(self.items) - 1
        if item is None or item["type"] != kind:
            item = _new_item(kind)
            index = self._open(item)
            part = _new_part(kind)
            item["content"].append(part)
            self.emit("response.content_part.added", item_id=item["id"], output_index=index,
                      content_index=0, part=part)  # fmt: skip
        item["content"][0]["text"] += delta
        extra = {"logprobs": []} if kind == "message" else {}
        self.emit(_DELTA[kind], item_id=item["id"], output_index=index, content_index=0,
                  delta=delta, **extra)  # fmt: skip

    def _call(self, delta: dict[str, Any]) -> None:
        """A tool-call delta (`ToolCallStream`'s): the call's name and id first, then its
        arguments piece by piece."""
        function = delta.get("function") or {}
        if "id" in delta:
            item = {"id": item_id("function_call"), "type": "function_call",
                    "call_id": delta["id"], "name": function.get("name") or "",
                    "arguments": "", "status": "in_progress"}  # fmt: skip
            self.calls[delta["index"]] = (self._open(item), item)
        index, item = self.calls[delta["index"]]
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            self.emit("response.function_call_arguments.delta", item_id=item["id"],
                      output_index=index, delta=arguments)  # fmt: skip

    def close(self, status: str = "completed", final: bool = False) -> None:
        """The open item done; `status` incomplete when the reply was cut in it. `final`: the
        reply has ended, whitespace held back is a message of its own."""
        if final and self.spaces:
            self._text("message", self.spaces)
            self.spaces = ""
        item, index = self.open, len(self.items) - 1
        if item is None:
            return
        self.open = None
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            complete = status == "completed" and _json_object(item["arguments"])
            item["status"] = "completed" if complete else "incomplete"
            self.emit("response.function_call_arguments.done", **ids, name=item["name"],
                      arguments=item["arguments"])  # fmt: skip
        else:
            item["status"] = status
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            self.emit(_DONE[item["type"]], **ids, content_index=0, text=part["text"], **extra)
            self.emit("response.content_part.done", **ids, content_index=0, part=part)
        self.emit("response.output_item.done", output_index=index, item=item)


class ResponseRun:
    """One response as it is generated: the reply through `ChatReply` into `OutputItems`, the
    token counts, and the response object at each stage (`response`)."""

    def __init__(
        self,
        skeleton: dict[str, Any],
        reply: ChatReply,
        num_prompt_tokens: int,
        stream: bool,
    ) -> None:
        self.skeleton = {"created_at": int(time.time()), **skeleton}
        self.reply = reply
        self.output = OutputItems(stream)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_generated = 0
        self.num_reasoning = 0
        self.num_cached = 0
        self.finish_reason: str | None = None
        self.answered = False  # content or a tool call came: the reasoning span is over

    def add(self, out: RequestOutput) -> None:
        """One DELTA output of the engine request."""
        # vLLM's name, on the first output; None (or absent) where the engine does not say
        self.num_cached = max(self.num_cached, getattr(out, "num_cached_tokens", None) or 0)
        for completion in out.outputs:
            self.num_generated += len(completion.token_ids)
            final = completion.finish_reason is not None
            reasoning, content, calls = self.reply.update(completion.text, final=final)
            self.answered |= bool(content or calls)
            if self.reply.reasoning is not None and not self.answered:
                self.num_reasoning += len(completion.token_ids)
            self.output.add(reasoning, content, calls)
            if final:
                self.finish_reason = completion.finish_reason

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def finish(self) -> None:
        self.output.close(self.status, final=True)

    def response(self, status: str | None = None, error: dict | None = None) -> dict[str, Any]:
        """The response object: in progress (no output yet), failed, or as it finished."""
        body = {**self.skeleton, "status": status or self.status}
        if status is None:
            body["output"] = self.output.items
            body["usage"] = self.usage()
            if self.status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["error"] = error
        return ResponseObject.model_validate(body).model_dump(mode="json")

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.num_cached},
            "output_tokens": self.num_generated,
            "output_tokens_details": {"reasoning_tokens": self.num_reasoning},
            "total_tokens": self.num_prompt_tokens + self.num_generated,
        }

    def started(self) -> str:
        """A stream's first events."""
        for kind in ("response.created", "response.in_progress"):
            self.output.emit(kind, response=self.response("in_progress"))
        return self.output.drain()

    def ended(self) -> str:
        """A stream's last events: the open item closed, the whole response."""
        self.finish()
        self.output.emit(f"response.{self.status}", response=self.response())
        return self.output.drain()

    def failed(self, status: int, message: str) -> str:
        code = "server_error" if status >= 500 else "invalid_prompt"
        error = {"code": code, "message": message}
        self.output.emit("response.failed", response=self.response("failed", error))
        return self.output.drain()
