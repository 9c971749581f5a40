"""The server's chat-template renders: which template a request gets, in which sandbox lane,
and what a refusal or a limit says.

The server's own template (the model's, or `--chat-template`) renders in lane `chat_template`;
a template sent in a request (`chat_template`, refused without `--trust-request-chat-template`)
in lane `request_chat_template`, whose workers run at a low CPU priority: hostile templates
never queue in front of the server's own renders, and take little CPU from anything else.
Both lanes have the same limits (`--chat-template-timeout`, `--chat-template-max-memory-mb`,
`--chat-template-max-output-chars`); a render past one is a 400 naming its flag, and its
worker is killed and replaced (`pagellm/sandbox.py`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagellm.engine.chat_template import check_template_kwargs, special_tokens_of, template_of
from pagellm.entrypoints.openai.errors import APIError, too_busy
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from pagellm.entrypoints.openai.server_options import ServerOptions
from pagellm.sandbox import Sandbox, SandboxBusy, SandboxError, SandboxLimitError
from pagellm.sandbox_worker import LaneSpec

SERVER_LANE = "chat_template"
REQUEST_LANE = "request_chat_template"
_RENDER = "pagellm.engine.chat_template:render_chat_template"
_CHARS_PER_TOKEN = 32  # more characters than max_model_len x this cannot fit the context
_SERVER_QUEUE = 4096  # renders waiting for the server's template (chat is admitted before)
_REQUEST_QUEUE_PER_WORKER = 16
# requests' templates: a tenth of a core's time where a normal process wants it, all of it where
# the CPU is idle (19 would starve them on a busy CPU-only server)
_NICE = 10


def chat_template_lanes(options: ServerOptions) -> list[LaneSpec]:
    server = LaneSpec(
        SERVER_LANE,
        workers=options.chat_template_workers,
        max_queued=_SERVER_QUEUE,
        timeout_s=options.chat_template_timeout,
        memory_limit_mb=options.chat_template_max_memory_mb,
        initializer="pagellm.engine.chat_template:warm_up",
    )
    if not options.trust_request_chat_template:
        return [server]
    queued = _REQUEST_QUEUE_PER_WORKER * options.chat_template_workers
    return [
        server,
        msgspec.structs.replace(server, name=REQUEST_LANE, max_queued=queued, nice=_NICE),
    ]


class ChatTemplates:
    """Renders a chat or /tokenize request's messages in the sandbox."""

    def __init__(
        self,
        tokenizer: Any,
        sandbox: Sandbox,
        options: ServerOptions,
        max_model_len: int,
        server_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.sandbox = sandbox
        self.options = options
        self.server_template = server_template  # --chat-template: the file's text
        self.special_tokens = special_tokens_of(tokenizer) if tokenizer is not None else {}
        self.max_output_chars = options.chat_template_max_output_chars or (
            _CHARS_PER_TOKEN * max_model_len
        )

    async def render(self, request: ChatCompletionRequest | TokenizeRequest) -> str:
        kwargs = dict(request.chat_template_kwargs or {})
        if getattr(request, "reasoning_effort", None) is not None:
            kwargs.setdefault("reasoning_effort", request.reasoning_effort)
        lane, template = self._lane_and_template(request, kwargs)
        messages = [m.to_template_dict() for m in request.messages]
        try:
            return await self.sandbox.call(
                lane, _RENDER, template, messages, self.special_tokens,
                request.add_generation_prompt, False, request.tools, None, kwargs,
                self.max_output_chars,
            )  # fmt: skip
        except ValueError as e:  # the render's own words
            raise APIError(str(e), 400, _param(lane)) from None
        except SandboxLimitError as e:
            raise APIError(self._past_limit(e.limit), 400, _param(lane)) from None
        except SandboxBusy:
            raise too_busy("too many chat templates wait to be rendered; retry later") from None
        except SandboxError:
            raise APIError(
                "messages: the chat template's render ended its sandbox process", 400, _param(lane)
            ) from None

    def _lane_and_template(
        self, request: ChatCompletionRequest | TokenizeRequest, kwargs: dict[str, Any]
    ) -> tuple[str, str]:
        """A request's own template only with --trust-request-chat-template, in its own lane;
        kwargs that are the render's own arguments refused."""
        own = request.chat_template is not None or "chat_template" in kwargs
        if own and not self.options.trust_request_chat_template:
            raise APIError(
                "this server does not render chat templates sent in requests (chat_template); "
                "its operator can allow them with --trust-request-chat-template",
                400,
                "chat_template",
            )
        try:
            check_template_kwargs(kwargs)
        except ValueError as e:
            raise APIError(str(e), 400, "chat_template_kwargs") from None
        lane, template = SERVER_LANE, self.server_template
        if request.chat_template is not None:
            lane, template = REQUEST_LANE, request.chat_template
        return lane, template_of(self.tokenizer, template, request.tools)

    def _past_limit(self, limit: str) -> str:
        options = self.options
        if limit == "time":
            return (
                f"messages: rendering the chat template took more than "
                f"{options.chat_template_timeout:g} s (the server's --chat-template-timeout)"
            )
        if limit == "memory":
            return (
                f"messages: rendering the chat template took more than "
                f"{options.chat_template_max_memory_mb} MB of memory (the server's "
                "--chat-template-max-memory-mb)"
            )
        return (
            f"messages: the rendered chat passed {self.max_output_chars} characters (the "
            "server's --chat-template-max-output-chars)"
        )


def _param(lane: str) -> str:
    return "chat_template" if lane == REQUEST_LANE else "messages"
