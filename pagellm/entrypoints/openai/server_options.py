"""ServerOptions: the flags of `pagellm serve` that are the server's own (the engine's are
EngineArgs); the CLI makes one flag per field, its help from the field's metadata. A module of
its own, so the CLI builds its parser without importing FastAPI."""

from __future__ import annotations

from dataclasses import dataclass, field


def _flag(default: object, help: str, choices: tuple[str, ...] | None = None) -> object:
    return field(default=default, metadata={"help": help, "choices": choices})


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
    responses_store_max: int = _flag(
        1000,
        "finished /v1/responses kept in memory for previous_response_id and GET "
        "/v1/responses/{id}, the oldest dropped first; 0: none",
    )
    responses_store_ttl: float = _flag(
        3600.0, "seconds a finished /v1/responses response is kept for previous_response_id"
    )

    def __post_init__(self) -> None:
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
