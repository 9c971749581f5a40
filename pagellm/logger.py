"""Logging set-up: the format and level (PAGELLM_LOGGING_LEVEL) of every pagellm log line.

`setup_logging()` configures the root logger (the CLI and the EngineCore process own their
process); `ensure_library_logging()` gives the `pagellm` logger a handler of its own when the
caller's program configured none, so a script's `LLM(...)` shows its log lines as vLLM does.
"""

from __future__ import annotations

import logging

from pagellm import envs

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def setup_logging() -> None:
    logging.basicConfig(level=envs.log_level(), format=_FORMAT)


def ensure_library_logging() -> None:
    package = logging.getLogger("pagellm")
    if package.handlers or logging.getLogger().handlers:
        return  # the program chose where log lines go
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    package.addHandler(handler)
    package.setLevel(envs.log_level())
