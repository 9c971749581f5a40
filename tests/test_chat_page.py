"""The chat page at `/` (`pagellm/entrypoints/openai/static/chat.html`), served and used.

Without a browser: the page's response (public, HTML, nothing loaded from elsewhere). With one:
Debian's headless Chromium, driven by Selenium through `/usr/bin/chromedriver`, uses the page
against conftest's `api_server` (the embedded model, an API key, hermes tool calls): the key
asked for on a 401, streamed greedy replies equal to what the HTTP API answers to the same
request, stop sequences, the Stop button, a new chat, server errors, tool calls and copying.
The thinking block needs a reasoning parser: a second, small server (a tiny random model with
`--reasoning-parser deepseek_r1`, whose whole reply is thinking) is started for that test only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tempfile

import httpx
import pytest
from server_utils import (
    API_KEY,
    Server,
    post,
    start_server,
    stop_server,
    wait_healthy,
    wait_kv_free,
)
from timing import scaled

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MAX_TOKENS = 10
REPLY_TIMEOUT_S = 60

# The last assistant message as the page shows it.
LAST_REPLY_JS = """
const m = [...document.querySelectorAll('#messages article.assistant')].pop();
if (!m) return null;
const text = (sel) => { const e = m.querySelector(sel); return e ? e.textContent : null; };
return {state: m.dataset.state, text: text('.content'), thinking: text('.thinking pre'),
  error: text('.error'), status: text('.status'),
  calls: [...m.querySelectorAll('.tool-call')].map(
    (c) => [c.querySelector('.tool-name').textContent, c.querySelector('.tool-args').textContent])};
"""
# Records the last reply's text at every DOM change while it streams: the renders a user saw.
RECORD_RENDERS_JS = """
window.renders = [];
new MutationObserver(() => {
  const m = [...document.querySelectorAll('#messages article.assistant')].pop();
  if (m && m.dataset.state === 'streaming')
    window.renders.push(m.querySelector('.content').textContent);
}).observe(document.getElementById('messages'),
  {childList: true, subtree: true, characterData: true, attributes: true});
"""


# ---- without a browser ---------------------------------------------------------------------


def test_page_is_public_html_and_loads_nothing_from_elsewhere(api_server):
    page = httpx.get(f"{api_server.url}/", timeout=30)  # no key: the page itself is public
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "<script>" in html and 'id="messages"' in html
    assert not re.findall(r"https?://", html), "the page names an outside URL"
    assert not re.findall(r"""(?:src|href)\s*=\s*["']?//""", html)
    assert not re.findall(r"@import|url\(", html)
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert httpx.get(f"{api_server.url}/v1/models", timeout=30).status_code == 401
    assert "/" not in httpx.get(f"{api_server.url}/openapi.json", timeout=30).json()["paths"]


# ---- in a browser --------------------------------------------------------------------------


def in_browser(test):
    """A test in Chromium: skipped (before any server starts) without the browser or Selenium."""
    no_chromium = not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER))
    no_selenium = importlib.util.find_spec("selenium") is None
    test = pytest.mark.skipif(
        no_chromium, reason="no Chromium: apt-get install chromium chromium-driver"
    )(test)
    return pytest.mark.skipif(no_selenium, reason="no selenium: pip install -e '.[dev]'")(test)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        # the driver's path given: selenium-manager never looks for (or downloads) one
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()


@pytest.fixture(scope="module")
def page(browser, api_server):
    """The page with the API key in its storage, as after the user gave it once."""
    return Page(browser, api_server.url, key=API_KEY)


