"""CORS for `pagellm serve` (issue 38): `--allowed-origins`, `--allowed-methods`,
`--allowed-headers`, `--allow-credentials`, vLLM's flags, but no origin allowed by default.

A preflight (OPTIONS with Origin and Access-Control-Request-Method, sent by browsers without
the API key) from an allowed origin is answered with the CORS headers; from another origin it is
not; responses to an allowed origin carry them, a 401 too, so the page can read it. One server on
the tiny random Llama with an API key and two origins (a JSON list; methods comma-separated);
the default, no CORS headers at all, on conftest's shared server (an API key, no CORS flags);
"*" on the app itself (no engine needed: the middleware answers a preflight).
"""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")  # the server's extra (a GPU machine may lack it)
from fastapi.testclient import TestClient  # noqa: E402
from server_utils import (  # noqa: E402
    API_KEY,
    AUTH,
    Server,
    post,
    start_server,
    stop_server,
    wait_healthy,
)

from pagellm.cli import build_parser  # noqa: E402
from pagellm.engine.arg_utils import EngineArgs  # noqa: E402
from pagellm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagellm.entrypoints.openai.server_options import ServerOptions  # noqa: E402

GOOD = "http://good.example"
ALSO = "https://also.example:8443"
OTHERS = ["http://evil.example", "http://good.example.evil.example", "https://good.example"]
COMPLETION = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    args = [tiny_chat_model, "--max-model-len", "256", "--api-key", API_KEY]
    args += ["--allowed-origins", json.dumps([GOOD, ALSO]), "--allowed-methods", "GET, post"]
    args += ["--allow-credentials"]
    srv = start_server(args, str(tmp_path_factory.mktemp("cors") / "server.log"))
    try:
        wait_healthy(srv)
        yield srv
    finally:
        stop_server(srv)


def _preflight(url: str, origin: str, method: str = "POST") -> httpx.Response:
    """What a browser sends before a page's JSON POST with a key: no Authorization."""
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    return httpx.options(url, headers=headers, timeout=30)


def _cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


def test_a_preflight_from_an_allowed_origin_is_answered_without_a_key(server: Server):
    for origin in (GOOD, ALSO):
        for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
            r = _preflight(server.url + path, origin)
            assert r.status_code == 200, (origin, path, r.text)
            assert r.headers["access-control-allow-origin"] == origin
            assert r.headers["access-control-allow-credentials"] == "true"
            methods = {m.strip() for m in r.headers["access-control-allow-methods"].split(",")}
            assert methods == {"GET", "POST"}
            allowed = r.headers["access-control-allow-headers"].lower()
            assert "authorization" in allowed and "content-type" in allowed
    refused = _preflight(server.url + "/v1/completions", GOOD, method="DELETE")
    assert refused.status_code == 400, refused.text  # --allowed-methods GET,POST


def test_a_preflight_from_another_origin_gets_no_allow_origin(server: Server):
    for origin in OTHERS:
        r = _preflight(server.url + "/v1/chat/completions", origin)
        assert "access-control-allow-origin" not in r.headers, (origin, r.headers)
        assert r.status_code == 400, (origin, r.text)


def test_responses_to_an_allowed_origin_carry_the_headers(server: Server):
    served = post(server, "/v1/completions", COMPLETION, headers={**AUTH, "Origin": GOOD})
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["text"]
    assert served.headers["access-control-allow-origin"] == GOOD
    assert served.headers["access-control-allow-credentials"] == "true"
    refused = post(server, "/v1/completions", COMPLETION, headers={"Origin": GOOD})
    assert refused.status_code == 401, refused.text
    assert refused.headers["access-control-allow-origin"] == GOOD  # the page may read why
    other = post(server, "/v1/completions", COMPLETION, headers={**AUTH, "Origin": OTHERS[0]})
    assert other.status_code == 200, other.text  # the browser, not the server, holds it back
    assert "access-control-allow-origin" not in other.headers


def test_without_the_flags_there_are_no_cors_headers(api_server: Server):
    """conftest's shared server: --api-key, no CORS flags. A preflight passes the key check
    (the app answers OPTIONS with 405), and nothing carries a CORS header."""
    for origin in (GOOD, ALSO, OTHERS[0]):
        r = _preflight(api_server.url + "/v1/chat/completions", origin)
        assert r.status_code == 405, r.text
        assert _cors_headers(r) == {}, r.headers
    models = httpx.get(api_server.url + "/v1/models", headers={**AUTH, "Origin": GOOD}, timeout=30)
    assert models.status_code == 200, models.text
    assert _cors_headers(models) == {}, models.headers


def test_a_star_allows_any_origin():
    """`--allowed-origins '*'` on the app itself (its lifespan, the engine, not started)."""
    options = ServerOptions(api_key=API_KEY, allowed_origins="*")
    client = TestClient(build_app(EngineArgs(), options))
    for origin in (GOOD, *OTHERS):
        r = client.options(
            "/v1/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST"}
        )
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"


def test_the_lists_are_json_or_comma_separated_and_bad_ones_are_usage_errors(capsys):
    parse = build_parser().parse_args
    ns = parse(["serve", "--allowed-origins", f'["{GOOD}", "{ALSO}"]', "--allowed-headers", "a,b"])
    assert (ns.allowed_origins, ns.allowed_headers) == ((GOOD, ALSO), ("a", "b"))
    assert ServerOptions(allowed_methods=["get", "Post"]).allowed_methods == ("GET", "POST")
    assert ServerOptions().allowed_origins == ()  # none by default, unlike vLLM
    for bad, says in (("[1]", "not a list of strings"), (f'["{GOOD}"', "not a JSON list")):
        with pytest.raises(SystemExit) as exit_info:
            parse(["serve", "--allowed-origins", bad])
        assert exit_info.value.code == 2
        assert f"argument --allowed-origins: {bad!r} is {says}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="allowed_origins must be a list of strings"):
        ServerOptions(allowed_origins=[GOOD, 1])
