"""`pagellm plan`: will a model fit, and with which flags? Predicted from its config alone.

The KV cache is sized as the engine sizes it, with the same functions
(`pagellm/kv_cache_size.py`):

    cuda  budget = gpu_memory_utilization x the card - what torch does not allocate (CUDA
          context, NCCL) - the profiled peak (weights, buffers, persistent sampling state,
          the largest of a full step's forward and its sampling) - a 512 MiB margin (CUDA
          graphs' pool); `profiled_kv_budget` measures what this module estimates
    cpu   budget = kv_cache_memory_bytes (default 2 GiB), whatever the weights take
    both  --kv-cache-memory-bytes replaces the budget, --num-gpu-blocks-override the blocks

then blocks = budget // (one rank's block bytes), and a request of L tokens holds
cdiv(L, block_size) blocks (with every layer windowed, those its window touches). What the
engine measures on a GPU and this module estimates (the forward's and the sampler's peak,
the CUDA context) is checked on a real card by benchmarks/plan_check.py.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch

from pagellm.config import DEFAULT_CPU_KV_CACHE_BYTES
from pagellm.engine.arg_utils import EngineArgs, resolve_device
from pagellm.engine.plan_model import ModelFacts, read_model
from pagellm.kv_cache_size import (
    GPU_MEMORY_MARGIN,
    cdiv,
    gpu_kv_budget,
    kv_capacity_tokens,
    max_concurrent_requests,
    max_request_len,
    num_kv_blocks,
)
from pagellm.utils import physical_memory_bytes
from pagellm.worker.step_batch import profile_step

_GiB = 1 << 30
# estimates of what the profiling pass measures on a GPU (checked by benchmarks/plan_check.py)
# the context, cuBLAS and Triton modules, not torch's: 687 MiB measured on an H100 (torch 2.11,
# CUDA 13, 2026-12-06) by benchmarks/plan_check.py
CUDA_CONTEXT_BYTES = 687 << 20
NCCL_BYTES = 400 << 20  # a rank's NCCL buffers with tensor parallelism
# top-k / top-p sampling over the profile's rows: float32 copies, sort values and int64
# indices, masks, probabilities, noise (pagellm/sample/sampler.py), per logit
SAMPLER_BYTES_PER_LOGIT = 36
PENALTY_BYTES_PER_LOGIT = 5  # the penalty state kept per row: int32 counts, a bool mask
MEMORY_FLAGS = (  # EngineArgs fields that change the plan, repeated in its commands
    "dtype", "quantization", "kv_cache_dtype", "tensor_parallel_size", "block_size",
    "gpu_memory_utilization", "max_num_batched_tokens", "kv_cache_memory_bytes",
    "num_gpu_blocks_override", "enforce_eager", "load_format",
)  # fmt: skip


@dataclass
class PlanRow:
    """A context length and how many requests of that length the cache holds at once."""

    max_model_len: int
    max_num_seqs: int  # concurrent full-length requests (capped by --max-num-seqs); 0: none
    command: str | None  # the flags to serve it; None when not even one fits


@dataclass
class MemoryPlan:
    model: str
    architecture: str
    device: str
    tensor_parallel_size: int
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # one rank's
    head_dim: int
    max_position_embeddings: int  # the model's length (rope-scaled)
    checkpoint_bytes: dict[str, int]  # stored, by dtype ({}: no files read)
    weight_bytes: int  # one rank's, as loaded
    kv_bytes_per_token: int  # one rank's
    kv_block_bytes: int
    windowed_layers: int
    sliding_window: int | None  # every layer windowed: blocks before it are freed
    memory_bytes: int | None  # the GPU's (cuda); None on the CPU
    gpu_memory_utilization: float
    reserved: dict[str, int]  # cuda: what the engine keeps besides weights and KV
    kv_budget_bytes: int
    num_blocks: int  # 0: no room for a KV cache
    kv_tokens: int
    max_model_len_auto: int  # what --max-model-len auto resolves to (0: nothing fits)
    max_num_seqs: int
    rows: list[PlanRow] = field(default_factory=list)
    chosen: PlanRow | None = None
    problems: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    kv_parts: int = 2  # K and V; 1: latent attention's one row a token

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "fits": self.fits}


def plan_device(args: EngineArgs, gpu_memory_gib: float | None) -> torch.device:
    """--device, or (auto) cuda when a GPU is visible or --gpu-memory names one's size."""
    if args.device == "auto" and gpu_memory_gib is not None:
        return torch.device("cuda")
    return resolve_device(args.device)


