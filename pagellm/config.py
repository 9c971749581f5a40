"""Engine configuration: EngineArgs (what a user passes) and the small configs derived from it.

`LLM(**kwargs)` and the CLI both build an `EngineArgs`; `create_engine_config()` resolves the
model (embedded default, HF folder, GGUF file or a shipped config for dummy weights) and
returns an `EngineConfig`, the one object handed to the engine core.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagellm.kv_cache_dtype import check_kv_cache_dtype
from pagellm.loader.hf_config import HFConfigView
from pagellm.quantization import resolve_quantization
from pagellm.utils import cpu_bf16_units

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
logger = logging.getLogger(__name__)
_GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 2 * _GiB


@dataclass
class EngineArgs:
    """vLLM's engine arguments, by the same names. Unknown names raise TypeError."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None
    revision: str | None = None  # of a Hub model: branch, tag or commit
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # the Hugging Face cache to use (default: HF_HOME's)
    generation_config: str = "auto"  # auto | vllm | a folder with generation_config.json
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # auto | safetensors | pt | gguf | dummy
    kv_cache_memory_bytes: int | None = None  # KV cache size; CPU default 2 GiB
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3 | fp8_e5m2
    calculate_kv_scales: bool = False  # fp8 KV: k/v scales from the first batch
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: on for CUDA, off for the CPU
    device: str = "auto"  # auto | cpu | cuda
    tensor_parallel_size: int = 1  # ranks the model is split over (GPUs, or CPU processes)
    distributed_executor_backend: str | None = None  # uni | mp | ray; None: see ParallelConfig
    served_model_name: str | None = None
    disable_log_stats: bool = False
    log_stats_interval: float = 10.0  # seconds between two stats lines in the log
    trace: str | None = None  # write a request-journey trace here (pagellm/tracing.py)
    trace_kv: str | None = None  # with trace: dump this request's block table, slot mapping
    max_logprobs: int = 20  # the most `logprobs` / `prompt_logprobs` a request may ask for
    scheduling_policy: str = "fcfs"  # fcfs | priority: waiting requests by (priority, arrival)
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: constraints start after </think>
    quantization: str | None = None  # fp8 | gguf | int4 | int8 | none (pagellm.quantization)
    # vLLM's name: the limits on output constraints, StructuredOutputsConfig's fields by name
    structured_outputs_config: dict[str, Any] | StructuredOutputsConfig | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(f"unexpected engine argument(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        device = resolve_device(self.device)
        if device.type == "cuda" and self.block_size < 16:
            raise ValueError(
                f"block_size must be at least 16 on CUDA (the Triton kernels' smallest page), "
                f"got {self.block_size}"
            )
        if self.reasoning_parser not in (None, "qwen3", "deepseek_r1"):
            raise ValueError(
                f"reasoning_parser must be 'qwen3' or 'deepseek_r1', got {self.reasoning_parser!r}"
            )
        # checked before the model is resolved (a download, a file read)
        cache_config = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
        )
        structured_outputs_config = StructuredOutputsConfig.of(self.structured_outputs_config)
        model_config = ModelConfig.from_args(self, device)
        max_len = model_config.max_model_len
        batched = self.max_num_batched_tokens or (2048 if device.type == "cpu" else 8192)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_len,
            policy=self.scheduling_policy,
        )
        parallel_config = ParallelConfig.from_args(self, model_config, device)
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=parallel_config,
            device=str(device),
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            async_scheduling=(
                device.type == "cuda" if self.async_scheduling is None else self.async_scheduling
            ),
            log_stats=not self.disable_log_stats,
            log_stats_interval=self.log_stats_interval,
            trace=self.trace,
            trace_kv=self.trace_kv,
            reasoning_parser=self.reasoning_parser,
            structured_outputs_config=structured_outputs_config,
        )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    return torch.device(name)


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user named (a path, a shipped config name or the default's file)
    source: Any  # pagellm.loader.ModelSource: where weights and tokenizer come from
    hf_config: PretrainedConfig | HFConfigView  # the view in the EngineCore process
    dtype: torch.dtype
    max_model_len: int
    served_model_name: str
    seed: int = 0
    max_logprobs: int = 20
    # from generation_config.json (pagellm/loader/generation_config.py)
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    quantization: str | None = None  # resolved: a pagellm.quantization method name, or None

    @classmethod
    def from_args(cls, args: EngineArgs, device: torch.device) -> ModelConfig:
        from pagellm import loader
        from pagellm.models.registry import check_architecture

        source = loader.resolve_model_source(
            args.model,
            args.load_format,
            args.tokenizer,
            revision=args.revision,
            download_dir=args.download_dir,
            tokenizer_revision=args.tokenizer_revision,
        )
        hf_config = loader.load_hf_config(source)
        check_architecture(_architecture(hf_config))
        generation = loader.load_generation_config(source, hf_config, args.generation_config)
        max_len = _resolve_max_model_len(hf_config, args.max_model_len)
        dtype = _resolve_dtype(args.dtype, hf_config, device)
        quantization = resolve_quantization(
            args.quantization, hf_config, source.kind, device, args.tensor_parallel_size
        )
        return cls(
            model=source.name,
            source=source,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_len,
            served_model_name=args.served_model_name or source.name,
            seed=args.seed,
            max_logprobs=args.max_logprobs,
            default_sampling_params=generation.sampling,
            eos_token_ids=generation.eos_token_ids,
            quantization=quantization,
        )

    @property
    def architecture(self) -> str:
        return _architecture(self.hf_config)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def long_rope_switch(self) -> int | None:
        """A longrope model's original_max_position_embeddings: a request of more tokens is
        rotated with the long factors throughout (pagellm/models/rope.py); else None."""
        from pagellm.models.rope import long_rope

        rope = long_rope(self.hf_config)
        return None if rope is None else rope[0]


def _architecture(hf_config: PretrainedConfig | HFConfigView) -> str:
    return (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]


def _resolve_max_model_len(hf_config: PretrainedConfig, requested: int | None) -> int:
    from pagellm.models.rope import max_positions

    limit = max_positions(hf_config)
    if requested is None:
        return limit
    if requested < 1 or requested > limit:
        raise ValueError(
            f"max_model_len={requested} must be in [1, {limit}] "
            "(the model's max_position_embeddings, times a yarn or dynamic rope factor)"
        )
    return requested


def _resolve_dtype(name: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {name!r}")
        return _DTYPES[name]
    if device.type == "cpu":
        units = cpu_bf16_units()
        if units is None:
            logger.info("dtype auto: float32 (this CPU has neither AMX nor AVX512-BF16)")
            return torch.float32
        logger.info("dtype auto: bfloat16 on this CPU's %s (dtype='float32' for exact)", units)
        return torch.bfloat16
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = _DTYPES.get(cfg_dtype)
    return cfg_dtype if cfg_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cache_dtype: str = "auto"  # kv_cache_dtype (pagellm.kv_cache_dtype)
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.cache_dtype)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (the token budget)
    max_model_len: int = 2048  # prompt + output tokens of one request
    policy: str = "fcfs"  # the waiting queue's order: fcfs | priority

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )


