"""RayDistributedExecutor: one Ray actor per tensor-parallel rank, on one machine or many.

The EngineCore process joins the Ray cluster the caller is connected to (or RAY_ADDRESS's,
or starts a local one), reserves a placement group of one bundle per rank (`{"GPU": 1}`, or
`{"CPU": 1}` for CPU ranks; packed onto as few machines as possible) and starts a
`RayWorkerWrapper` actor in each. The ranks form their process group at a TCPStore this
process hosts on its node's address. On GPUs, the actors of one machine all see that
machine's GPUs given to them (NCCL's peer-to-peer paths need them), each using its own.

Each step is put in Ray's object store once and passed to every actor's `execute_method`
(actor calls run in the order sent); rank 0's answer is the step's output. A waiting call
notices a dead actor (RayActorError) within _POLL_S; an idle EngineCore notices it at the
next step. Actors share the EngineCore process's fate: they are killed when it exits.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from typing import Any

import msgspec
import torch

from pagellm.config import EngineConfig
from pagellm.executor.abstract import DistributedExecutor

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a waiting executor checks the other ranks for a death
_PLACEMENT_TIMEOUT_S = 120  # for the cluster to find the bundles
# environment the actors take from this process (Ray starts them with the raylet's)
_ENV_PREFIXES = ("PAGELLM_", "NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_")


class RayWorkerWrapper:
    """The actor: builds one rank's Worker when told its rank, then runs its messages."""

    def __init__(self) -> None:
        self.worker = None

    def node_and_gpu_ids(self) -> tuple[str, list[str]]:
        import ray

        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def init_worker(
        self, wire: dict, rank: int, local_rank: int, devices: str | None, store: tuple
    ) -> None:
        from pagellm.worker.worker import Worker

        if devices is not None:  # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
        logging.basicConfig(
            level=os.environ.get("PAGELLM_LOGGING_LEVEL", "INFO").upper(),
            format=f"%(levelname)s %(asctime)s rank{rank} %(name)s: %(message)s",
        )
        self.worker = Worker(EngineConfig.from_wire(wire), rank, local_rank, tuple(store))

    def execute_method(self, method: str, payload: bytes) -> bytes | None:
        return self.worker.handle(method, payload)


class RayDistributedExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        import ray

        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.tensor_parallel_size
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:  # None: RAY_ADDRESS, else a local instance of our own
            ray.init(address=pc.ray_address, logging_level=logging.WARNING)
        self.workers: list = []
        self.placement_group = None
        try:
            self._start_workers(config)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, config: EngineConfig) -> None:
        import ray
        import torch.distributed as dist
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cuda = torch.device(config.device).type == "cuda"
        bundle = {"GPU": 1} if cuda else {"CPU": 1}
        self.placement_group = placement_group([bundle] * self.world_size, strategy="PACK")
        ready = self.placement_group.ready()
        if not ray.wait([ready], timeout=_PLACEMENT_TIMEOUT_S)[0]:
            raise ValueError(
                f"the Ray cluster cannot place {self.world_size} ranks of {bundle} within "
                f"{_PLACEMENT_TIMEOUT_S} s; it has {ray.cluster_resources()}"
            )
        actor = ray.remote(num_gpus=1 if cuda else 0, num_cpus=0 if cuda else 1)(RayWorkerWrapper)
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, rank)
            options = {"scheduling_strategy": strategy, "runtime_env": {"env_vars": env}}
            self.workers.append(actor.options(**options).remote())
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, None, True, wait_for_workers=False)
        wire, store = config.to_wire(), (host, self.store.port)
        calls = [
            worker.init_worker.remote(wire, rank, local_rank, devices, store)
            for rank, (worker, (local_rank, devices)) in enumerate(
                zip(self.workers, self._devices(cuda))
            )
        ]
        self._wait_all(calls)
        logger.info("%d tensor-parallel Ray actors ready", self.world_size)

    def _devices(self, cuda: bool) -> list[tuple[int, str | None]]:
        """(local rank, CUDA_VISIBLE_DEVICES) per rank: on GPUs, every GPU of the rank's node
        that went to one of our actors, and the rank's own among them."""
        if not cuda:
            return [(0, None)] * self.world_size
        import ray

        ids = ray.get([w.node_and_gpu_ids.remote() for w in self.workers])
        on_node: dict[str, list[str]] = defaultdict(list)
        for node, gpus in ids:
            on_node[node] += gpus
        devices = []
        for node, gpus in ids:
            visible = sorted(on_node[node], key=int)
            devices.append((visible.index(gpus[0]), ",".join(visible)))
        return devices

    # ---- messages -----------------------------------------------------------------------

    def _send(self, method: str, payload: bytes) -> _RayAnswer:
        import ray

        payload_ref = ray.put(payload)  # one copy in the object store for every rank
        return _RayAnswer([w.execute_method.remote(method, payload_ref) for w in self.workers])

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        payload = msgspec.msgpack.encode((0, method, list(args)))
        answers = self._wait_all(self._send("rpc", payload).refs)
        results = []
        for rank, answer in enumerate(answers):
            _, ok, result = msgspec.msgpack.decode(answer)
            if not ok:
                raise RuntimeError(f"{method} failed on tensor-parallel rank {rank}: {result}")
            results.append(result)
        return results

    def _wait_all(self, refs: list) -> list:
        answer = _RayAnswer(refs)
        answer.get()  # rank 0's, watching the others
        return [answer.fetch(ref) for ref in refs]

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False


class _RayAnswer:
    """The actors' answers to one message; `get()` is rank 0's, raising if any rank died."""

    __slots__ = ("refs",)

    def __init__(self, refs: list) -> None:
        self.refs = refs

    def get(self) -> bytes:
        import ray

        first, others = self.refs[0], self.refs[1:]
        while not ray.wait([first], timeout=_POLL_S)[0] and others:
            done, _ = ray.wait(others, num_returns=len(others), timeout=0)
            for ref in done:
                self.fetch(ref)  # raises if that rank died or failed
        return self.fetch(first)

    @staticmethod
    def fetch(ref) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"a tensor-parallel Ray actor failed: {e}") from None
