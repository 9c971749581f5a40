"""Engine arguments: `EngineArgs` (what a user passes, by vLLM's names) and the resolution
of them into an `EngineConfig` (`pagellm/config/`'s plain dataclasses), as vLLM's
`vllm/engine/arg_utils.py`.

`LLM(**kwargs)` and the CLI both build an `EngineArgs`; `create_engine_config()` resolves the
model (embedded default, HF folder, GGUF file or a shipped config for dummy weights), its
dtype, length, quantization and parallel layout, and returns the `EngineConfig` handed to the
engine core.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagellm import envs
from pagellm.config import (
    REASONING_TAGS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ModelSource,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    architecture_of,
)
from pagellm.config.lora import LORA_ARCHITECTURES, LoRAConfig
from pagellm.engine.draft_config import (
    EAGLE3_HEAD,
    MTP_HEAD,
    check_draft_model,
    eagle3_head_config,
    mtp_head_config,
)
from pagellm.models.registry import is_encoder_architecture
from pagellm.quantization import resolve_quantization, with_dummy_quantization
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
    # None: the model's length; "auto": the longest a request can have in the KV cache, set
    # once the cache is sized (capped by the model's length)
    max_model_len: int | str | None = None
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
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: </think> ends it; openai_gptoss
    quantization: str | None = (
        None  # fp8 | gguf | int4 | int8 | awq | gptq | compressed-tensors | none
    )
    # vLLM's name: the limits on output constraints, StructuredOutputsConfig's fields by name
    structured_outputs_config: dict[str, Any] | StructuredOutputsConfig | None = None
    # vLLM's keys (method, num_speculative_tokens, prompt_lookup_min/max, model, ...), as a
    # dict or its JSON text; None: no speculative decoding (pagellm/spec_decode/)
    speculative_config: dict[str, Any] | str | SpeculativeConfig | None = None
    # auto | generate | pooling (LLM.embed, ...); auto: pooling for a classifier, an
    # LM-head-less checkpoint or sentence-transformers files (loader/pooler_config.py)
    runner: str = "auto"
    hf_overrides: dict[str, Any] | str | None = None  # HF config attributes replaced (or JSON)
    # LoRA adapters (pagellm/lora/): slots for distinct adapters a step, their largest rank,
    # adapters kept on the host (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def _lora_config(self, model_config: Any) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if model_config.runner == "pooling":
            raise ValueError("enable_lora needs a generative model (runner='generate')")
        if model_config.architecture not in LORA_ARCHITECTURES:
            raise ValueError(
                f"enable_lora serves {', '.join(LORA_ARCHITECTURES)} models; "
                f"{model_config.architecture} is not one of them (yet)"
            )
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

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
        self._check_early(device)  # before the model is resolved (a download, a file read)
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
        speculative_config = SpeculativeConfig.of(self.speculative_config)
        model_config = self.create_model_config(device)
        _check_servable(model_config, cache_config)
        draft_model_config = self.create_draft_model_config(
            speculative_config, model_config, device
        )
        max_len = model_config.max_model_len
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.token_budget(device),
            max_model_len=max_len,
            policy=self.scheduling_policy,
        )
        if model_config.runner == "pooling":
            from pagellm.loader.pooler_config import pooling_configs

            cache_config, scheduler_config = pooling_configs(
                model_config, cache_config, scheduler_config, speculative_config
            )
        parallel_config = self._parallel_config(model_config, device)
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=parallel_config,
            device=str(device),
            seed=self.seed,
            enforce_eager=self._enforce_eager(device, speculative_config),
            async_scheduling=(
                device.type == "cuda" if self.async_scheduling is None else self.async_scheduling
            ),
            log_stats=not self.disable_log_stats,
            log_stats_interval=self.log_stats_interval,
            trace=self.trace,
            trace_kv=self.trace_kv,
            reasoning_parser=self.reasoning_parser,
            structured_outputs_config=structured_outputs_config,
            speculative_config=speculative_config,
            lora_config=self._lora_config(model_config),
            draft_model_config=draft_model_config,
        )

    def _check_early(self, device: torch.device) -> None:
        """The arguments that need no model to be checked."""
        if device.type == "cuda" and self.block_size < 16:
            raise ValueError(
                f"block_size must be at least 16 on CUDA (the Triton kernels' smallest page), "
                f"got {self.block_size}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_TAGS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(map(repr, REASONING_TAGS))}, got "
                f"{self.reasoning_parser!r}"
            )

    def token_budget(self, device: torch.device) -> int:
        """max_num_batched_tokens, or its default: 2048 on the CPU, 8192 on CUDA."""
        return self.max_num_batched_tokens or (2048 if device.type == "cpu" else 8192)

    def create_model_config(
        self, device: torch.device, source: ModelSource | None = None
    ) -> ModelConfig:
        """The model's config: its source resolved (unless given: `pagellm plan` resolves
        it without weights), its HF and generation configs read."""
        # imported here: the CLI builds its flags from EngineArgs without them
        from pagellm import loader
        from pagellm.layers.rope import long_rope
        from pagellm.loader.hf_config import with_hf_overrides
        from pagellm.loader.pooler_config import load_pooler_config, resolve_runner
        from pagellm.models.registry import check_architecture

        if source is None:
            source = loader.resolve_model_source(
                self.model,
                self.load_format,
                self.tokenizer,
                revision=self.revision,
                download_dir=self.download_dir,
                tokenizer_revision=self.tokenizer_revision,
            )
        hf_config = with_hf_overrides(loader.load_hf_config(source), self.hf_overrides, source)
        hf_config = with_dummy_quantization(hf_config, self.quantization, source.kind)
        check_architecture(architecture_of(hf_config))
        generation = loader.load_generation_config(source, hf_config, self.generation_config)
        max_len = _resolve_max_model_len(hf_config, self.max_model_len)
        dtype = _resolve_dtype(self.dtype, hf_config, device)
        quantization = resolve_quantization(
            self.quantization, hf_config, source.kind, device, self.tensor_parallel_size
        )
        rope = long_rope(hf_config)
        folder = source.path if source.kind == "hf" else None
        runner = resolve_runner(self.runner, folder, hf_config)
        pooler = load_pooler_config(folder, hf_config) if runner == "pooling" else None
        if pooler is not None and pooler.max_seq_length is not None:
            max_len = _within_st_length(max_len, pooler.max_seq_length, self.max_model_len)
        return ModelConfig(
            model=source.name,
            source=source,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_len,
            max_model_len_auto=self.max_model_len == "auto",
            served_model_name=self.served_model_name or source.name,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            default_sampling_params=generation.sampling,
            eos_token_ids=generation.eos_token_ids,
            quantization=quantization,
            long_rope_switch=None if rope is None else rope[0],
            runner=runner,
            pooler_config=pooler,
        )

    def create_draft_model_config(
        self, spec: SpeculativeConfig | None, target: ModelConfig, device: torch.device
    ) -> ModelConfig | None:
        """speculative_config method draft_model (eagle3): the draft's (head's) config,
        resolved as the target's is (its own folder, tokenizer and quantization; the target's
        dtype, device and seed), checked against the target (`check_draft_model`,
        `eagle3_head_config`); mtp: the target's own MTP head (`mtp_head_config`; another
        folder's if `model` names one); None for other methods."""
        if spec is None or spec.method not in ("draft_model", "eagle3", "mtp"):
            return None
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"speculative_config method {spec.method!r} is served with "
                f"tensor_parallel_size=1 only, got {self.tensor_parallel_size}"
            )
        args = dataclasses.replace(
            self, model=spec.model, tokenizer=None, revision=None, tokenizer_revision=None,
            generation_config="vllm", max_model_len=None, quantization=None,
            served_model_name=None, dtype=str(target.dtype).removeprefix("torch."),
            load_format="dummy" if self.load_format == "dummy" else "auto",
        )  # fmt: skip
        if spec.method == "mtp" and spec.model in (None, self.model):
            return mtp_head_config(target)
        draft = args.create_model_config(device)
        if spec.method == "mtp":
            check_draft_model(target, draft)
            return mtp_head_config(target, draft)
        if spec.method == "eagle3":
            draft = eagle3_head_config(target, draft)
        check_draft_model(target, draft)
        return dataclasses.replace(draft, max_model_len=target.max_model_len)

    def _enforce_eager(self, device: torch.device, speculative_config) -> bool:
        """No CUDA graphs: asked for; an EAGLE-3 head (it reads hidden states that graph
        replays do not keep); LoRA on CUDA with PAGELLM_LORA_CUDA_GRAPHS=0."""
        eagle3 = speculative_config is not None and speculative_config.method == "eagle3"
        lora = self.enable_lora and device.type == "cuda" and not envs.lora_cuda_graphs()
        return self.enforce_eager or eagle3 or lora

    def _parallel_config(self, model_config: ModelConfig, device: torch.device) -> ParallelConfig:
        """None picks "uni" for one rank, else "ray" when the caller is connected to a Ray
        cluster or RAY_ADDRESS is set, else "mp"."""
        tp = self.tensor_parallel_size
        address = _ray_address()
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "uni" if tp == 1 else ("ray" if address else "mp")
        config = ParallelConfig(tp, backend, address if backend == "ray" else None)
        if tp > 1 and is_encoder_architecture(model_config.architecture):
            raise ValueError(
                f"tensor_parallel_size={tp}: {model_config.architecture} is an encoder, which "
                "is not split over ranks (every rank would hold and run the whole model); "
                "use tensor_parallel_size=1"
            )
        check_heads(model_config.hf_config, tp)
        if backend == "mp" and device.type == "cuda" and torch.cuda.device_count() < tp:
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} GPUs on this machine, "
                f"{torch.cuda.device_count()} are visible (across machines: "
                "distributed_executor_backend='ray')"
            )
        return config


