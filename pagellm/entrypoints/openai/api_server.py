"""The OpenAI-compatible HTTP server: a FastAPI app on one AsyncLLM, served by uvicorn.

`build_app()` makes the app; its lifespan starts the engine inside the running event loop and
shuts it down (the EngineCore process with it) when the server stops. A `RequestGuard` checks the
API key (`/v1/*`, `/tokenize`, `/detokenize`, `/score`, `/rerank`, `/classify`; `/health`,
`/version` and `/metrics` stay open), the Content-Type and the body's size before a body is read.
An `EngineSupervisor` decides what a dead EngineCore means: exit with status 1 (the default) or
a new core in place (`--restart-engine`). The OpenAPI document declares the errors the server sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import pagellm
from pagellm import envs
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai import chat_page
from pagellm.entrypoints.openai.chat_templates import ChatTemplates, chat_template_lanes
from pagellm.entrypoints.openai.constraint_checks import ConstraintChecks
from pagellm.entrypoints.openai.engine_supervisor import EngineSupervisor
from pagellm.entrypoints.openai.errors import APIError, install_error_handlers
from pagellm.entrypoints.openai.lora_adapters import LoRAAdapters, lora_routes
from pagellm.entrypoints.openai.metrics import ServerMetrics
from pagellm.entrypoints.openai.openapi import openapi_document
from pagellm.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagellm.entrypoints.openai.request_guard import RequestGuard, add_cors
from pagellm.entrypoints.openai.response_models import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from pagellm.entrypoints.openai.responses_output import ResponseObject
from pagellm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagellm.entrypoints.openai.responses_store import ResponseStore
from pagellm.entrypoints.openai.server_options import ServerOptions
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_engine import Admission
from pagellm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagellm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagellm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagellm.sandbox import Sandbox

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 2.0
_EXIT_GRACE_S = 3  # after the engine's death: how long open responses may take to finish


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse} for code in codes}


_GENERATE_ERRORS = _errors(400, 401, 404, 413, 415, 429, 500, 503)
_STREAM = {200: {"content": {"text/event-stream": {}}}}


def _generative(raw_request: Request, endpoint: str) -> None:
    """A pooling model generates nothing: a 400 naming what it serves."""
    model_config = raw_request.app.state.engine.config.model_config
    if model_config.pooler_config is not None:
        what = "/v1/embeddings" if model_config.pooler_config.task == "embed" else "/classify"
        raise APIError(
            f"{model_config.served_model_name!r} is a pooling model: it serves {what}, "
            f"/score and /rerank, not {endpoint}",
            400,
        )


v1 = APIRouter(prefix="/v1")
open_routes = APIRouter()


@v1.post(
    "/completions",
    response_model=CompletionResponse,
    responses={**_GENERATE_ERRORS, **_STREAM},
)
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    _generative(raw_request, "/v1/completions")
    serving: OpenAIServingCompletion = raw_request.app.state.serving_completion
    return await serving.create_completion(request, raw_request)


@v1.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**_GENERATE_ERRORS, **_STREAM},
)
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    _generative(raw_request, "/v1/chat/completions")
    serving: OpenAIServingChat = raw_request.app.state.serving_chat
    return await serving.create_chat_completion(request, raw_request)


@v1.post("/responses", response_model=ResponseObject, responses={**_GENERATE_ERRORS, **_STREAM})
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    _generative(raw_request, "/v1/responses")
    return await raw_request.app.state.serving_responses.create_response(request, raw_request)


@v1.get("/responses/{response_id}", response_model=ResponseObject, responses=_errors(401, 404))
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    return raw_request.app.state.serving_responses.retrieve(response_id)


_POOLING_ERRORS = _errors(400, 401, 404, 413, 415, 429, 500, 503)


@v1.post("/embeddings", response_model=EmbeddingResponse, responses=_POOLING_ERRORS)
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    return await raw_request.app.state.serving_pooling.embeddings(request, raw_request)


@open_routes.post("/classify", response_model=ClassificationResponse, responses=_POOLING_ERRORS)
async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
    return await raw_request.app.state.serving_pooling.classify(request, raw_request)


@open_routes.post("/score", response_model=ScoreResponse, responses=_POOLING_ERRORS)
@v1.post("/score", response_model=ScoreResponse, responses=_POOLING_ERRORS)  # vLLM's alias
async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    return await raw_request.app.state.serving_pooling.score(request, raw_request)


@open_routes.post("/rerank", response_model=RerankResponse, responses=_POOLING_ERRORS)
@open_routes.post("/v2/rerank", response_model=RerankResponse, responses=_POOLING_ERRORS)
@v1.post("/rerank", response_model=RerankResponse, responses=_POOLING_ERRORS)
async def do_rerank(request: RerankRequest, raw_request: Request) -> Response:
    return await raw_request.app.state.serving_pooling.rerank(request, raw_request)


@v1.get("/models", response_model=ModelList, responses=_errors(401))
async def show_models(raw_request: Request) -> JSONResponse:
    state = raw_request.app.state
    cards = [
        ModelCard(id=name, root=state.model_path, max_model_len=state.max_model_len)
        for name in state.model_names
    ]
    cards += state.lora_adapters.cards(state.max_model_len)
    return JSONResponse(ModelList(data=cards).model_dump())


@open_routes.get(
    "/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}}
)
async def health(raw_request: Request) -> JSONResponse:
    """200 while the engine core runs; 503 while it restarts or once it is dead."""
    state = raw_request.app.state
    engine: AsyncLLM = state.engine
    if state.supervisor.restarting:
        return JSONResponse({"status": "restarting"}, 503, headers={"Retry-After": "1"})
    if engine.errored:
        return JSONResponse({"status": "dead", "error": str(engine.dead_error)}, 503)
    return JSONResponse({"status": "ok"})


_TOKENIZE_ERRORS = _errors(400, 401, 404, 413, 415, 500)


@open_routes.post("/tokenize", responses=_TOKENIZE_ERRORS)
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    serving: OpenAIServingTokenization = raw_request.app.state.serving_tokenization
    return await serving.tokenize(request, raw_request)


@open_routes.post("/detokenize", responses=_TOKENIZE_ERRORS)
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    serving: OpenAIServingTokenization = raw_request.app.state.serving_tokenization
    return await serving.detokenize(request)


@open_routes.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": pagellm.__version__})


@open_routes.get("/metrics", response_class=PlainTextResponse)
async def metrics(raw_request: Request) -> Response:
    state = raw_request.app.state
    state.metrics.set_scheduler_stats(await _scheduler_stats(state.engine))
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _scheduler_stats(engine: AsyncLLM) -> dict[str, Any]:
    """Fresh stats from the core (the last step's may be stale when idle); else the last ones.
    A dead core has nothing running and holds no blocks."""
    if engine.errored:
        return {}
    try:
        return await asyncio.wait_for(engine.call_utility("get_stats"), _STATS_TIMEOUT_S)
    except Exception as e:
        logger.warning("could not read the engine's stats: %s", e)
    stats = engine.last_stats
    return {f: getattr(stats, f) for f in stats.__struct_fields__} if stats is not None else {}


def init_app_state(
    app: FastAPI, engine: AsyncLLM, options: ServerOptions, chat_options: dict | None = None
) -> None:
    """`chat_options`: OpenAIServingChat's tool_parser and enable_auto_tool_choice, and the
    server's chat_template (the text). The sandbox's lanes are started by the caller
    (`state.sandbox.start()`)."""
    chat_options = dict(chat_options or {})
    model_config = engine.config.model_config
    names = [model_config.served_model_name]
    state = app.state
    state.engine = engine
    state.model_names = names
    state.model_path = model_config.model
    state.max_model_len = model_config.max_model_len
    state.metrics = ServerMetrics(names[0])
    max_num_seqs = engine.config.scheduler_config.max_num_seqs
    admission = Admission(max_num_seqs + options.max_waiting_requests)
    args = (engine, names, state.metrics, admission)
    state.sandbox = Sandbox(chat_template_lanes(options))
    templates = ChatTemplates(
        engine.tokenizer,
        state.sandbox,
        options,
        model_config.max_model_len,
        chat_options.pop("chat_template", None),
    )
    state.serving_completion = OpenAIServingCompletion(*args)
    state.serving_chat = OpenAIServingChat(*args, templates=templates, **chat_options)
    state.serving_tokenization = OpenAIServingTokenization(*args, templates=templates)
    state.serving_pooling = OpenAIServingPooling(*args)
    store = ResponseStore(options.responses_store_max, options.responses_store_ttl)
    state.serving_responses = OpenAIServingResponses(
        *args, templates=templates, store=store, **chat_options
    )
    state.constraints = ConstraintChecks(
        engine.tokenizer, model_config, engine.config.structured_outputs_config, options
    )
    for serving in (state.serving_completion, state.serving_chat, state.serving_responses):
        serving.constraints = state.constraints
    state.lora_adapters = LoRAAdapters(engine, names)
    for name, path in options.lora_modules:  # a bad one stops the start: its error says why
        state.lora_adapters.load(name, path)
    for serving in (state.serving_completion, state.serving_chat, state.serving_responses,
                    state.serving_tokenization, state.serving_pooling):  # fmt: skip
        serving.loras = state.lora_adapters
    state.supervisor = EngineSupervisor(
        engine,
        getattr(state, "request_exit", _no_exit),
        options.restart_engine,
        options.max_engine_restarts,
        on_restart=state.metrics.on_engine_restart,
        spare=options.engine_spare,
    )


def _no_exit(code: int) -> None:
    logger.error("the server cannot stop itself here (not run by run_server)")


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
    options: ServerOptions | None = None,
    address: str = "",
    chat_options: dict | None = None,
) -> FastAPI:
    """The app; `address` ("host:port") only goes into the log line said when it is ready."""
    options = options or ServerOptions()
    chat_options = chat_options_from(chat_options or {})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            engine = AsyncLLM.from_engine_args(engine_args)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            logger.error("pagellm serve: cannot start the engine: %s", e)  # before the traceback
            raise
        supervision = None
        try:
            init_app_state(app, engine, options, chat_options)
            await app.state.sandbox.start()
            if envs.warm_grammar_backend(engine.config.device):
                app.state.constraints.warm_up()
            engine.start()
            await app.state.lora_adapters.read_all()
            supervision = asyncio.create_task(app.state.supervisor.run())
            logger.info(
                "pagellm server ready on http://%s (model %r, max_model_len %d)",
                address,
                app.state.model_names[0],
                app.state.max_model_len,
            )
            yield
        finally:
            if supervision is not None:
                supervision.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await supervision
            if getattr(app.state, "sandbox", None) is not None:
                await app.state.sandbox.close()
            if getattr(app.state, "constraints", None) is not None:
                await app.state.constraints.close()
            engine.shutdown()

    app = FastAPI(title="pagellm", version=pagellm.__version__, lifespan=lifespan)
    _mount_routes(app, engine_args, options)
    return app


def _mount_routes(app: FastAPI, engine_args: EngineArgs, options: ServerOptions) -> None:
    """Routes, error handlers and the middleware (the guard, CORS outside it)."""
    install_error_handlers(app)
    app.include_router(v1)
    # with --enable-lora only (vLLM's runtime loading): behind the API key, as all of /v1
    lora = lora_routes.routes if engine_args.enable_lora else []
    if lora:
        app.include_router(lora_routes)
    app.include_router(open_routes)
    app.include_router(chat_page.router)  # GET /: the chat page, public
    routes = (*v1.routes, *open_routes.routes, *lora)
    json_paths = {r.path for r in routes if "POST" in r.methods}
    app.add_middleware(
        RequestGuard,
        api_key=options.api_key,
        max_body_bytes=options.max_request_body_bytes,
        json_paths=json_paths,
    )
    add_cors(app, options)  # after the guard: outside it
    app.openapi = lambda: openapi_document(app, options.api_key is not None, __doc__)


def run_server(
    engine_args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 8000,
    options: ServerOptions | None = None,
    log_level: str = "info",
    access_log: bool = False,
    chat_options: dict | None = None,
) -> int:
    """Serves until stopped; returns the exit status (1: the engine core died)."""
    import uvicorn

    app = build_app(engine_args, options, f"{host}:{port}", chat_options)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    app.state.exit_code = 0

    def request_exit(code: int) -> None:
        app.state.exit_code = code
        config.timeout_graceful_shutdown = _EXIT_GRACE_S
        server.should_exit = True

    app.state.request_exit = request_exit
    server.run()
    return app.state.exit_code
