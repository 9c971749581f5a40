"""ServerOptions: the flags of `pagellm serve` that are the server's own (the engine's are
EngineArgs). A module of its own, so the CLI builds its parser without importing FastAPI."""

from __future__ import annotations

from dataclasses import dataclass

# --engine-spare: a core loaded ahead, one that has only imported, by device, or none
ENGINE_SPARES = ("auto", "loaded", "imported", "none")


@dataclass(frozen=True)
class ServerOptions:
    """The server's own flags (the engine's are EngineArgs)."""

    api_key: str | None = None
    max_request_body_bytes: int = 4 << 20
    max_waiting_requests: int = 2048  # engine requests queued beyond max_num_seqs (n x prompts)
    restart_engine: bool = False
    max_engine_restarts: int = 3  # per minute; more, and the server exits
    engine_spare: str = "auto"  # with restart_engine (pagellm/engine/spare_core.py)

    def __post_init__(self) -> None:
        if self.engine_spare not in ENGINE_SPARES:
            raise ValueError(f"engine_spare must be one of {ENGINE_SPARES}: {self.engine_spare!r}")
        for name in ("max_request_body_bytes", "max_waiting_requests", "max_engine_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
