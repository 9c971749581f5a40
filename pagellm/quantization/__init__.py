"""Quantized weights: the `quantization=` names, resolved against the checkpoint and device
(caller side, `resolve_quantization`), and built into a `QuantizationConfig` for the loader
(EngineCore side, `get_quant_config`). Method modules are imported lazily.

    None (default)   a checkpoint's own method ("fp8", "compressed-tensors", "awq", "gptq"
                     from its `quantization_config`); "gguf" for a GGUF file on an x86 CPU with
                     AVX-512 or AVX2 where the block kernel builds, on one rank (its float32
                     results are the dequantized path's: 64 of 64 identical 32-token greedy
                     continuations of the embedded model, docs/benchmarks.md); otherwise
                     unquantized
    "none"           no quantized kernels: GGUF, fp8 and int4 / int8 checkpoints are
                     dequantized at load
    "gguf"           GGUF tensors kept quantized on the CPU (gguf_cpu.py): Q4_0 / Q4_1 /
                     Q8_0 blocks read as they are (the block kernel, AVX-512 or AVX2), or
                     without it torch's int4 / int8 kernels (AVX512-BF16)
    "int4", "int8"   weight-only int4 (groups of 32) / int8 (per row) on the CPU (cpu_int.py)
                     torch's int kernels need an x86 CPU with AVX512-BF16 (elsewhere they
                     run a scalar path slower than float32, for no memory saved: ValueError)
    "fp8"            float8 e4m3 weights on CUDA: a bf16 checkpoint quantized at load, or an
                     fp8 checkpoint as stored (fp8.py); fp8 checkpoints on the CPU are
                     dequantized at load
    "compressed-tensors"  a compressed-tensors checkpoint: fp8 `float-quantized` (fp8.py) or
                     int4 / int8 `pack-quantized` (W4A16 / W8A16, wna16.py)
    "mxfp4"          gpt-oss's MXFP4 experts (mxfp4.py): on CUDA kept as stored, dequantized in
                     registers by the fused MoE kernel; on the CPU (and with "none")
                     dequantized at load to the model's dtype by the model's loader; with
                     load_format="dummy" (gpt-oss-20b's shipped config): random MXFP4 experts
    "awq", "gptq"    AWQ (GEMM) and GPTQ (4 / 8-bit, act-order, v1 / v2 zeros) checkpoints
                     (wna16.py; vLLM's "awq_marlin" / "gptq_marlin" are the same names here);
                     these and pack-quantized checkpoints split over tensor-parallel ranks;
                     with load_format="dummy" and no quantization_config: random int4
                     weights in groups of 128 (`with_dummy_quantization`)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagellm.quantization.base import quant_config_dict

if TYPE_CHECKING:
    import torch

    from pagellm.quantization.base import QuantizationConfig

QUANTIZATION_METHODS = {
    "fp8": "pagellm.quantization.fp8:Fp8Config",
    "compressed-tensors": "pagellm.quantization.fp8:Fp8Config",
    "gguf": "pagellm.quantization.gguf_cpu:GGUFConfig",
    "int4": "pagellm.quantization.cpu_int:CpuIntConfig",
    "int8": "pagellm.quantization.cpu_int:CpuIntConfig",
    "awq": "pagellm.quantization.wna16:WNA16Config",
    "gptq": "pagellm.quantization.wna16:WNA16Config",
    "mxfp4": "pagellm.quantization.mxfp4:Mxfp4Config",
}
INT_WEIGHTS = "pagellm.quantization.wna16:WNA16Config"  # also compressed-tensors pack-quantized
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}  # vLLM's kernel names, same checkpoints
NONE = "none"
CPU_ONLY = ("gguf", "int4", "int8")
CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "awq", "gptq", "mxfp4")  # ones we load
AT_LOAD = ("mxfp4",)  # on the CPU dequantized by the model's loader: no QuantizationConfig
INT_FORMATS = ("awq", "gptq", "compressed-tensors")  # load_format="dummy": int4 g128 weights


def resolve_quantization(
    name: str | None,
    hf_config: Any,
    source_kind: str,
    device: torch.device,
    tensor_parallel_size: int = 1,
) -> str | None:
    """The method to use (a `QUANTIZATION_METHODS` key), or None; ValueError naming
    `quantization` for a bad or impossible choice."""
    name = ALIASES.get(name, name)
    if name is not None and name != NONE and name not in QUANTIZATION_METHODS:
        choices = ", ".join([NONE, *QUANTIZATION_METHODS])
        raise ValueError(f"quantization must be None or one of {choices}, got {name!r}")
    stored = checkpoint_method(hf_config)
    # shards split on group boundaries, or dequantized whole at load
    splits = stored is not None and (int_weights(hf_config) or stored in AT_LOAD)
    if tensor_parallel_size > 1 and not splits and (stored or name not in (None, NONE)):
        raise ValueError(  # quantized layers load whole tensors (pagellm/layers/linear.py)
            f"quantization={name or stored!r} runs on one rank; tensor_parallel_size="
            f"{tensor_parallel_size} needs an unquantized checkpoint and quantization=None"
        )
    if stored is not None:
        return _with_checkpoint(name, stored)
    if name is None and source_kind == "gguf" and device.type == "cpu":
        from pagellm.quantization import gguf_kernel  # quantized layers run on one rank

        return "gguf" if tensor_parallel_size == 1 and gguf_kernel.supported() else None
    if name in CPU_ONLY:
        _check_cpu_int(name, device)
    if name == "gguf" and source_kind != "gguf":
        raise ValueError(
            "quantization='gguf' needs a GGUF file; to quantize this checkpoint on the CPU "
            "use 'int4' or 'int8'"
        )
    if name in ("awq", "gptq", *AT_LOAD):
        raise ValueError(
            f"quantization={name!r} needs a {name.upper()} checkpoint (config.json's "
            f"quantization_config.quant_method {name!r}); this model has no quantization_config"
        )
    if name in ("fp8", "compressed-tensors"):
        return _fp8_at_load(name, device)
    return None if name == NONE else name


def with_dummy_quantization(hf_config: Any, name: str | None, source_kind: str) -> Any:
    """Random weights asked for in an int format their config does not state ("awq",
    "gptq", "compressed-tensors" with load_format="dummy", e.g. a shipped config): the
    format's usual `quantization_config` (4-bit, groups of 128) set on `hf_config`, so the
    loader draws int weights at that layout (benchmarks without a checkpoint)."""
    name = ALIASES.get(name, name)
    if source_kind != "dummy" or name not in (*INT_FORMATS, *AT_LOAD):
        return hf_config
    if quant_config_dict(hf_config):
        return hf_config
    if name in AT_LOAD:  # gpt-oss's MXFP4 experts: random codes and scales (mxfp4.py)
        hf_config.quantization_config = {"quant_method": name}
        return hf_config
    from pagellm.quantization.wna16_formats import default_config

    hf_config.quantization_config = default_config(name)
    return hf_config


def checkpoint_method(hf_config: Any) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (ValueError if we cannot load it)."""
    cfg = quant_config_dict(hf_config)
    if not cfg:
        return None
    method = cfg.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"checkpoints quantized with quant_method={method!r} are not supported "
            f"(supported: {', '.join(CHECKPOINT_METHODS)})"
        )
    return method