def _limit(default: float, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Limits on output constraints (`pagellm/structured_output/`), checked before xgrammar
    sees a constraint, so that a small hostile one stays cheap; a constraint over one is a
    ValueError (a 400) naming it. Defaults that real schemas do not reach; the measurements
    behind them: docs/structured_outputs.md."""

    max_spec_chars: int = _limit(
        256 << 10, "characters of a regex, grammar, choice list or JSON schema (compact JSON)"
    )
    max_json_depth: int = _limit(64, "nesting of a JSON schema's objects and arrays")
    max_repetition: int = _limit(
        1000,
        "a counted repetition {m,n}'s count times those it is nested in (regex, JSON pattern, "
        "grammar)",
    )
    max_enum_values: int = _limit(4096, "alternatives of one choice: choice list, enum, rule")
    compile_timeout_s: float = _limit(30.0, "seconds a grammar's compile may take in the engine")
    max_matcher_ms: float = _limit(
        50.0,
        "CPU milliseconds the engine may spend following one token of a request's grammar (its "
        "bitmask, its accept: ambiguous grammars grow them without bound); more: it fails",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = int if f.type == "int" else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
                what = "integer" if f.type == "int" else "number"
                raise ValueError(
                    f"structured_outputs_config {f.name} must be a positive {what}, got {value!r}"
                )

    @classmethod
    def of(cls, value: dict[str, Any] | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
        """From EngineArgs.structured_outputs_config: a dict of field names, or the config."""
        if isinstance(value, cls):
            return value
        unknown = set(value or {}) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"structured_outputs_config: unknown field(s) {', '.join(sorted(unknown))}; "
                f"known: {', '.join(f.name for f in dataclasses.fields(cls))}"
            )
        return cls(**(value or {}))

    @staticmethod
    def how_to_raise(name: str) -> str:
        """How a user raises the limit `name`: the LLM argument and the server flag."""
        flag = name.replace("_", "-")
        return (
            f"raise it with LLM(structured_outputs_config={{'{name}': N}}) or "
            f"pagellm serve --structured-outputs-config.{flag} N"
        )


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split and where its ranks run (`pagellm/executor/`).

    `distributed_executor_backend`: "uni" runs the one rank inside the EngineCore, "mp" one
    worker process per rank on this machine, "ray" one Ray actor per rank, on a Ray cluster
    (`ray_address`: the one the caller is connected to; None: RAY_ADDRESS, or a local one).
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        tp, backend = self.tensor_parallel_size, self.distributed_executor_backend
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)} "
                f"or None, got {backend!r}"
            )
        if backend == "uni" and tp > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size={tp} "
                "needs 'mp' or 'ray'"
            )

    @classmethod
    def from_args(
        cls, args: EngineArgs, model_config: ModelConfig, device: torch.device
    ) -> ParallelConfig:
        """None picks "uni" for one rank, else "ray" when the caller is connected to a Ray
        cluster or RAY_ADDRESS is set, else "mp"."""
        tp = args.tensor_parallel_size
        address = _ray_address()
        backend = args.distributed_executor_backend
        if backend is None:
            backend = "uni" if tp == 1 else ("ray" if address else "mp")
        config = cls(tp, backend, address if backend == "ray" else None)
        _check_heads(model_config.hf_config, tp)
        if backend == "mp" and device.type == "cuda" and torch.cuda.device_count() < tp:
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} GPUs on this machine, "
                f"{torch.cuda.device_count()} are visible (across machines: "
                "distributed_executor_backend='ray')"
            )
        return config


def _ray_address() -> str | None:
    """The Ray cluster this process is connected to (never imports ray), or RAY_ADDRESS."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    return os.environ.get("RAY_ADDRESS") or None


def _check_heads(hf_config: Any, tp: int) -> None:
    """A clear error before any process starts when the heads cannot be split over `tp`."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's num_attention_heads ({heads})"
        )
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and the model's num_key_value_heads ({kv_heads}) must "
            "divide one another (KV heads are split, or replicated when fewer than ranks)"
        )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    seed: int = 0
    enforce_eager: bool = False
    async_scheduling: bool = False  # schedule step N+1 while step N runs (pagellm.engine.core)
    log_stats: bool = True
    log_stats_interval: float = 10.0  # seconds between two stats lines (caller side)
    trace: str | None = None  # the journey trace's file (caller side); None: no tracing
    trace_kv: str | None = None  # a request id whose paging the trace dumps
    reasoning_parser: str | None = None  # structured outputs start after the thinking
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )

    def to_wire(self) -> dict[str, Any]:
        """Plain data for the EngineCore process (msgpack): the HF config as its dict."""
        mc = self.model_config
        model = {f.name: getattr(mc, f.name) for f in dataclasses.fields(mc)}
        model.update(
            source=dataclasses.asdict(mc.source),
            hf_config=json.loads(mc.hf_config.to_json_string(use_diff=False)),
            dtype=str(mc.dtype).removeprefix("torch."),
        )
        wire = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        wire.update(
            model_config=model,
            cache_config=dataclasses.asdict(self.cache_config),
            scheduler_config=dataclasses.asdict(self.scheduler_config),
            parallel_config=dataclasses.asdict(self.parallel_config),
            structured_outputs_config=dataclasses.asdict(self.structured_outputs_config),
        )
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> EngineConfig:
        from pagellm.loader.source import ModelSource

        model = dict(wire["model_config"])
        model.update(
            source=ModelSource(**model["source"]),
            hf_config=HFConfigView(**model["hf_config"]),
            dtype=getattr(torch, model["dtype"]),
        )
        return cls(
            **{
                **wire,
                "model_config": ModelConfig(**model),
                "cache_config": CacheConfig(**wire["cache_config"]),
                "scheduler_config": SchedulerConfig(**wire["scheduler_config"]),
                "parallel_config": ParallelConfig(**wire["parallel_config"]),
                "structured_outputs_config": StructuredOutputsConfig(
                    **wire["structured_outputs_config"]
                ),
            }
        )
