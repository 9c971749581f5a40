"""The server's check of a request's output constraint (a JSON schema, regex, grammar), in a
sandbox lane: the whole check, the compile against the model's vocabulary included, runs in a
worker process with a time and a memory limit (`pagellm/sandbox.py`), so a constraint that
would compile for minutes or grow without bound costs a worker, not the server: past a limit
it is a 400 and the worker is killed; a client that leaves kills its check. The limits the
text itself shows (`structured_output/limits.py`: size, nesting, counted repetitions, $refs)
are checked here first, without a worker. What passes is remembered; the EngineCore compiles
it again (within `compile_timeout_s`).

The lane's single worker imports xgrammar (and with it torch: ~260 MB) and loads the
vocabulary tables once; it starts with the first constrained request, or with the server
where the EngineCore warms its grammar backend too (CUDA; `PAGELLM_WARM_GRAMMAR_BACKEND`).
The server writes those tables (xgrammar's `TokenizerInfo`) to a temporary file for it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import tempfile
from typing import Any

from pagellm.config import ModelConfig, StructuredOutputsConfig
from pagellm.entrypoints.openai.errors import APIError, too_busy, unavailable
from pagellm.entrypoints.openai.server_options import ServerOptions
from pagellm.sandbox import Lane, SandboxBusy, SandboxError, SandboxLimitError
from pagellm.sandbox_worker import LaneSpec
from pagellm.structured_output.limits import check_limits

LANE = "structured_outputs"
_VALIDATE = "pagellm.structured_output.validator:validate"
_REMEMBERED = 1024  # constraints that passed, kept
_NICE = 10  # a tenth of a core's time where the server wants the CPU


class ConstraintChecks:
    def __init__(
        self,
        tokenizer: Any,
        model_config: ModelConfig,
        limits: StructuredOutputsConfig,
        options: ServerOptions,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.config = limits
        self.limits = dataclasses.asdict(limits)
        self.options = options
        self.passed: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self.lane: Lane | None = None
        self._starting: asyncio.Task | None = None
        self._folder: tempfile.TemporaryDirectory | None = None
        self._vocabulary_file: str | None = None

    async def check(self, key: tuple[str, str]) -> None:
        """An APIError (400) naming what is wrong with the constraint or the limit it passed;
        429 while the lane's queue is full."""
        if key in self.passed:
            self.passed.move_to_end(key)
            return
        try:  # the limits its text shows, here (pure Python, linear): no worker needed
            await asyncio.to_thread(check_limits, key, self.config)
            lane = await self._started()
            await lane.call(_VALIDATE, list(key), self.limits, self._vocabulary_file)
        except ValueError as e:  # the validator's own words
            raise APIError(str(e), 400, "structured_outputs") from None
        except SandboxLimitError as e:
            raise APIError(self._past_limit(e.limit), 400, "structured_outputs") from None
        except SandboxBusy:
            raise too_busy("too many output constraints wait to be checked; retry later") from None
        except SandboxError:
            message = "the output constraint's check ended its sandbox process"
            raise APIError(message, 400, "structured_outputs") from None
        self.passed[key] = None
        if len(self.passed) > _REMEMBERED:
            self.passed.popitem(last=False)

    def warm_up(self) -> None:
        """Start the lane now, in the background (the first constrained request waits for
        what is left of its start)."""
        if self._starting is None:
            self._starting = asyncio.create_task(self._start())

    async def _started(self) -> Lane:
        self.warm_up()
        try:
            await asyncio.shield(self._starting)  # a caller that leaves does not stop the start
        except (OSError, RuntimeError, ImportError) as e:
            raise unavailable(f"structured outputs are unavailable: {e}") from None
        return self.lane

    async def _start(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="pagellm-vocab-")
        self._vocabulary_file = os.path.join(self._folder.name, "vocabulary.json")
        await asyncio.to_thread(self._write_vocabulary)
        options = self.options
        self.lane = Lane(
            LaneSpec(
                LANE,
                workers=1,
                max_queued=options.structured_outputs_check_queue,
                timeout_s=options.structured_outputs_check_timeout,
                memory_limit_mb=options.structured_outputs_check_max_memory_mb,
                nice=_NICE,
                initializer="pagellm.structured_output.validator:init_worker",
                initializer_args=(self._vocabulary_file,),
            )
        )
        await self.lane.start()

    def _write_vocabulary(self) -> None:
        from pagellm.structured_output.validator import write_vocabulary

        write_vocabulary(self.tokenizer, self.model_config, self._vocabulary_file)

    def _past_limit(self, limit: str) -> str:
        options = self.options
        if limit == "time":
            return (
                "structured_outputs: checking the output constraint took more than "
                f"{options.structured_outputs_check_timeout:g} s "
                "(--structured-outputs-check-timeout)"
            )
        return (
            "structured_outputs: checking the output constraint took more than "
            f"{options.structured_outputs_check_max_memory_mb} MB of memory "
            "(--structured-outputs-check-max-memory-mb)"
        )

    async def close(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
        if self.lane is not None:
            await self.lane.close()
        if self._folder is not None:
            self._folder.cleanup()
