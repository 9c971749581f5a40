"""Engine configuration as plain data: `EngineConfig` and its parts (model, cache, scheduler,
parallel, structured-output limits, speculative decoding), each a small frozen dataclass checked in
`__post_init__`; `to_wire()` / `from_wire()` carry it to the EngineCore process.

`EngineArgs` (what a user passes) and its resolution into these are in
`pagellm/engine/arg_utils.py`; this module imports nothing of the engine above it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from pagellm.config.lora import LoRAConfig
from pagellm.config.speculative import SpeculativeConfig
from pagellm.kv_cache_dtype import check_kv_cache_dtype
from pagellm.kv_cache_size import latent_kv_dim

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 2 * _GiB
# each reasoning parser's tags around the thinking (`reasoning_parser`): the caller tokenizes
# them for `thinking_token_budget`; the server's parsers split a reply's text at them
REASONING_TAGS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
    "openai_gptoss": ("<|channel|>analysis<|message|>", "<|end|>"),  # gpt-oss's harmony
}


class HFConfigView(SimpleNamespace):
    """An HF config's attributes (its `to_dict()`) without transformers: the EngineCore
    process builds its model from this, so it never imports transformers (whose config
    classes pull in torchvision, torch._dynamo and sklearn on some machines: seconds); a
    GGUF file's config is built as one too (`pagellm/loader/gguf_loader.py`)."""

    def to_json_string(self, use_diff: bool = False) -> str:
        """As the HF config's (the EngineCore process sends its config on to its workers)."""
        return json.dumps(vars(self))


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer come from (`pagellm/loader/source.py`)."""

    name: str  # what the user named (the default's file name when they named nothing)
    kind: str  # "hf" | "gguf" | "dummy"
    path: str  # HF folder, the .gguf file, or (dummy) the folder holding config.json / a .gguf
    tokenizer: str | None = None  # a tokenizer folder overriding the model's own
    load_format: str = "auto"  # hf: "safetensors" or "pt" restrict the weight files read


POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """A pooling model's pooling (`runner="pooling"`): read from its sentence-transformers
    files as vLLM reads them (`pagellm/loader/pooler_config.py`), else vLLM's defaults."""

    task: str = "embed"  # "embed" | "classify" (a *ForSequenceClassification head)
    pooling_type: str = "LAST"  # LAST | MEAN | CLS: which hidden states make the vector
    normalize: bool = True  # embeddings L2-normalized by default (a Normalize module)
    matryoshka: bool = False  # `dimensions` may cut its embeddings
    matryoshka_dimensions: list[int] | None = None  # the ones it was trained for (None: any)
    num_labels: int = 0  # a classifier's outputs
    encoder: bool = False  # attends both ways, no KV cache, each prompt in one step
    # sentence-transformers' Transformer module: inputs truncated to max_seq_length tokens,
    # lowercased first with do_lower_case
    max_seq_length: int | None = None
    lowercase: bool = False
    # config_sentence_transformers.json: the default prompt's text (default_prompt_name's),
    # put before every text input; truncate_dim: embeddings cut to it after normalizing
    # (sentence-transformers' order), where a request asks no `dimensions`
    default_prompt: str = ""
    truncate_dim: int | None = None
    # sentence-transformers Dense modules after pooling, in order: (folder, activation:
    # identity, tanh, relu, sigmoid, gelu, silu); `embedding_size` their last out_features
    dense: tuple[tuple[str, str], ...] = ()
    embedding_size: int | None = None
    # a cross-encoder's activation as its config names it (ST's activation_fn): "sigmoid",
    # "softmax" or "identity"; None: softmax (sigmoid for one label)
    activation: str | None = None
    # classify's activation from HF's problem_type, as vLLM's get_classification_act_fn and
    # HF's text-classification pipeline: "identity" (regression), "sigmoid"
    # (multi_label_classification); None: `activation`
    classify_activation: str | None = None

    def st_text(self, text: str) -> str:
        """A text input as sentence-transformers reads it (after the default prompt;
        do_lower_case: lowercased)."""
        text = self.default_prompt + text
        return text.lower() if self.lowercase else text

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if self.task not in ("embed", "classify"):
            raise ValueError(f"a pooling model's task is embed or classify, got {self.task!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user named (a path, a shipped config name or the default's file)
    source: ModelSource  # where weights and tokenizer come from
    hf_config: PretrainedConfig | HFConfigView  # the view in the EngineCore process
    dtype: torch.dtype
    max_model_len: int
    served_model_name: str
    # max_model_len="auto": the EngineCore lowers max_model_len to what its KV cache holds
    max_model_len_auto: bool = False
    seed: int = 0
    max_logprobs: int = 20
    # from generation_config.json (pagellm/loader/generation_config.py)
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    quantization: str | None = None  # resolved: a pagellm.quantization method name, or None
    # a longrope model's original_max_position_embeddings: a request of more tokens is rotated
    # with the long factors throughout (pagellm/layers/rope.py); else None
    long_rope_switch: int | None = None
    runner: str = "generate"  # "generate" | "pooling" (embedding and classification models)
    pooler_config: PoolerConfig | None = None  # with runner "pooling"

    @property
    def architecture(self) -> str:
        return architecture_of(self.hf_config)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the cache (latent attention: 1, its one row a token)."""
        cfg = self.hf_config
        if latent_kv_dim(cfg) is not None:
            return 1
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Width of a cache row (latent attention: kv_lora_rank + qk_rope_head_dim)."""
        cfg = self.hf_config
        latent = latent_kv_dim(cfg)
        if latent is not None:
            return latent
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def kv_parts(self) -> int:
        """Tensors a layer's cache stacks: 2 (K and V), or 1 (latent attention's rows)."""
        return 1 if latent_kv_dim(self.hf_config) is not None else 2

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


def architecture_of(hf_config: PretrainedConfig | HFConfigView) -> str:
    return (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]


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
    # False (an encoder): a prompt is admitted only when all of it fits the step's budget
    enable_chunked_prefill: bool = True

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
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    draft_model_config: ModelConfig | None = None  # speculative method draft_model: the draft
    lora_config: LoRAConfig | None = None  # None: no LoRA adapters (enable_lora off)

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """This config with a settled max_model_len (what max_model_len="auto" became)."""
        mc, sc = self.model_config, self.scheduler_config
        return dataclasses.replace(
            self,
            model_config=dataclasses.replace(
                mc, max_model_len=max_model_len, max_model_len_auto=False
            ),
            scheduler_config=dataclasses.replace(sc, max_model_len=max_model_len),
        )

    def to_wire(self) -> dict[str, Any]:
        """Plain data for the EngineCore process (msgpack): the HF configs as their dicts."""
        draft = self.draft_model_config
        wire = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        wire.update(
            model_config=_model_to_wire(self.model_config),
            draft_model_config=None if draft is None else _model_to_wire(draft),
            cache_config=dataclasses.asdict(self.cache_config),
            scheduler_config=dataclasses.asdict(self.scheduler_config),
            parallel_config=dataclasses.asdict(self.parallel_config),
            structured_outputs_config=dataclasses.asdict(self.structured_outputs_config),
            speculative_config=(
                None
                if self.speculative_config is None
                else dataclasses.asdict(self.speculative_config)
            ),
            lora_config=None if self.lora_config is None else dataclasses.asdict(self.lora_config),
        )
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> EngineConfig:
        draft = wire.get("draft_model_config")
        return cls(
            **{
                **wire,
                "model_config": _model_from_wire(wire["model_config"]),
                "draft_model_config": None if draft is None else _model_from_wire(draft),
                "cache_config": CacheConfig(**wire["cache_config"]),
                "scheduler_config": SchedulerConfig(**wire["scheduler_config"]),
                "parallel_config": ParallelConfig(**wire["parallel_config"]),
                "structured_outputs_config": StructuredOutputsConfig(
                    **wire["structured_outputs_config"]
                ),
                "speculative_config": SpeculativeConfig.of(wire.get("speculative_config")),
                "lora_config": _lora_from_wire(wire.get("lora_config")),
            }
        )


def _lora_from_wire(wire: dict[str, Any] | None) -> LoRAConfig | None:
    return None if wire is None else LoRAConfig(**wire)


def _model_to_wire(mc: ModelConfig) -> dict[str, Any]:
    model = {f.name: getattr(mc, f.name) for f in dataclasses.fields(mc)}
    model.update(
        source=dataclasses.asdict(mc.source),
        hf_config=json.loads(mc.hf_config.to_json_string(use_diff=False)),
        dtype=str(mc.dtype).removeprefix("torch."),
        pooler_config=None if mc.pooler_config is None else dataclasses.asdict(mc.pooler_config),
    )
    return model


def _model_from_wire(wire: dict[str, Any]) -> ModelConfig:
    model = dict(wire)
    model.update(
        source=ModelSource(**model["source"]),
        hf_config=HFConfigView(**model["hf_config"]),
        dtype=getattr(torch, model["dtype"]),
    )
    if model.get("pooler_config") is not None:
        model["pooler_config"] = PoolerConfig(**model["pooler_config"])
    return ModelConfig(**model)