class Page:
    """The chat page in the browser, driven as a user would: typing, clicking."""

    def __init__(self, driver, url: str, key: str | None) -> None:
        self.driver = driver
        self.url = url
        self.key = key

    def open(self) -> Page:
        """A fresh load, with only `key` in the page's storage."""
        self.driver.get(f"{self.url}/")
        self.driver.execute_script(
            "localStorage.clear(); if (arguments[0]) localStorage.setItem('pagellm.apiKey', "
            "arguments[0]);",
            self.key,
        )
        self.driver.get(f"{self.url}/")
        if self.key is not None:
            self.wait_for(lambda: self.js("return document.getElementById('model').length") > 0)
        return self

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def el(self, element_id: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, element_id)

    def wait_for(self, condition, timeout: float = REPLY_TIMEOUT_S):
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, scaled(timeout), poll_frequency=0.05).until(
            lambda _: condition()
        )

    def fill(self, element_id: str, text: str) -> None:
        field = self.el(element_id)
        field.clear()
        field.send_keys(text)

    def settings(self, **fields: str) -> None:
        """Settings fields by id (max_tokens -> #max-tokens), typed in."""
        for name, value in fields.items():
            self.fill(name.replace("_", "-"), value)

    def send(self, text: str) -> None:
        """Types the prompt and presses Enter, as a user does."""
        from selenium.webdriver.common.keys import Keys

        self.fill("prompt", text)
        self.el("prompt").send_keys(Keys.ENTER)

    def reply(self) -> dict | None:
        return self.js(LAST_REPLY_JS)

    def wait_reply(self, state: str = "done") -> dict:
        """The last reply once it is in `state` (done, stopped, error)."""
        self.wait_for(lambda: (self.reply() or {}).get("state") in (state, "error"))
        reply = self.reply()
        assert reply["state"] == state, reply
        return reply


def api_chat(server: Server, messages: list[dict], **fields) -> dict:
    """The assistant message the HTTP API answers (not streamed) to the same request, with
    the request's `usage`."""
    response = post(server, "/v1/chat/completions", {"messages": messages, **fields})
    assert response.status_code == 200, response.text
    return {**response.json()["choices"][0]["message"], "usage": response.json()["usage"]}


GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}


@in_browser
def test_key_asked_on_401_then_reply_streams_as_the_api_answers(browser, api_server):
    page = Page(browser, api_server.url, key=None).open()
    page.wait_for(lambda: page.el("key-bar").is_displayed())
    assert page.el("key-message").text.startswith("HTTP 401: Unauthorized: a valid API key")
    page.fill("key-input", "wrong-key")
    page.el("key-input").submit()
    page.wait_for(lambda: page.el("key-bar").is_displayed())  # asked again
    page.fill("key-input", API_KEY)
    page.el("key-input").submit()
    page.wait_for(lambda: page.js("return document.getElementById('model').value") != "")
    assert not page.el("key-bar").is_displayed()
    assert page.js("return localStorage.getItem('pagellm.apiKey')") == API_KEY

    system, prompt = "You are a poet.", "Write a haiku about the sea."
    page.settings(system=system, temperature="0", max_tokens=str(MAX_TOKENS))
    page.js(RECORD_RENDERS_JS)
    page.send(prompt)
    reply = page.wait_reply()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    answer = api_chat(api_server, messages, **GREEDY)
    expected, usage = answer["content"], answer["usage"]
    assert expected and reply["text"] == expected
    assert reply["status"].startswith(
        f"{usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} tokens, "
    )
    partial = [r for r in page.js("return window.renders") if 0 < len(r) < len(expected)]
    assert partial and all(expected.startswith(r) for r in partial), "no render before the end"


@in_browser
def test_a_server_asking_again_for_the_key_resends_the_prompt(browser, api_server):
    page = Page(browser, api_server.url, key=API_KEY).open()
    page.js("localStorage.setItem('pagellm.apiKey', 'stale-key')")  # the key changed meanwhile
    page.settings(temperature="0", max_tokens=str(MAX_TOKENS))
    page.send("Name a color.")
    page.wait_for(lambda: page.el("key-bar").is_displayed())
    assert page.reply() is None  # the refused turn is not in the conversation
    page.fill("key-input", API_KEY)
    page.el("key-input").submit()
    reply = page.wait_reply()
    expected = api_chat(api_server, [{"role": "user", "content": "Name a color."}], **GREEDY)
    assert reply["text"] == expected["content"]


