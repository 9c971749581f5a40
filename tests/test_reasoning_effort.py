"""`reasoning_effort` (OpenAI's chat field, which gpt-oss users send): the chat template's
`reasoning_effort` variable, as vLLM gives it to gpt-oss's system message; an explicit
`chat_template_kwargs` entry wins; a value outside low / medium / high is a 400."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from pagellm.engine.chat_template import render_chat_template
from pagellm.entrypoints.openai.chat_templates import ChatTemplates
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.server_options import ServerOptions

TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "<|start|>assistant"
)


class _InProcess:
    """The sandbox's call, run here."""

    async def call(self, lane, target, *args):
        return render_chat_template(*args)


def _render(**fields) -> str:
    tokenizer = SimpleNamespace(get_chat_template=lambda template, tools: TEMPLATE)
    templates = ChatTemplates(tokenizer, _InProcess(), ServerOptions(), max_model_len=256)
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "Hi"}], **fields
    )
    return asyncio.run(templates.render(request))


def test_reasoning_effort_reaches_the_template():
    assert "Reasoning: medium" in _render()
    assert "Reasoning: low" in _render(reasoning_effort="low")
    assert "Reasoning: high" in _render(
        reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}
    )
    assert (
        ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "Hi"}], reasoning_effort="high"
        ).unsupported()
        is None
    )


def test_unknown_reasoning_effort_is_refused():
    with pytest.raises(ValidationError, match="reasoning_effort"):
        ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "Hi"}], reasoning_effort="max"
        )


def test_responses_reasoning_effort_reaches_the_chat_request():
    """The Responses API's `reasoning.effort`: low / medium / high become the chat request's
    `reasoning_effort`; "minimal" (OpenAI's, no gpt-oss level) and no effort leave it unset."""
    from pagellm.entrypoints.openai.responses_protocol import ResponsesRequest

    def effort(reasoning):
        request = ResponsesRequest.model_validate({"input": "Hi", "reasoning": reasoning})
        return request.to_chat_request(request.input_messages()).reasoning_effort

    assert effort({"effort": "low"}) == "low" and effort({"effort": "high"}) == "high"
    assert effort({"effort": "minimal"}) is None and effort({"summary": "auto"}) is None
    assert effort(None) is None
