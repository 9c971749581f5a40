"""The chat-template renderer (`pagellm/engine/chat_template.py`) against transformers'
`apply_chat_template(..., tokenize=False)`: the same text, or the same refusal, on the embedded
model's template and on templates in the style of Qwen3's (tools, thinking) and Llama 3's
(date, tools in the user turn, `{% generation %}`); and the sandbox lane that runs it
(`pagellm/sandbox.py`): limits, replacement, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagellm.engine.chat_template import (
    check_template_kwargs,
    render_chat,
    render_chat_template,
    special_tokens_of,
    template_of,
)
from pagellm.sandbox import Sandbox, SandboxBusy, SandboxLimitError
from pagellm.sandbox_worker import LaneSpec

QWEN3_STYLE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1, searching=true) %}
{%- for message in messages[::-1] %}
{%- set i = (messages|length - 1) - loop.index0 %}
{%- if ns.searching and message.role == "user" and message.content is string
      and not message.content.startswith('<tool_response>') %}
{%- set ns.searching = false %}{%- set ns.last_query = i %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning|trim + '\\n</think>\\n\\n' + content|trim }}
{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function else call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

LLAMA3_STYLE = """
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
{%- if message.tool_calls is defined and message.tool_calls|length > 1 %}
{{- raise_exception("This model only supports single tool-calls at once!") }}
{%- endif %}
{%- if loop.first and tools is not none and message.role == 'user' %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nTools:\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- message.content | trim + '<|eot_id|>' }}
{%- elif message.role == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- generation %}{{- message.content | trim }}{%- endgeneration %}{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim }}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- for doc in documents or [] %}
{{- '<doc title="' ~ doc.title ~ '">' ~ doc.text ~ '</doc>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

REFUSING = (
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% endfor %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo d'une ville",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
CHATS = {
    "plain": [{"role": "user", "content": "Hi there"}],
    "system": [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "Hi", "name": None},
    ],
    "tools": [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 degrees.", "reasoning_content": "It said 21."},
        {"role": "user", "content": "Thanks"},
    ],
    "reasoning": [  # `reasoning` is aliased to `reasoning_content` and `thinking`
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning": "A greeting: greet back."},
    ],
    "two_calls": [
        {"role": "user", "content": "Two things"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
    ],
}
DOCUMENTS = [{"title": "Sea", "text": "The sea is salty."}]


@pytest.fixture(scope="module")
def tokenizer():
    from pagellm.loader import load_tokenizer, resolve_model_source

    return load_tokenizer(resolve_model_source(None, "auto", None))


def _both(tokenizer, template, messages, **kwargs):
    """(transformers' text or error, ours); errors as ("error", message)."""
    try:
        theirs = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, **kwargs
        )
    except Exception as e:
        theirs = ("error", str(e))
    extra = {k: kwargs.pop(k) for k in ("continue_final_message", "documents") if k in kwargs}
    try:
        ours = render_chat_template(
            template_of(tokenizer, template, kwargs.get("tools")),
            messages,
            special_tokens_of(tokenizer),
            kwargs.pop("add_generation_prompt", False),
            tools=kwargs.pop("tools", None),
            template_kwargs=kwargs,
            **extra,
        )
    except ValueError as e:
        ours = ("error", str(e))
    return theirs, ours


@pytest.mark.parametrize("template", [None, QWEN3_STYLE, LLAMA3_STYLE, REFUSING])
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize(
    "options",
    [
        {"add_generation_prompt": True},
        {"add_generation_prompt": False, "tools": TOOLS},
        {"add_generation_prompt": True, "enable_thinking": False, "bos_token": "<BOS>"},
        {"add_generation_prompt": True, "documents": DOCUMENTS, "date_string": "1 Jan 2025"},
    ],
)
def test_the_same_text_as_apply_chat_template(tokenizer, template, chat, options):
    theirs, ours = _both(tokenizer, template, CHATS[chat], **options)
    if isinstance(theirs, tuple):  # a template's own refusal: its words, in ours
        assert ours[0] == "error" and ours[1].endswith(theirs[1]), (theirs, ours)
        assert ours[1].startswith("messages: the model's chat template refuses them: ")
    else:
        assert ours == theirs


@pytest.mark.parametrize("template", [None, QWEN3_STYLE, LLAMA3_STYLE])
def test_continue_final_message_as_apply_chat_template(tokenizer, template):
    chat = [*CHATS["plain"], {"role": "assistant", "content": "The answer is "}]
    theirs, ours = _both(tokenizer, template, chat, continue_final_message=True)
    assert ours == theirs and ours.rstrip().endswith("The answer is")


def test_errors_are_in_our_words(tokenizer):
    chat = CHATS["plain"]
    cases = {
        "{{ messages[0].content.nope() }}": "refuses them: the messages do not fit it",
        "{{ 1 / 0 }}": "cannot render them",
        "{{ range(10**6) }}": "cannot render them",
        "{% for x in %}": "does not parse \\(line 1\\)",
        "{{ ''.__class__.__subclasses__() }}": "its sandbox forbids",
        "{{ messages.append(1) }}": "its sandbox forbids",
        "{% set ns = namespace(_x=1) %}": "its sandbox forbids",
    }
    for template, words in cases.items():
        with pytest.raises(ValueError, match=words) as info:
            render_chat(tokenizer, chat, chat_template=template)
        assert not any(w in str(info.value) for w in ("jinja", "object", "Error", "__")), info
    with pytest.raises(ValueError, match="'messages' is set by the render itself"):
        render_chat(tokenizer, chat, template_kwargs={"messages": 5})
    check_template_kwargs({"x": [[{"y": None}]], "bos_token": ""})
    deep: list = []
    for _ in range(40):
        deep = [deep]
    for bad in (1 << 70, object(), deep):
        with pytest.raises(ValueError, match="'x' must be JSON data"):
            check_template_kwargs({"x": bad})


# ---- the sandbox lane -------------------------------------------------------------------------

RENDER = "pagellm.engine.chat_template:render_chat_template"
HI = [{"role": "user", "content": "hi"}]


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def test_a_lane_kills_what_passes_its_limits_and_carries_on():
    """Each limit is a SandboxLimitError naming it, quickly; the worker is replaced, and the
    lane renders again. A cancelled call kills its worker (its CPU is freed at once)."""
    spec = LaneSpec("t", workers=1, timeout_s=1.0, memory_limit_mb=64,
                    initializer="pagellm.engine.chat_template:warm_up")  # fmt: skip

    async def main() -> None:
        sandbox = Sandbox([spec])
        await sandbox.start()
        lane = sandbox.lanes["t"]
        assert await sandbox.call("t", RENDER, "{{ messages[0].content }}!", HI) == "hi!"
        hostile = {
            "time": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
            "{% endfor %}",
            "memory": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
            "output": "{% for i in range(99999) %}{{ 'xxxxxxxxxx' }}{% endfor %}",
        }
        for limit, template in hostile.items():
            (worker,) = lane.workers
            start = time.monotonic()
            with pytest.raises(SandboxLimitError) as info:
                await sandbox.call("t", RENDER, template, HI, max_output_chars=10_000)
            assert info.value.limit == limit
            assert time.monotonic() - start < spec.timeout_s + 0.5
            assert await sandbox.call("t", RENDER, "{{ messages[0].content }}", HI) == "hi"
            assert (worker not in lane.workers) == (limit != "output")  # killed, replaced
        with pytest.raises(ValueError, match="refuses them: xxx") as refused:  # kept short
            await sandbox.call("t", RENDER, "{{ raise_exception('x' * 10**6) }}", HI)
        assert len(str(refused.value)) <= 1000
        (worker,) = lane.workers
        call = asyncio.ensure_future(sandbox.call("t", RENDER, hostile["time"], HI))
        await asyncio.sleep(0.3)
        call.cancel()
        await asyncio.sleep(0.05)
        assert worker.proc.returncode is not None  # killed as its caller left
        assert await sandbox.call("t", RENDER, "{{ messages[0].content }}", HI) == "hi"
        await sandbox.close()
        # a lane of other functions, its initializer given arguments; its queue
        init = LaneSpec("init", max_queued=1, initializer="sys:setrecursionlimit",
                        initializer_args=(4321,))  # fmt: skip
        sandbox = Sandbox([init])
        await sandbox.start()
        assert await sandbox.call("init", "sys:getrecursionlimit") == 4321
        (worker,) = sandbox.lanes["init"].workers
        running = asyncio.ensure_future(sandbox.call("init", "time:sleep", 0.5))
        queued = asyncio.ensure_future(sandbox.call("init", "time:sleep", 0))
        await asyncio.sleep(0.1)
        with pytest.raises(SandboxBusy):
            await sandbox.call("init", "time:sleep", 0)
        queued.cancel()  # a queued call leaves without a trace
        assert await running is None and worker.proc.returncode is None
        assert await sandbox.call("init", "sys:getrecursionlimit") == 4321
        await sandbox.close()

    asyncio.run(main())
