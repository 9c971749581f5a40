"""Environment knobs, all with the PAGELLM_ prefix, read when asked (not at import)."""

from __future__ import annotations

import json
import os


def _bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off", "")


def enable_multiprocessing() -> bool:
    """PAGELLM_ENABLE_MULTIPROCESSING=0 runs the EngineCore in the caller's process."""
    return _bool("PAGELLM_ENABLE_MULTIPROCESSING", True)


def cache_dir() -> str:
    """PAGELLM_CACHE_DIR: where converted tokenizers and the compiled CPU kernels are kept
    (default ~/.cache/pagellm)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "pagellm")
    return os.environ.get("PAGELLM_CACHE_DIR", default)


def log_level() -> str:
    """PAGELLM_LOGGING_LEVEL: INFO by default."""
    return os.environ.get("PAGELLM_LOGGING_LEVEL", "INFO").upper()


def warm_grammar_backend(device: str) -> bool:
    """PAGELLM_WARM_GRAMMAR_BACKEND=1 / 0: the EngineCore builds the structured-output grammar
    backend (the tokenizer, xgrammar's vocabulary tables) in a thread while the model loads /
    only when the first constrained request comes. Unset: on CUDA, where loading takes
    seconds anyway and the first constrained request should not wait."""
    return _bool("PAGELLM_WARM_GRAMMAR_BACKEND", device.startswith("cuda"))


def triton_compile_ahead() -> bool:
    """PAGELLM_TRITON_COMPILE_AHEAD=0: compile Triton kernels as the first forward meets them
    (one after another) instead of side by side before it (`pagellm.kernels.compile_ahead`)."""
    return _bool("PAGELLM_TRITON_COMPILE_AHEAD", True)


def cpu_prepack() -> bool:
    """PAGELLM_CPU_PREPACK=0 keeps plain Linear weights on x86 CPUs (no oneDNN packing)."""
    return _bool("PAGELLM_CPU_PREPACK", True)


def cpu_bf16_fp32_gemm() -> bool | None:
    """PAGELLM_CPU_BF16_FP32_GEMM=1 / 0: bfloat16 GEMMs of 8 or more rows on the CPU run in
    float32 arithmetic (a float32 copy of the weight) / in bf16 kernels (oneDNN's or ours,
    PAGELLM_CPU_BF16_KERNEL). Unset: whichever is faster here, timed at start-up
    (`pagellm.kernels.cpu_gemm`)."""
    value = os.environ.get("PAGELLM_CPU_BF16_FP32_GEMM")
    return None if value is None else _bool("PAGELLM_CPU_BF16_FP32_GEMM", False)


def cpu_bf16_kernel() -> bool | None:
    """PAGELLM_CPU_BF16_KERNEL=1 / 0: bfloat16 GEMMs on the CPU run in our AVX512-BF16 kernel
    (`pagellm.kernels.panel_gemm`, where the CPU has it) / never. Unset: where it is not
    clearly slower than oneDNN, timed at start-up (`pagellm.kernels.cpu_gemm`)."""
    value = os.environ.get("PAGELLM_CPU_BF16_KERNEL")
    return None if value is None else _bool("PAGELLM_CPU_BF16_KERNEL", False)


def cpu_fp32_gemm() -> str | None:
    """PAGELLM_CPU_FP32_GEMM=mkl | onednn | pagellm: the library of float32 GEMMs on the CPU
    (pagellm: our AVX-512 / AVX2 kernel, `pagellm.kernels.panel_gemm`). Unset:
    whichever is faster here, timed at start-up (`pagellm.kernels.cpu_gemm`)."""
    value = os.environ.get("PAGELLM_CPU_FP32_GEMM", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("mkl", "onednn", "pagellm"):
        raise ValueError(
            f"PAGELLM_CPU_FP32_GEMM must be mkl, onednn, pagellm or auto, got {value!r}"
        )
    return value


def cpu_gemm_plan() -> dict | None:
    """PAGELLM_CPU_GEMM_PLAN: a whole CPU GEMM plan as JSON (`fp32_library`,
    `bf16_fp32_from_rows`, `bf16_kernel`), taken as it is instead of timed
    (`pagellm.kernels.cpu_gemm`). The server sets it for the cores it starts after the first,
    to the first one's plan, so that every core of a server computes alike."""
    value = os.environ.get("PAGELLM_CPU_GEMM_PLAN")
    if not value:
        return None
    try:
        plan = json.loads(value)
    except ValueError as e:
        raise ValueError(f"PAGELLM_CPU_GEMM_PLAN is not JSON: {value!r}") from e
    keys = {"fp32_library", "bf16_fp32_from_rows", "bf16_kernel"}
    if not isinstance(plan, dict) or set(plan) != keys:
        raise ValueError(f"PAGELLM_CPU_GEMM_PLAN must be an object with {sorted(keys)}: {value!r}")
    return plan


def cpu_fused_ops() -> bool:
    """PAGELLM_CPU_FUSED_OPS=0: the decoder layers' RMSNorm, rotary and SiLU-and-mul stay torch
    ops on the CPU instead of the C++ ones (`pagellm.kernels.cpu_fused`)."""
    return _bool("PAGELLM_CPU_FUSED_OPS", True)


def cpu_decoder_loop() -> bool:
    """PAGELLM_CPU_DECODER_LOOP=0: a Llama-family model's layers run one by one in Python on
    the CPU instead of one C++ call a step (`pagellm.layers.cpu_decoder`)."""
    return _bool("PAGELLM_CPU_DECODER_LOOP", True)


def cpu_greedy_head() -> bool:
    """PAGELLM_CPU_GREEDY_HEAD=0: greedy CPU steps compute every logit, not the argmax from an
    8-bit copy of a tied float32 LM head and its few candidate rows (up to 3 rows a step;
    `pagellm.sample.greedy_head`)."""
    return _bool("PAGELLM_CPU_GREEDY_HEAD", True)


def cpu_int8_activations() -> bool:
    """PAGELLM_CPU_INT8_ACTIVATIONS=1: 4-bit GEMMs at decode sizes on the CPU (GGUF Q4_0 / Q4_1,
    GPTQ / AWQ / compressed-tensors int4) round each row of x to int8 blocks of 32 first, as
    llama.cpp does (its Q8_0), and multiply in integers (AVX512-VNNI; elsewhere ignored).
    Faster, and no longer the dequantized model's exact products (`pagellm/csrc/gguf_gemm.cpp`)."""
    return _bool("PAGELLM_CPU_INT8_ACTIVATIONS", False)


def pdl() -> bool:
    """PAGELLM_PDL=0: no programmatic dependent launch on Hopper GPUs (`pagellm.kernels.pdl`:
    by default the batch-1 fp8 GEMVs launch while the kernel before them finishes)."""
    return _bool("PAGELLM_PDL", True)


def cpu_decode_kernel() -> bool:
    """PAGELLM_CPU_DECODE_KERNEL=0: CPU attention gathers its K/V and runs SDPA instead of the
    C++ kernel that reads the paged cache in place (`pagellm.attention.cpu_decode`)."""
    return _bool("PAGELLM_CPU_DECODE_KERNEL", True)


def cpu_quant_max_rows(default: int) -> int:
    """PAGELLM_CPU_QUANT_MAX_ROWS: the most rows a step's GEMM may have to run through the CPU's
    quantized kernels (GGUF blocks, torch's int4 / int8: `pagellm.quantization`; larger ones
    use the dequantized copy, or the blocks dequantized per call). Unset: each kernel's
    `default`, where it stops beating the dense GEMM (docs/notes.md, the GGUF block kernel)."""
    value = os.environ.get("PAGELLM_CPU_QUANT_MAX_ROWS")
    return default if value is None else int(value)


def cpu_quant_dense_copy() -> str:
    """PAGELLM_CPU_QUANT_DENSE_COPY: whether the CPU's quantized layers (GGUF blocks, int4 /
    int8 checkpoints) keep a dequantized copy for batches beyond the block kernel's rows:
    "1" always, "0" never (each such batch dequantizes each layer into one reused buffer),
    "auto" (default) when every copy together takes at most a quarter of this machine's
    memory (`pagellm.quantization.cpu_int.DenseCopies`)."""
    value = os.environ.get("PAGELLM_CPU_QUANT_DENSE_COPY", "auto").strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"PAGELLM_CPU_QUANT_DENSE_COPY={value!r}: expected auto, 1 or 0")
    return value


def lora_cuda_graphs() -> bool:
    """A LoRA engine on CUDA replays CUDA graphs for decode steps (the slot and scale buffers
    filled before each replay; tests/test_lora_gpu.py). PAGELLM_LORA_CUDA_GRAPHS=0: LoRA
    steps run eagerly (the rest of the engine keeps its graphs off too)."""
    return _bool("PAGELLM_LORA_CUDA_GRAPHS", True)
