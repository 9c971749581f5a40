"""Executors: how the EngineCore runs a step on the model's ranks (see `abstract.py`), and
`executor_class`, the one chosen by `ParallelConfig.distributed_executor_backend`."""

from __future__ import annotations

from pagellm.config import EngineConfig
from pagellm.executor.abstract import Executor

__all__ = ["Executor", "executor_class"]


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor for `config` (imported here: Ray's and the worker processes' modules load
    only for their backend)."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from pagellm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from pagellm.executor.ray_distributed_executor import RayDistributedExecutor

        return RayDistributedExecutor
    from pagellm.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor
