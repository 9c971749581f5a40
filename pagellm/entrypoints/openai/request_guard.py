"""RequestGuard: what the server checks before it reads a request's body (an ASGI middleware);
`add_cors`: the CORS layer in front of it.

In order: the API key (`Authorization: Bearer KEY`, the scheme in any case, RFC 7235) on `/v1/*`,
`/tokenize`, `/detokenize`, `/score`, `/rerank` and `/classify` (not on a CORS preflight, which
browsers send without it); the Content-Type of a POST to a JSON endpoint; a body's size
(`--max-request-body-bytes`: a Content-Length over it is refused before a byte is read, a chunked
body as soon as it grows past it). A request refused here costs the server no parsing.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pagellm.entrypoints.openai.errors import APIError, error_json
from pagellm.entrypoints.openai.server_options import ServerOptions

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

PROTECTED_PATHS = (
    "/v1/",
    "/v2/",
    "/tokenize",
    "/detokenize",
    "/score",
    "/rerank",
    "/classify",
)  # the API key guards these
_BODY_METHODS = {"POST", "PUT", "PATCH"}


class RequestGuard:
    def __init__(
        self, app: Any, api_key: str | None, max_body_bytes: int, json_paths: set[str]
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.json_paths = json_paths  # POST endpoints whose body is JSON

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            headers = _headers(scope)
            if not _is_preflight(scope, headers):  # browsers send no Authorization with it
                self._check_key(scope["path"], headers)
            if scope["method"] in _BODY_METHODS:
                if scope["path"] in self.json_paths:
                    _check_content_type(headers)
                receive = await self._read_body(headers, receive)
        except APIError as e:
            return await error_json(e)(scope, receive, send)
        await self.app(scope, receive, send)

    def _check_key(self, path: str, headers: dict[str, str]) -> None:
        if self.api_key is None or not path.startswith(PROTECTED_PATHS):
            return
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )
        if not ok:
            raise APIError(
                "Unauthorized: a valid API key is required (Authorization: Bearer KEY)", 401
            )

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> Receive:
        """The whole body, within the limit, handed on to the app as one message."""
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise self._too_large() if length.isdigit() else APIError("bad Content-Length")
        chunks, size, message = [], 0, {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                return _replay(message, receive)
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(message.get("body", b""))
        return _replay({"type": "http.request", "body": b"".join(chunks)}, receive)

    def _too_large(self) -> APIError:
        return APIError(
            f"the request body is larger than this server accepts ({self.max_body_bytes} bytes, "
            "--max-request-body-bytes)",
            413,
        )


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _is_preflight(scope: Scope, headers: dict[str, str]) -> bool:
    """A browser's CORS preflight: OPTIONS asking whether a method may be used."""
    return scope["method"] == "OPTIONS" and "access-control-request-method" in headers


def _check_content_type(headers: dict[str, str]) -> None:
    given = headers.get("content-type")
    media_type = (given or "").split(";")[0].strip().lower()
    if media_type == "application/json" or media_type.endswith("+json"):
        return
    got = f"got {given!r}" if given else "no Content-Type was sent"
    message = f"the request body must be JSON, with Content-Type: application/json ({got})"
    raise APIError(message, 415)


def _replay(first: dict[str, Any], receive: Receive) -> Receive:
    """A receive() that returns `first` once, then what the client sends (a disconnect)."""
    pending = [first]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed


def add_cors(app: FastAPI, options: ServerOptions) -> None:
    """CORS headers only for the origins --allowed-origins names (none by default). Added after
    the RequestGuard, it is the outer layer: a preflight is answered before any key is asked
    for, and refusals (401, 413) carry the headers that let the page read them."""
    if not options.allowed_origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=options.allowed_origins,
        allow_methods=options.allowed_methods,
        allow_headers=options.allowed_headers,
        allow_credentials=options.allow_credentials,
    )
    logger.info("CORS: allowing origins %s", ", ".join(options.allowed_origins))