def int_weights(hf_config: Any) -> bool:
    """Whether the checkpoint holds int4 / int8 weights (AWQ, GPTQ, compressed-tensors
    pack-quantized), served by wna16.py."""
    cfg = quant_config_dict(hf_config) or {}
    method = cfg.get("quant_method")
    if method != "compressed-tensors":
        return method in ("awq", "gptq")
    groups = (cfg.get("config_groups") or {}).values()
    formats = {g.get("format") or cfg.get("format") for g in groups} or {cfg.get("format")}
    return "pack-quantized" in formats


def _with_checkpoint(name: str | None, stored: str) -> str | None:
    if name in (None, stored) or (name == "fp8" and stored in ("fp8", "compressed-tensors")):
        return stored
    if name == NONE:
        return None  # the loader still reads the quantized tensors, and dequantizes them
    raise ValueError(
        f"quantization={name!r} does not match the checkpoint's quant_method {stored!r}"
    )


def _fp8_at_load(name: str, device: torch.device) -> str:
    if name == "compressed-tensors":
        raise ValueError("quantization='compressed-tensors' needs a compressed-tensors checkpoint")
    if device.type != "cuda":
        raise ValueError(
            "quantization='fp8' quantizes weights for CUDA GPUs with fp8 tensor cores; on the "
            "CPU use 'int8' or 'int4' (fp8 checkpoints load on the CPU, dequantized)"
        )
    return name


def _check_cpu_int(name: str, device: torch.device) -> None:
    from pagellm.quantization import gguf_kernel
    from pagellm.quantization.cpu_int import cpu_int_supported

    if device.type != "cpu":
        raise ValueError(
            f"quantization={name!r} runs on the CPU only (torch's int4/int8 CPU kernels); "
            "on CUDA use quantization='fp8'"
        )
    if name == "gguf" and gguf_kernel.supported():
        return
    if not cpu_int_supported():
        raise ValueError(
            f"quantization={name!r} needs an x86 CPU with AVX512-BF16 (torch's int4/int8 "
            "kernels are slower than float32 elsewhere); use quantization='none'"
        )


def get_quant_config(
    model_config: Any, device: torch.device, checkpoint: dict[str, Any] | None = None
) -> QuantizationConfig | None:
    """The loader's `QuantizationConfig` for a resolved `model_config.quantization` (a
    quantized checkpoint gets one even with None: its tensors are dequantized at load);
    `checkpoint`: the tensors the loader read ahead, by HF name (a GGUF file's)."""
    name = model_config.quantization or checkpoint_method(model_config.hf_config)
    if name is None:
        return None
    target = QUANTIZATION_METHODS[name]
    if name == "compressed-tensors" and int_weights(model_config.hf_config):
        target = INT_WEIGHTS
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls).from_model(
        model_config, device, checkpoint
    )