@in_browser
def test_conversation_stop_sequences_and_new_chat(page, api_server):
    page.open()
    first, second = "<b>Hi!</b> <img src=x>", "Tell me about the moon."
    page.settings(temperature="0", max_tokens=str(MAX_TOKENS))
    page.send(first)
    reply = page.wait_reply()
    assert page.js("return document.querySelectorAll('#messages b, #messages img').length") == 0
    assert page.js("return document.querySelector('.message.user .content').textContent") == first

    history = [{"role": "user", "content": first}, {"role": "assistant", "content": reply["text"]}]
    history.append({"role": "user", "content": second})
    whole = api_chat(api_server, history, **GREEDY)["content"]
    word = whole.split()[len(whole.split()) // 2]  # cut the reply in its middle
    stops = ["@@never@@", word]
    expected = api_chat(api_server, history, stop=stops, **GREEDY)["content"]
    assert len(expected) < len(whole), (whole, word)
    page.settings(stop_sequences="\n".join(stops))  # one a line
    page.send(second)
    assert page.wait_reply()["text"] == expected

    page.el("new-chat").click()
    assert page.js("return document.getElementById('messages').children.length") == 0
    page.settings(stop_sequences=f"@@never@@, {word}")  # comma separated, blanks dropped
    page.send(second)
    alone = api_chat(api_server, [history[-1]], stop=stops, **GREEDY)
    reply = page.wait_reply()
    assert reply["text"] == alone["content"]
    # the prompt the server saw had the new chat's one message, not the old turns
    assert reply["status"].startswith(f"{alone['usage']['prompt_tokens']} prompt tokens,")


@in_browser
def test_stop_button_aborts_the_reply_on_the_server(page, api_server):
    page.open()
    page.settings(temperature="0", max_tokens="600")
    page.send("Write a long story about a dragon.")
    page.wait_for(lambda: len((page.reply() or {}).get("text") or "") > 0)
    assert page.el("send").get_attribute("disabled") is not None
    page.el("stop").click()
    reply = page.wait_reply("stopped")
    assert reply["text"] and reply["status"] == "Stopped."
    assert page.el("send").get_attribute("disabled") is None
    wait_kv_free(api_server)  # the server aborted the request: it runs nothing, holds no block


@in_browser
def test_server_errors_are_shown_and_the_prompt_is_kept(page, api_server):
    page.open()
    prompt = "Hello there."
    page.settings(max_tokens="5000")  # more than the context (1024)
    page.send(prompt)
    page.wait_for(lambda: page.el("error").is_displayed())
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 5000}
    message = post(api_server, "/v1/chat/completions", body).json()["error"]["message"]
    assert page.el("error").text == f"HTTP 400: {message}"
    assert page.reply() is None and page.el("prompt").get_attribute("value") == prompt

    page.settings(max_tokens=str(MAX_TOKENS), tools="[{not json")
    page.send(prompt)
    page.wait_for(lambda: "Tools must be a JSON array" in page.el("error").text)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}


@in_browser
def test_tool_calls_are_shown_apart_and_copied(page, api_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    page.open()
    prompt = "What is the weather in Paris?"
    page.settings(temperature="0", max_tokens="40", tools=json.dumps([WEATHER_TOOL]))
    Select(page.el("tool-choice")).select_by_value("required")
    page.send(prompt)
    reply = page.wait_reply()
    fields = {"tools": [WEATHER_TOOL], "tool_choice": "required", "temperature": 0}
    expected = api_chat(api_server, [{"role": "user", "content": prompt}], max_tokens=40, **fields)
    call = expected["tool_calls"][0]["function"]
    assert reply["calls"] == [[f"Tool call: {call['name']}", call["arguments"]]]
    assert reply["text"] == ""

    origin = page.url
    page.driver.execute_cdp_cmd(
        "Browser.grantPermissions",
        {"origin": origin, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
    )
    button = page.driver.find_elements(By.CSS_SELECTOR, "article.assistant button.copy")[-1]
    button.click()
    page.wait_for(lambda: button.text == "Copied")
    copied = page.driver.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], (e) => arguments[0]('' + e))"
    )
    assert copied == f"{call['name']}({call['arguments']})"


@pytest.fixture(scope="module")
def thinking_server(tiny_chat_model, tmp_path_factory):
    """A tiny random model whose whole reply is thinking (deepseek_r1: the prompt opens it)."""
    args = [tiny_chat_model, "--max-model-len", "256", "--reasoning-parser", "deepseek_r1"]
    srv = start_server(args, str(tmp_path_factory.mktemp("thinking") / "server.log"))
    try:
        wait_healthy(srv)
        yield srv
    finally:
        stop_server(srv)


@in_browser
def test_thinking_is_shown_apart_from_the_answer(browser, thinking_server):
    page = Page(browser, thinking_server.url, key=None).open()
    page.wait_for(lambda: page.js("return document.getElementById('model').length") > 0)
    page.settings(temperature="0", max_tokens=str(MAX_TOKENS))
    page.send("Think first.")
    reply = page.wait_reply()
    expected = api_chat(thinking_server, [{"role": "user", "content": "Think first."}], **GREEDY)
    assert expected["reasoning_content"] and not expected["content"]
    assert reply["thinking"] == expected["reasoning_content"] and reply["text"] == ""
