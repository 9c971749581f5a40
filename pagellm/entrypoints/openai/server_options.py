"""ServerOptions: the flags of `pagellm serve` that are the server's own (the engine's are
EngineArgs); the CLI makes one flag per field, its help from the field's metadata. A module of
its own, so the CLI builds its parser without importing FastAPI."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field


def _flag(
    default: object,
    help: str,
    choices: tuple[str, ...] | None = None,
    parse: Callable[[str], object] | None = None,
    nargs: str | None = None,
) -> object:
    """`parse`: how the CLI reads the flag's text (default: the field's scalar type); `nargs`:
    argparse's, for a flag that takes several values (each parsed)."""
    metadata = {"help": help, "choices": choices, "parse": parse, "nargs": nargs}
    return field(default=default, metadata=metadata)


def parse_list(text: str) -> tuple[str, ...]:
    """A list flag's text: a JSON list of strings, as vLLM takes it (`'["https://a.example"]'`),
    or the same comma-separated (`https://a.example,https://b.example`)."""
    text = text.strip()
    if not text.startswith("["):
        items: object = text.split(",")
    else:
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{text!r} is not a JSON list ({e})") from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ValueError(f"{text!r} is not a list of strings")
    return tuple(item.strip() for item in items if item.strip())


def parse_lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` value as vLLM takes it: `name=path`, or JSON
    `{"name": ..., "path": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{text!r} is not JSON ({e})") from None
        if not isinstance(item, dict):
            raise ValueError(f"a LoRA module's JSON must be an object, got {text!r}")
        name, path = item.get("name"), item.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise ValueError(f'a LoRA module is NAME=PATH or {{"name": ..., "path": ...}}: {text!r}')
    return name.strip(), path.strip()


# --engine-spare: a core loaded ahead, one that has only imported, by device, or none
ENGINE_SPARES = ("auto", "loaded", "imported", "none")


@dataclass(frozen=True)
class ServerOptions:
    """The server's own flags (the engine's are EngineArgs)."""

    api_key: str | None = _flag(
        None, "require `Authorization: Bearer KEY` on /v1, /tokenize and /detokenize"
    )
    max_request_body_bytes: int = _flag(4 << 20, "larger request bodies are refused with 413")
    max_waiting_requests: int = _flag(
        2048, "engine requests (n x prompts) queued beyond --max-num-seqs; more: 429"
    )
    restart_engine: bool = _flag(
        False, "start a new engine core when it dies (default: the server exits with status 1)"
    )
    max_engine_restarts: int = _flag(
        3, "engine restarts allowed within a minute before the server exits"
    )
    trust_request_chat_template: bool = _flag(
        False, "render a chat_template sent in a request (in its own sandbox lane); else 400"
    )
    chat_template_timeout: float = _flag(
        3.0, "seconds a chat template's render may take; longer: the render is killed, 400"
    )
    chat_template_max_memory_mb: int = _flag(
        256, "memory (MB) a chat template's render may take; more: the render is killed, 400"
    )
    chat_template_max_output_chars: int | None = _flag(
        None, "characters a rendered chat may have; more: 400 (default: 32 x max_model_len)"
    )
    structured_outputs_check_timeout: float = _flag(
        5.0,
        "seconds a request's output constraint (schema, regex, grammar) may take to check and "
        "compile, in a sandbox process; longer: the check is killed, 400",
    )
    structured_outputs_check_max_memory_mb: int = _flag(
        512, "memory (MB) an output constraint's check may take; more: it is killed, 400"
    )
    structured_outputs_check_queue: int = _flag(
        64, "output constraints that may wait for their check; more: 429"
    )
    chat_template_workers: int = _flag(
        2,
        "sandbox processes rendering chat templates, for the server's template and (with "
        "--trust-request-chat-template) as many for requests' templates",
    )
    engine_spare: str = _flag(
        "auto",
        "with --restart-engine, a spare engine core kept for a fast restart: loaded (the model "
        "too: a second core's memory), imported (torch only), none; auto: loaded on the CPU, "
        "imported on GPUs",
        choices=ENGINE_SPARES,
    )
    allowed_origins: tuple[str, ...] = _flag(
        (),
        "CORS: the origins whose web pages may call this server, a JSON list or comma-separated "
        "(* for any). Default: none, and no CORS headers at all (vLLM's default is *)",
        parse=parse_list,
    )
    allowed_methods: tuple[str, ...] = _flag(
        ("*",),
        "CORS (with --allowed-origins): the methods allowed, a list as above",
        parse=parse_list,
    )
    allowed_headers: tuple[str, ...] = _flag(
        ("*",),
        "CORS (with --allowed-origins): the request headers allowed, a list as above",
        parse=parse_list,
    )
    allow_credentials: bool = _flag(
        False, "CORS (with --allowed-origins): allow requests with cookies or HTTP authentication"
    )
    responses_store_max: int = _flag(
        1000,
        "finished /v1/responses kept in memory for previous_response_id and GET "
        "/v1/responses/{id}, the oldest dropped first; 0: none",
    )
    lora_modules: tuple[tuple[str, str], ...] = _flag(
        (),
        "LoRA adapters served from the start (with --enable-lora): NAME=PATH ... (or JSON "
        '{"name": ..., "path": ...}); a request\'s `model` names one',
        parse=parse_lora_module,
        nargs="+",
    )
    responses_store_ttl: float = _flag(
        3600.0, "seconds a finished /v1/responses response is kept for previous_response_id"
    )

    def __post_init__(self) -> None:
        self._normalize_lists()
        modules = tuple(
            parse_lora_module(m) if isinstance(m, str) else tuple(m) for m in self.lora_modules
        )
        object.__setattr__(self, "lora_modules", modules)
        if self.engine_spare not in ENGINE_SPARES:
            raise ValueError(f"engine_spare must be one of {ENGINE_SPARES}: {self.engine_spare!r}")
        for name in ("max_request_body_bytes", "max_waiting_requests", "max_engine_restarts",
                     "responses_store_max"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        for name in ("chat_template_timeout", "chat_template_max_memory_mb",
                     "chat_template_max_output_chars", "chat_template_workers",
                     "structured_outputs_check_timeout",
                     "structured_outputs_check_max_memory_mb", "responses_store_ttl"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def _normalize_lists(self) -> None:
        """The CORS lists as tuples of strings (given in code as a list or a flag's text);
        methods in capitals, as browsers send them."""
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            value = parse_list(value) if isinstance(value, str) else tuple(value)
            if not all(isinstance(item, str) for item in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
            if name == "allowed_methods":
                value = tuple(method.upper() for method in value)
            object.__setattr__(self, name, value)
