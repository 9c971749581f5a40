"""`pagellm plan`'s answer: the plan (`plan.py`), what would make a plan that does not fit
fit (the same plan made again with -tp N, fp8 weights or an fp8 KV cache), as text or JSON.
"""

from __future__ import annotations

import dataclasses
import json

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.plan import MemoryPlan, plan_memory
from pagellm.kv_cache_size import cdiv

_GiB = 1 << 30
TP_SIZES = (2, 4, 8)


def make_plan(args: EngineArgs, gpu_memory_gib: float | None = None) -> MemoryPlan:
    """The plan, with its suggestions."""
    plan = plan_memory(args, gpu_memory_gib)
    plan.suggestions = suggest(plan, args, gpu_memory_gib)
    return plan


def suggest(plan: MemoryPlan, args: EngineArgs, gpu_memory_gib: float | None) -> list[str]:
    """Changes that make a plan fit (each checked by planning with it), or that double the
    KV cache of one that fits."""
    out = []
    if plan.num_blocks == 0 and plan.device == "cuda":
        out += _alternatives(args, gpu_memory_gib, _weight_changes(plan))
    asked = args.max_model_len if isinstance(args.max_model_len, int) else None
    if plan.num_blocks and asked and asked > plan.max_model_len_auto:
        out.append(f"--max-model-len auto: {plan.max_model_len_auto} tokens")
        if plan.device == "cpu":
            needed = (cdiv(asked, plan.block_size) + 1) * plan.kv_block_bytes
            out.append(f"--kv-cache-memory-bytes {needed}: a KV cache of {asked} tokens")
    if plan.num_blocks and not plan.kv_cache_dtype.startswith("float8"):
        out += _alternatives(args, gpu_memory_gib, [{"kv_cache_dtype": "fp8"}])
    return out


def _weight_changes(plan: MemoryPlan) -> list[dict]:
    """What shrinks a GPU's weights: more ranks (unquantized), or fp8 weights on one."""
    changes: list[dict] = []
    if plan.quantization is None:
        tp = plan.tensor_parallel_size
        changes += [{"tensor_parallel_size": n * tp} for n in TP_SIZES]
        if tp == 1:
            changes.append({"quantization": "fp8"})
    return changes


def _alternatives(args: EngineArgs, gpu_memory_gib: float | None, changes: list[dict]) -> list:
    """Each change that makes the plan fit, with the KV tokens it buys; only the first
    fitting -tp."""
    out, tp_found = [], False
    for change in changes:
        if tp_found and "tensor_parallel_size" in change:
            continue
        try:
            alt = plan_memory(dataclasses.replace(args, **change), gpu_memory_gib)
        except ValueError:  # heads that do not split, quantization with -tp, ...
            continue
        if not alt.fits:
            continue
        tp_found |= "tensor_parallel_size" in change
        flags = " ".join(_flag(k, v) for k, v in change.items())
        out.append(
            f"{flags}: {alt.kv_tokens} KV tokens, max_model_len auto {alt.max_model_len_auto}"
        )
    return out


def _flag(name: str, value) -> str:
    return (
        f"-tp {value}" if name == "tensor_parallel_size" else f"--{name.replace('_', '-')} {value}"
    )


def to_json(plan: MemoryPlan) -> str:
    return json.dumps(plan.to_json(), indent=2)


def render_text(plan: MemoryPlan) -> str:
    """The plan for a terminal: the sizes, the table, the command, what does not fit."""
    lines = _header(plan) + ([""] + _table(plan) if plan.num_blocks else [])
    if plan.chosen is not None:
        row = plan.chosen
        lines += ["", f"to serve {row.max_model_len}-token requests, {row.max_num_seqs} at once:"]
        lines.append(f"  {row.command}")
    lines += [""] * bool(plan.problems) + [f"does not fit: {p}" for p in plan.problems]
    if plan.suggestions:
        lines += ["", "alternatives (each planned):"] + [f"  {s}" for s in plan.suggestions]
    return "\n".join(lines)


def _header(plan: MemoryPlan) -> list[str]:
    per = " per GPU" if plan.device == "cuda" else ""
    ranks = f", -tp {plan.tensor_parallel_size}" if plan.tensor_parallel_size > 1 else ""
    quant = f", {plan.quantization} weights" if plan.quantization else ""
    lines = [f"{plan.model} ({plan.architecture}) on {_where(plan)}{ranks}, {plan.dtype}{quant}"]
    if plan.checkpoint_bytes:
        stored = ", ".join(f"{_gib(b)} {d}" for d, b in plan.checkpoint_bytes.items())
        lines.append(f"  checkpoint       {stored} (as stored)")
    lines.append(f"  weights          {_gib(plan.weight_bytes)}{per} (as the loader holds them)")
    rows = "x 2 (K, V)" if plan.kv_parts == 2 else "(one latent row: MLA)"
    lines.append(
        f"  KV per token     {_gib(plan.kv_bytes_per_token)}{per} ({plan.num_layers} "
        f"layers x {plan.num_kv_heads} KV heads x {plan.head_dim} {rows}, "
        f"{plan.kv_cache_dtype})"
    )
    lines += _window_lines(plan)
    if plan.reserved:
        parts = [f"{_LABELS[k]} {_gib(v)}" for k, v in plan.reserved.items() if k in _LABELS]
        lines.append(f"  reserved         {', '.join(parts[:3])},")
        lines.append(f"                   {', '.join(parts[3:])}")
    if plan.num_blocks:
        lines.append(
            f"  KV cache         {_gib(plan.kv_budget_bytes)}{per}: {plan.num_blocks} blocks of "
            f"{plan.block_size} tokens = {plan.kv_tokens} tokens"
        )
    if plan.max_model_len_auto:
        lines.append(
            f"  --max-model-len auto: {plan.max_model_len_auto} tokens "
            f"(the model's: {plan.max_position_embeddings})"
        )
    return lines


_LABELS = {  # MemoryPlan.reserved's keys as the text shows them (the weights have their line)
    "not_torch": "CUDA context",
    "buffers": "buffers",
    "persistent": "sampling state",
    "activations": "profiling step",
    "margin": "margin (CUDA graphs)",
}


def _where(plan: MemoryPlan) -> str:
    if plan.device == "cpu":
        return "the CPU (the KV cache's size: --kv-cache-memory-bytes, default 2 GiB)"
    return (
        f"cuda, {plan.memory_bytes / _GiB:.1f} GiB a GPU, gpu_memory_utilization "
        f"{plan.gpu_memory_utilization}"
    )


def _window_lines(plan: MemoryPlan) -> list[str]:
    if plan.sliding_window is not None:
        return [
            f"  sliding window   {plan.sliding_window} tokens on every layer: a request holds "
            "the blocks its window touches"
        ]
    if plan.windowed_layers:
        return [
            f"  sliding window   {plan.windowed_layers} of {plan.num_layers} layers: the cache "
            "keeps every layer's blocks alike, so a request holds all of its tokens"
        ]
    return []


def _table(plan: MemoryPlan) -> list[str]:
    cap = f"at most --max-num-seqs {plan.max_num_seqs}"
    lines = [f"  max_model_len  requests at once (full length; {cap})"]
    for row in plan.rows:
        count = str(row.max_num_seqs) if row.max_num_seqs else "does not fit"
        lines.append(f"  {row.max_model_len:>13}  {count}")
    return lines


def _gib(n: int) -> str:
    """Bytes in GiB, or MiB / KiB below one of those."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"
