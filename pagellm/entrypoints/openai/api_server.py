"""The OpenAI-compatible HTTP server: a FastAPI app on one AsyncLLM, served by uvicorn.

`build_app()` makes the app; its lifespan starts the engine inside the running event loop and
shuts it down (the EngineCore process with it) when the server stops. `/v1/*` needs
`Authorization: Bearer KEY` when an API key is set; `/health`, `/version`, `/metrics`,
`/tokenize` and `/detokenize` are open (as in vLLM, whose key guards `/v1` only).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

import pagellm
from pagellm.config import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.errors import APIError, install_error_handlers
from pagellm.entrypoints.openai.metrics import ServerMetrics
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 2.0
_HEALTH_TIMEOUT_S = 5.0


async def verify_api_key(request: Request) -> None:
    expected = request.app.state.api_key
    if expected is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
        raise APIError("Unauthorized: a valid API key is required (Authorization: Bearer KEY)", 401)


v1 = APIRouter(prefix="/v1", dependencies=[Depends(verify_api_key)])
open_routes = APIRouter()


@v1.post("/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingCompletion = raw_request.app.state.serving_completion
    return await serving.create_completion(request, raw_request)


@v1.post("/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingChat = raw_request.app.state.serving_chat
    return await serving.create_chat_completion(request, raw_request)


@v1.get("/models")
async def show_models(raw_request: Request) -> JSONResponse:
    state = raw_request.app.state
    cards = [
        ModelCard(id=name, root=state.model_path, max_model_len=state.max_model_len)
        for name in state.model_names
    ]
    return JSONResponse(ModelList(data=cards).model_dump())


@open_routes.get("/health")
async def health(raw_request: Request) -> Response:
    """200 while the engine core answers (or is too busy to, within the timeout); else 503."""
    engine: AsyncLLM = raw_request.app.state.engine
    if not engine.errored:
        try:  # a round trip to the core: an idle server notices a dead core here
            await asyncio.wait_for(engine.call_utility("get_num_free_blocks"), _HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        except Exception as e:
            logger.warning("health check failed: %s", e)
    if engine.errored:
        return JSONResponse({"status": "dead", "error": str(engine.dead_error)}, 503)
    return Response(status_code=200)


@open_routes.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    serving: OpenAIServingTokenization = raw_request.app.state.serving_tokenization
    return await serving.tokenize(request)


@open_routes.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    serving: OpenAIServingTokenization = raw_request.app.state.serving_tokenization
    return await serving.detokenize(request)


@open_routes.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": pagellm.__version__})


@open_routes.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    state = raw_request.app.state
    state.metrics.set_scheduler_stats(await _scheduler_stats(state.engine))
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _scheduler_stats(engine: AsyncLLM) -> dict[str, Any]:
    """Fresh stats from the core (the last step's may be stale when idle); else the last ones."""
    if not engine.errored:
        try:
            return await asyncio.wait_for(engine.call_utility("get_stats"), _STATS_TIMEOUT_S)
        except Exception as e:
            logger.warning("could not read the engine's stats: %s", e)
    stats = engine.last_stats
    return {f: getattr(stats, f) for f in stats.__struct_fields__} if stats is not None else {}


def init_app_state(
    app: FastAPI, engine: AsyncLLM, api_key: str | None, chat_options: dict | None = None
) -> None:
    """`chat_options`: OpenAIServingChat's tool_parser, enable_auto_tool_choice and
    chat_template (the text)."""
    model_config = engine.config.model_config
    names = [model_config.served_model_name]
    state = app.state
    state.engine = engine
    state.api_key = api_key
    state.model_names = names
    state.model_path = model_config.model
    state.max_model_len = model_config.max_model_len
    state.metrics = ServerMetrics(names[0])
    state.serving_completion = OpenAIServingCompletion(engine, names, state.metrics)
    state.serving_chat = OpenAIServingChat(engine, names, state.metrics, **(chat_options or {}))
    state.serving_tokenization = OpenAIServingTokenization(engine, names, state.metrics)


def chat_options_from(options: dict) -> dict:
    """Check the chat flags before the engine starts; read the --chat-template file."""
    from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    parser = options.get("tool_call_parser")
    if parser is not None and parser not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {parser!r}"
        )
    if options.get("enable_auto_tool_choice") and parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    template = options.get("chat_template")
    if template is not None:
        with open(template, encoding="utf-8") as f:
            template = f.read()
    return {
        "tool_parser": parser,
        "enable_auto_tool_choice": bool(options.get("enable_auto_tool_choice")),
        "chat_template": template,
    }


def build_app(
    engine_args: EngineArgs,
    api_key: str | None = None,
    address: str = "",
    chat_options: dict | None = None,
) -> FastAPI:
    """The app; `address` ("host:port") only goes into the log line said when it is ready."""
    chat_options = chat_options_from(chat_options or {})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            engine = AsyncLLM.from_engine_args(engine_args)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            logger.error("pagellm serve: cannot start the engine: %s", e)  # before the traceback
            raise
        try:
            init_app_state(app, engine, api_key, chat_options)
            logger.info(
                "pagellm server ready on http://%s (model %r, max_model_len %d)",
                address,
                app.state.model_names[0],
                app.state.max_model_len,
            )
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="pagellm", version=pagellm.__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(v1)
    app.include_router(open_routes)
    return app


def run_server(
    engine_args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    access_log: bool = False,
    chat_options: dict | None = None,
) -> int:
    import uvicorn

    app = build_app(engine_args, api_key, f"{host}:{port}", chat_options)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
    )
    return 0