def gpu_memory_bytes(gpu_memory_gib: float | None) -> int:
    """--gpu-memory in bytes, or the local GPU's total."""
    if gpu_memory_gib is not None:
        if gpu_memory_gib <= 0:
            raise ValueError(f"--gpu-memory must be a positive number of GiB, got {gpu_memory_gib}")
        return int(gpu_memory_gib * _GiB)
    if not torch.cuda.is_available():
        raise ValueError(
            "planning for a GPU needs its memory: pass --gpu-memory GiB (an H100 80GB has "
            "79.2 GiB), or --device cpu; no GPU is visible here"
        )
    return torch.cuda.mem_get_info()[1]


def plan_memory(args: EngineArgs, gpu_memory_gib: float | None = None) -> MemoryPlan:
    """The plan for `args` (the engine's arguments) on --device, a GPU of `gpu_memory_gib`."""
    device = plan_device(args, gpu_memory_gib)
    total = gpu_memory_bytes(gpu_memory_gib) if device.type == "cuda" else None
    facts = read_model(args, device)
    plan = _sized(args, facts, device, total)
    _fill_rows(plan, args, facts)
    _check(plan, args)
    return plan


def _sized(
    args: EngineArgs, facts: ModelFacts, device: torch.device, total: int | None
) -> MemoryPlan:
    mc = facts.config
    block_bytes = facts.kv_block_bytes(args.block_size)
    reserved = gpu_reserved(args, facts) if total is not None else {}
    if args.kv_cache_memory_bytes:
        budget = args.kv_cache_memory_bytes
    elif total is not None:
        peak = sum(v for k, v in reserved.items() if k not in ("not_torch", "margin"))
        budget = gpu_kv_budget(total, args.gpu_memory_utilization, reserved["not_torch"], peak)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    try:
        blocks = args.num_gpu_blocks_override or num_kv_blocks(budget, block_bytes)
    except ValueError:  # fewer than 2 blocks: the engine would refuse to start
        blocks = 0
    return MemoryPlan(
        model=mc.model, architecture=mc.architecture, device=device.type,
        tensor_parallel_size=facts.tensor_parallel_size,
        dtype=_name(mc.dtype), quantization=mc.quantization, kv_cache_dtype=_name(facts.kv_dtype),
        block_size=args.block_size, num_layers=mc.num_layers, num_kv_heads=facts.num_kv_heads,
        head_dim=mc.head_dim, max_position_embeddings=facts.max_positions,
        checkpoint_bytes=facts.checkpoint_bytes, weight_bytes=facts.weight_bytes,
        kv_bytes_per_token=facts.kv_bytes_per_token, kv_block_bytes=block_bytes,
        windowed_layers=facts.windowed_layers, sliding_window=facts.kv_window,
        memory_bytes=total, gpu_memory_utilization=args.gpu_memory_utilization,
        reserved=reserved, kv_budget_bytes=budget, num_blocks=blocks,
        kv_tokens=kv_capacity_tokens(blocks, args.block_size) if blocks else 0,
        max_model_len_auto=0, max_num_seqs=args.max_num_seqs, kv_parts=mc.kv_parts,
    )  # fmt: skip


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gpu_reserved(args: EngineArgs, facts: ModelFacts) -> dict[str, int]:
    """What a GPU keeps besides the KV cache, as `profiled_kv_budget` counts it: memory torch
    does not allocate, and the profiled peak's parts; the margin."""
    mc, hf = facts.config, facts.config.hf_config
    itemsize = mc.dtype.itemsize
    max_len = facts.max_positions if args.max_model_len in (None, "auto") else args.max_model_len
    query_lens, _ = profile_step(
        args.token_budget(torch.device("cuda")), args.max_num_seqs, max_len, args.block_size
    )
    tokens = int(query_lens.sum())
    rows = min(args.max_num_seqs, tokens)
    tp = facts.tensor_parallel_size
    forward = forward_peak_bytes(hf, tokens, tp, itemsize)
    sampling = tokens * hf.hidden_size * itemsize + rows * mc.vocab_size * (
        itemsize + SAMPLER_BYTES_PER_LOGIT
    )
    return {
        "not_torch": CUDA_CONTEXT_BYTES + (NCCL_BYTES if tp > 1 else 0),
        "weights": facts.weight_bytes,
        "buffers": facts.buffer_bytes,
        "persistent": persistent_bytes(args.max_num_seqs, mc.vocab_size, max_len, args.block_size),
        "activations": max(forward, sampling),
        "margin": GPU_MEMORY_MARGIN,
    }