def _check_servable(model_config: ModelConfig, cache_config: CacheConfig) -> None:
    """Checkpoints served only through another one, and latent attention's fp8 cache."""
    if model_config.architecture == EAGLE3_HEAD:
        raise ValueError(
            f"{model_config.model!r} is an EAGLE-3 head: serve its target model with "
            "speculative_config={'method': 'eagle3', 'model': <this head>}"
        )
    if model_config.architecture == MTP_HEAD:
        raise ValueError(f"{MTP_HEAD} is an MTP head: serve its checkpoint's own model")
    if model_config.kv_parts == 1 and cache_config.cache_dtype.startswith("fp8"):
        raise ValueError(
            f"kv_cache_dtype={cache_config.cache_dtype!r} is not supported for latent "
            "attention (MLA): its cache holds the model's dtype"
        )


def _within_st_length(max_len: int, st_len: int, asked: int | str | None) -> int:
    """max_model_len bounded by the sentence-transformers max_seq_length the model truncates
    to: a larger length asked for is refused, a derived one cut."""
    if max_len <= st_len:
        return max_len
    if isinstance(asked, int):
        raise ValueError(
            f"max_model_len={max_len} is more than the sentence-transformers max_seq_length "
            f"({st_len}) the model truncates to"
        )
    return st_len


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    return torch.device(name)


def _resolve_max_model_len(hf_config: PretrainedConfig, requested: int | str | None) -> int:
    """The length asked for, checked; the model's for None and "auto" ("auto" comes down to
    what the KV cache holds once it is sized: `pagellm.engine.core.fit_max_model_len`)."""
    from pagellm.layers.rope import max_positions

    limit = max_positions(hf_config)
    if requested is None or requested == "auto":
        return limit
    if isinstance(requested, str) or isinstance(requested, bool):
        raise ValueError(f"max_model_len must be an integer or 'auto', got {requested!r}")
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


def _ray_address() -> str | None:
    """The Ray cluster this process is connected to (never imports ray), or RAY_ADDRESS."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    return os.environ.get("RAY_ADDRESS") or None


def check_heads(hf_config: Any, tp: int) -> None:
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