def persistent_bytes(max_num_seqs: int, vocab_size: int, max_len: int, block_size: int) -> int:
    """What the runner keeps on the device from the start: the penalty state (a row a
    request) and the step's block-table buffers (`StepInputs`)."""
    return max_num_seqs * (vocab_size * PENALTY_BYTES_PER_LOGIT + 8 * cdiv(max_len, block_size))


def forward_peak_bytes(hf_config, tokens: int, tp: int, itemsize: int) -> int:
    """The largest a decoder layer's live activations get over a step of `tokens` tokens, one
    rank: the residual stream, its norm and the layer's input (3 x hidden), then the larger
    of attention (q | k | v out, attention out) and the MLP (gate | up out, its activation;
    a MoE layer: each token's top-k experts' and the float32 router logits)."""
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    attention = (2 * heads // tp + 2 * max(1, kv_heads // tp)) * head_dim * itemsize
    mlp = 3 * (getattr(hf_config, "intermediate_size", 0) // tp) * itemsize
    experts = getattr(hf_config, "num_experts", None) or getattr(
        hf_config, "num_local_experts", None
    )
    if experts:
        top_k = hf_config.num_experts_per_tok
        inter = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
        routed = top_k * (3 * inter // tp + h) * itemsize + 4 * experts
        mlp = max(mlp, routed + 3 * shared // tp * itemsize)
    return tokens * (3 * h * itemsize + max(attention, mlp))


def context_lengths(limit: int, *extra: int | None) -> list[int]:
    """The table's rows: powers of two from 2048 below the model's limit, the limit, and the
    `extra` lengths given (--max-model-len N, what auto resolves to)."""
    lengths = {limit} | {n for n in extra if n}
    n = 2048
    while n < limit:
        lengths.add(n)
        n *= 2
    if limit < 2048:
        lengths |= {limit // 4, limit // 2} - {0}
    return sorted(lengths)


def _fill_rows(plan: MemoryPlan, args: EngineArgs, facts: ModelFacts) -> None:
    asked = args.max_model_len if isinstance(args.max_model_len, int) else None
    if plan.num_blocks:
        plan.max_model_len_auto = max_request_len(
            plan.num_blocks, plan.block_size, facts.max_positions, facts.kv_window,
            args.token_budget(torch.device(plan.device)),
        )  # fmt: skip
    for length in context_lengths(facts.max_positions, asked, plan.max_model_len_auto):
        seqs = 0
        if plan.num_blocks and length <= plan.max_model_len_auto:
            at_once = max_concurrent_requests(
                plan.num_blocks, plan.block_size, length, facts.kv_window
            )
            seqs = min(args.max_num_seqs, at_once)
        command = serve_command(args, length, seqs) if seqs else None
        plan.rows.append(PlanRow(length, seqs, command))
    wanted = asked or plan.max_model_len_auto
    fitting = [r for r in plan.rows if r.max_num_seqs and r.max_model_len <= wanted]
    plan.chosen = fitting[-1] if fitting else None


def serve_command(args: EngineArgs, max_model_len: int, max_num_seqs: int) -> str:
    """`pagellm serve MODEL` with the row's length and concurrency and the memory flags the
    plan was made with (those not at their defaults)."""
    parts = ["pagellm serve", args.model or "", f"--max-model-len {max_model_len}"]
    parts.append(f"--max-num-seqs {max_num_seqs}")
    if args.load_format == "auto" and _is_shipped_name(args.model):
        parts.append("--load-format dummy")  # a shipped config has no weights
    defaults = EngineArgs()
    for name in MEMORY_FLAGS:
        value = getattr(args, name)
        if value == getattr(defaults, name):
            continue
        flag = "-tp" if name == "tensor_parallel_size" else "--" + name.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value}")
    if args.device != "auto":
        parts.append(f"--device {args.device}")
    return " ".join(p for p in parts if p)


def _is_shipped_name(model: str | None) -> bool:
    from pagellm.loader.source import shipped_config_dir

    return (
        bool(model)
        and "/" not in model
        and not os.path.exists(model)
        and bool(shipped_config_dir(model))
    )


def _check(plan: MemoryPlan, args: EngineArgs) -> None:
    """What does not fit, and by how much."""
    if plan.memory_bytes is not None:
        _check_gpu(plan, args)
    if not plan.num_blocks and not plan.problems:
        plan.problems.append(
            f"a KV cache of {plan.kv_budget_bytes} bytes holds fewer than 2 blocks of "
            f"{plan.kv_block_bytes} bytes: raise --kv-cache-memory-bytes"
        )
    asked = args.max_model_len if isinstance(args.max_model_len, int) else None
    if plan.num_blocks and asked and asked > plan.max_model_len_auto:
        plan.problems.append(
            f"--max-model-len {asked} does not fit one request: the KV cache holds "
            f"{plan.kv_tokens} tokens (--max-model-len auto: {plan.max_model_len_auto})"
        )
    if plan.device == "cpu":
        _check_ram(plan)


def _check_gpu(plan: MemoryPlan, args: EngineArgs) -> None:
    """The model alone too big for gpu_memory_utilization of the card; or (a KV cache of a
    set size) the whole too big for the card: then no row is chosen."""
    others, count = sum(plan.reserved.values()), len(plan.problems)
    _check_gpu_memory(plan, args, others)
    if len(plan.problems) > count:
        plan.chosen = None  # no row can be served


def _check_gpu_memory(plan: MemoryPlan, args: EngineArgs, others: int) -> None:
    if args.num_gpu_blocks_override or args.kv_cache_memory_bytes:
        needed = others + plan.num_blocks * plan.kv_block_bytes
        if needed > plan.memory_bytes:
            plan.problems.append(
                f"weights, the engine's reserve and a KV cache of {plan.num_blocks} blocks "
                f"need {needed / _GiB:.2f} GiB per GPU: {(needed - plan.memory_bytes) / _GiB:.2f}"
                f" GiB more than the card's {plan.memory_bytes / _GiB:.1f} GiB"
            )
        return
    needed = others + 2 * plan.kv_block_bytes
    usable = int(plan.memory_bytes * plan.gpu_memory_utilization)
    if needed > usable:
        plan.problems.append(
            f"the model alone needs {needed / _GiB:.2f} GiB per GPU (weights "
            f"{plan.weight_bytes / _GiB:.2f} GiB, the engine's reserve and 2 KV blocks): "
            f"{(needed - usable) / _GiB:.2f} GiB more than gpu_memory_utilization "
            f"{plan.gpu_memory_utilization} of {plan.memory_bytes / _GiB:.1f} GiB leaves"
        )


def _check_ram(plan: MemoryPlan) -> None:
    """On the CPU the KV cache has its own size: weights and cache must fit this machine."""
    ram = physical_memory_bytes()
    needed = plan.weight_bytes * plan.tensor_parallel_size + plan.kv_budget_bytes * (
        plan.tensor_parallel_size
    )
    if needed > ram:
        plan.problems.append(
            f"weights and KV cache need {needed / _GiB:.2f} GiB of RAM; this machine has "
            f"{ram / _GiB:.1f} GiB"
        )
