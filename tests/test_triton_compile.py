"""The paged attention, fp8 and int4 / int8 GEMM / GEMV and quantized fused-MoE kernels compiled
for Hopper (sm_90) on this CPU-only machine: Triton's front end, its GPU passes and ptxas,
without a device. The interpreter runs the kernels' semantics in CI, but accepts Python the
compiler refuses (an `if` on a float constexpr once broke every GPU run); this catches that
class of error before device time is spent. Each test compiles in a fresh process: with
TRITON_INTERPRET=1 set (other test modules set it) `@triton.jit` makes interpreter functions,
which cannot be compiled."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys

import pytest

# not imported here: importing triton before other modules set TRITON_INTERPRET breaks them
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

_POINTERS = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")
_INT_POINTERS = ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr", "tile_req_ptr",
                 "tile_q_ptr")  # fmt: skip
_FLOAT_POINTERS = ("part_acc_ptr", "part_max_ptr", "part_sum_ptr", "kv_scale_ptr", "sinks_ptr")
ATTENTION_VARIANTS = [  # (WINDOW, SOFT_CAP_LOG2, KV_FP8, SPLIT, FP8_PAIRS)
    (0, 0.0, False, False, 0), (64, 72.13, False, True, 0), (0, 0.0, True, True, 0),
    (0, 0.0, True, False, 1), (4096, 0.0, True, True, 2),
]  # fmt: skip
GEMM_VARIANTS = [(False, 0, 16), (True, 0, 64), (True, 128, 64)]  # (A_FP8, W_BLOCK, BLOCK_M)


def _compile(
    fn, types: dict[str, str], constexprs: dict, divisible: tuple[str, ...] = (), **options
) -> str:
    """PTX of `fn` for sm_90 (`benchmarks/kernel_sass.py: compile_sm90`; `options`:
    num_warps, num_stages, Triton's defaults else)."""
    from benchmark_modules import load

    compiled = load("kernel_sass").compile_sm90(fn, types, constexprs, divisible, **options)
    assert compiled.asm["cubin"]  # via ptxas
    return compiled.asm["ptx"]


def compile_attention() -> None:
    from pagellm.kernels.attention_plan import decode_config
    from pagellm.kernels.paged_attention import _combine_splits_kernel, _paged_attention_kernel

    def attention(window, soft_cap_log2, kv_fp8, split, fp8_pairs, tile=None, sinks=False):
        cache = ("*fp8e5" if fp8_pairs == 2 else "*fp8e4nv") if kv_fp8 else "*bf16"
        types = {name: "*bf16" for name in _POINTERS} | {"k_cache_ptr": cache, "v_cache_ptr": cache}
        types |= {name: "*i32" for name in _INT_POINTERS}
        types |= {name: "*fp32" for name in _FLOAT_POINTERS} | {"qk_scale": "fp32"}
        constexprs = dict(
            QUERIES_PER_KV=2, HEAD_GROUPS=1, HEADS_PER_PROG=2, BLOCK_Q=16, BLOCK_N=32,
            HEAD_DIM=64, BLOCK_SIZE=16, HAS_TILE_MAP=True, SPLIT=split, FP32_DOT=False,
            WINDOW=window, SOFT_CAP_LOG2=soft_cap_log2, KV_FP8=kv_fp8, FP8_PAIRS=fp8_pairs,
            PTX_CVT=bool(fp8_pairs), PDL=split,  # griddepcontrol through ptxas too
            HAS_SINKS=sinks,
        )  # fmt: skip
        options = {}
        if tile is not None:  # the plan's decode tile, its warps and stages
            constexprs |= dict(QUERIES_PER_KV=tile.heads_per_prog,
                               HEADS_PER_PROG=tile.heads_per_prog, BLOCK_Q=tile.block_q,
                               BLOCK_N=tile.block_n, HEAD_DIM=128, HAS_TILE_MAP=False)  # fmt: skip
            options = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
        _compile(_paged_attention_kernel, types, constexprs, **options)

    for variant in ATTENTION_VARIANTS:
        attention(*variant)
    attention(128, 0.0, False, False, 0, sinks=True)  # gpt-oss: sinks, windowed or not
    attention(0, 0.0, False, True, 0, sinks=True)
    for sinks in (False, True):  # the split-KV merge, with and without sinks
        types = {"out_ptr": "*bf16", "query_start_loc_ptr": "*i32", "tile_req_ptr": "*i32",
                 "tile_q_ptr": "*i32"} | {name: "*fp32" for name in _FLOAT_POINTERS}  # fmt: skip
        constexprs = dict(BLOCK_Q=16, HEAD_DIM=64, HAS_TILE_MAP=False, SPLITS_PAD=64, PDL=False,
                          HAS_SINKS=sinks)  # fmt: skip
        _compile(_combine_splits_kernel, types, constexprs, num_warps=4)
    for element_size, kv_fp8, fp8_pairs in ((2, False, 0), (1, True, 1)):
        for queries_per_kv in (2, 4):  # fp8: 32 and 16 keys a step
            tile = decode_config(queries_per_kv, 128, element_size)
            attention(0, 0.0, kv_fp8, False, fp8_pairs, tile)


def compile_fp8_gemm() -> None:
    from pagellm.kernels.fp8_gemm import _fp8_gemm_kernel, _fp8_gemv_kernel, _fp8_gemv_qkv_kernel

    for a_fp8, w_block, block_m in GEMM_VARIANTS:
        types = {"a_ptr": "*fp8e4nv" if a_fp8 else "*bf16", "w_ptr": "*fp8e4nv", "c_ptr": "*bf16",
                 "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16"}  # fmt: skip
        constexprs = dict(A_FP8=a_fp8, W_BLOCK=w_block, HAS_BIAS=True, BLOCK_M=block_m,
                          BLOCK_N=64, BLOCK_K=128)  # fmt: skip
        constexprs |= dict(W_PAIRS=not a_fp8, PTX_CVT=not a_fp8)
        _compile(_fp8_gemm_kernel, types, constexprs)
    for w_block, block_n, block_k in ((0, 2, 1024), (128, 2, 1024)):
        types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "c_ptr": "*bf16", "w_scale_ptr": "*fp32",
                 "bias_ptr": "*bf16"}  # fmt: skip
        for pdl, gated, k_steps in ((False, False, 0), (True, False, 0), (True, True, 3)):
            constexprs = dict(W_BLOCK=w_block, HAS_BIAS=True, BLOCK_N=block_n, BLOCK_K=block_k,
                              PDL=pdl, GATED=gated, K_STEPS=k_steps, VEC=8)  # fmt: skip
            ptx = _compile(_fp8_gemv_kernel, types, constexprs, ("N", "K", "stride_wn"))
            if not w_block and not k_steps:  # the weight in x's register layout: the K loop
                loop = ptx[ptx.index("Inner Loop Header") :]  # has no shared memory
                assert "shared" not in loop[: loop.find("bra")]
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16",
             "cs_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv",
             "v_cache_ptr": "*fp8e4nv", "slot_ptr": "*i64", "kv_scale_ptr": "*fp32"}  # fmt: skip
    for w_block, k_steps in ((0, 8), (128, 0)):  # q | k | v with rotary and the cache write
        constexprs = dict(W_BLOCK=w_block, HAS_BIAS=False, BLOCK_N=2, BLOCK_K=512, HALF_D=64,
                          BLOCK_SIZE=16, QUANT=True, FP8_MAX=448.0, PDL=True, K_STEPS=k_steps,
                          VEC=8)  # fmt: skip
        _compile(_fp8_gemv_qkv_kernel, types, constexprs, ("N", "K", "stride_wn"))


def compile_fused_fp8_outputs() -> None:
    """RMSNorm (+ residual) and SiLU-and-mul writing the w8a8 GEMM's fp8 input: per row in
    one tile, per 128 columns, and SiLU-and-mul's two-pass rows."""
    from pagellm.kernels.fused import _rms_norm_kernel, _silu_and_mul_fp8_kernel

    types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp8e4nv",
             "res_out_ptr": "*bf16", "scale_ptr": "*fp32", "eps": "fp32"}  # fmt: skip
    for group in (4096, 128):
        constexprs = dict(HEADS_PAD=1, BLOCK=4096, HAS_RES=True, PDL=True, FP8_GROUP=group)
        _compile(_rms_norm_kernel, types, constexprs, ("n", "stride_xt", "stride_rt", "stride_st"))
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    for group, block in ((16384, 16384), (128, 2048), (0, 2048)):
        constexprs = dict(GROUP=group, BLOCK=block)
        _compile(_silu_and_mul_fp8_kernel, types, constexprs, ("n", "stride_xt", "stride_st"))


def compile_wna16_gemm() -> None:
    """The int4 / int8 weight-only GEMV and tensor-core GEMM, as `wna16_gemm` launches them."""
    import torch

    from pagellm.kernels.wna16_gemm import (
        _wna16_dequant_kernel,
        _wna16_gemm_kernel,
        _wna16_gemv_kernel,
        gemm_config,
        pairs_serve,
    )

    types = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
             "bias_ptr": "*bf16", "y_ptr": "*bf16"}  # fmt: skip
    for bits, group in ((4, 128), (8, 128), (4, 32)):
        for sub, steps, warps in ((group, 8, 4), (min(group, 64), 1, 2)):  # groups; a part
            constexprs = dict(BITS=bits, GROUP=group, HAS_BIAS=True, BLOCK_N=16, SUB=sub,
                              STEPS=steps, ROWS=steps // 2 + 1, ROWS_PAD=steps,
                              PTX=True)  # fmt: skip
            _compile(_wna16_gemv_kernel, types, constexprs, ("N", "K", "KW", "stride_qn"),
                     num_warps=warps)  # fmt: skip
        # where `wna16_gemm` builds 16-bit pairs (bf16 and fp16 x, K a multiple of the step or
        # not), at its tiles for 16 / 64 / 128 / 256 rows (the taller ones of a 4,096-wide and
        # a wider layer); the float32 unpack
        step = min(128, group)
        pairs = pairs_serve(bits, torch.bfloat16, step)
        variants = ((True, "*bf16", True), (True, "*fp16", False)) if pairs else ()
        for (pairs, x_type, even_k), (m, n) in itertools.product(
            ((False, "*bf16", False), *variants), ((16, 4096), (64, 4096), (128, 4096), (256, 6144))
        ):
            cfg = gemm_config(m, n, 4096, pairs)
            constexprs = dict(BITS=bits, GROUP=group, HAS_BIAS=False, BLOCK_M=cfg["BLOCK_M"],
                              BLOCK_N=cfg["BLOCK_N"], BLOCK_K=step, PAIRS=pairs, PTX=True,
                              EVEN_K=even_k)  # fmt: skip
            typed = types | {"x_ptr": x_type, "y_ptr": x_type, "bias_ptr": x_type}
            _compile(_wna16_gemm_kernel, typed, constexprs, ("N", "K", "KW", "stride_qn"),
                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
        constexprs = dict(BITS=bits, GROUP=group, BLOCK_N=64, BLOCK_K=min(128, group))
        _compile(_wna16_dequant_kernel, {"q_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
                 "w_ptr": "*bf16"}, constexprs, ("N", "K", "KW", "stride_qn", "stride_wn"),
                 num_warps=4)  # fmt: skip


def compile_fused_moe_quant() -> None:
    """The fused MoE GEMM with int4 / int8 / fp8 (per-row, 128-block) expert weights, gated
    (gate | up + SiLU-and-mul) and not (down x routing weights), at the decode and prefill
    tiles of `choose_config`."""
    from pagellm.kernels.fused_moe import H200_CONFIGS
    from pagellm.kernels.fused_moe_quant import _moe_quant_gemm_kernel

    for bits, group in ((4, 128), (8, 64), (0, 0), (0, 128)):
        w_type = "*fp8e4nv" if bits == 0 else "*i32"
        types = {"a_ptr": "*bf16", "w_ptr": w_type, "s_ptr": "*fp32", "z_ptr": "*u8",
                 "out_ptr": "*bf16", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
                 "num_padded_ptr": "*i32", "weights_ptr": "*fp32"}  # fmt: skip
        for gated, (_, c) in itertools.product((True, False), (H200_CONFIGS[0], H200_CONFIGS[-1])):
            constexprs = dict(ROWS_PER_A=8 if gated else 1, GATED=gated, APPLY_WEIGHTS=not gated,
                              BITS=bits, GROUP=group, PTX_CVT=True, BLOCK_M=c.block_m,
                              BLOCK_N=c.block_n, BLOCK_K=min(c.block_k, 64),
                              GROUP_M=c.group_m)  # fmt: skip
            _compile(_moe_quant_gemm_kernel, types, constexprs, ("k_dim", "stride_am", "stride_wn"),
                     num_warps=c.num_warps, num_stages=c.num_stages)  # fmt: skip


def compile_fused_moe_gpt_oss() -> None:
    """The bf16 expert GEMMs with gpt-oss's biases (both) and clamped SwiGLU (gate | up), at
    the decode and prefill tiles of `choose_config`; and without them, as other models run;
    the same with MXFP4 weights (`fused_moe_quant`)."""
    from pagellm.kernels.fused_moe import H200_CONFIGS, _moe_gemm_kernel
    from pagellm.kernels.fused_moe_quant import MXFP4_CONFIGS, _moe_quant_gemm_kernel

    types = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ids_ptr": "*i32",
             "expert_ids_ptr": "*i32", "num_padded_ptr": "*i32", "weights_ptr": "*fp32",
             "bias_ptr": "*bf16"}  # fmt: skip
    variants = itertools.product((True, False), (H200_CONFIGS[0], H200_CONFIGS[-1]), (True, False))
    for gated, (_, c), gpt_oss in variants:
        constexprs = dict(ROWS_PER_A=4 if gated else 1, GATED=gated, APPLY_WEIGHTS=not gated,
                          EVEN_K=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                          GROUP_M=c.group_m, HAS_BIAS=gpt_oss, CLAMPED=gpt_oss and gated,
                          SWIGLU_ALPHA=1.702, SWIGLU_LIMIT=7.0)  # fmt: skip
        _compile(_moe_gemm_kernel, types, constexprs, ("k_dim", "stride_am"),
                 num_warps=c.num_warps, num_stages=c.num_stages)  # fmt: skip
    # MXFP4 experts kept as stored: codes and scales bytes, dequantized in registers
    types |= {"w_ptr": "*u8", "s_ptr": "*u8", "z_ptr": "*u8"}
    for gated, (_, c) in itertools.product((True, False), (H200_CONFIGS[0], *MXFP4_CONFIGS)):
        constexprs = dict(ROWS_PER_A=4 if gated else 1, GATED=gated, APPLY_WEIGHTS=not gated,
                          BITS=4, GROUP=32, PTX_CVT=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                          BLOCK_K=c.block_k, GROUP_M=c.group_m, MXFP4=True, HAS_BIAS=True,
                          CLAMPED=gated, SWIGLU_ALPHA=1.702, SWIGLU_LIMIT=7.0)  # fmt: skip
        _compile(_moe_quant_gemm_kernel, types, constexprs, ("k_dim", "stride_am"),
                 num_warps=c.num_warps, num_stages=c.num_stages)  # fmt: skip


def compile_fused_moe_gemv() -> None:
    """The quantized MoE's decode path (`fused_moe_gemv`): MXFP4 (gpt-oss: biases, the
    clamped SwiGLU) and int4 / int8 experts, gated and not, at the default K step and a
    short one."""
    from pagellm.kernels.fused_moe_gemv import _moe_gemv_kernel

    common = {"a_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i32", "weights_ptr": "*fp32",
              "bias_ptr": "*bf16", "z_ptr": "*u8"}  # fmt: skip
    formats = ((True, 4, 32, "*u8", "*u8"), (False, 4, 128, "*i32", "*fp32"),
               (False, 8, 64, "*i32", "*fp32"))  # fmt: skip
    for (mxfp4, bits, group, w_type, s_type), gated, block_k in itertools.product(
        formats, (True, False), (1024, 64)
    ):
        sub = 0 if mxfp4 else min(group, block_k)
        constexprs = dict(ROWS_PER_A=4 if gated else 1, GATED=gated, APPLY_WEIGHTS=not gated,
                          BITS=bits, GROUP=group, MXFP4=mxfp4, BLOCK_N=16, BLOCK_K=block_k,
                          SUB=sub, STEPS=block_k // sub if sub else 0, PTX=True,
                          HAS_BIAS=mxfp4, CLAMPED=mxfp4 and gated, SWIGLU_ALPHA=1.702,
                          SWIGLU_LIMIT=7.0)  # fmt: skip
        types = common | {"w_ptr": w_type, "s_ptr": s_type}
        divisible = ("k_dim", "k_bytes", "stride_am", "stride_we", "stride_wn", "n_out")
        _compile(_moe_gemv_kernel, types, constexprs, divisible,
                 num_warps=4)  # fmt: skip


# sm_90 instructions a weight element in each quantized kernel's main loop, at most: measured
# 2026-12-07 (`benchmarks/kernel_sass.py`), with room for a compiler's drift. Before the values
# were built from int32 words as 16-bit pairs, dequantizing bounded them all: MXFP4's GEMV
# 9.2 and tiles 11.7; int4's dense GEMM 7.75, its GEMV 6.3, its expert tiles 6.84.
INSTRUCTION_BUDGETS = {"moe_gemv_mxfp4": 6.5,  # 5.3
                       "moe_tiles_mxfp4": 6.5,  # 6.3 (gpt-oss's K steps of 64)
                       "moe_tiles_int4": 4.6,  # 4.3
                       "wna16_gemv": 5.5,  # 5.2
                       "wna16_gemm": 5.1}  # 4.8  # fmt: skip


def quantized_instruction_budgets() -> None:
    """The quantized kernels' main loops as launched (`benchmarks/kernel_sass.py`'s presets)
    within `INSTRUCTION_BUDGETS`."""
    from benchmark_modules import load

    kernel_sass = load("kernel_sass")
    assert set(kernel_sass.KERNELS) == set(INSTRUCTION_BUDGETS)
    for name, (build, block_n, block_k) in kernel_sass.KERNELS.items():
        text, per_thread = build(block_n, block_k, 4)
        body = max(kernel_sass.loops(text), key=lambda ops: sum(ops.values()))
        per_element = sum(body.values()) / per_thread
        budget = INSTRUCTION_BUDGETS[name]
        assert per_element <= budget, f"{name}: {per_element:.2f} instructions a weight element"


def compile_lora() -> None:
    """The multi-LoRA shrink and expand on bf16 and float32 activations and slots, as
    `lora_shrink` / `lora_expand` launch them (rank 16; a fused projection's parts too)."""
    from pagellm.kernels.lora import _expand_kernel, _shrink_kernel

    for dtype, ieee in (("bf16", False), ("fp32", True)):  # a float32 model: IEEE products
        types = {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "h_ptr": "*fp32",
                 "rows_ptr": "*i32", "starts_ptr": "*i32", "scale_ptr": "*fp32"}  # fmt: skip
        _compile(_shrink_kernel, types, dict(BLOCK_M=16, BLOCK_K=256, BLOCK_R=16, IEEE=ieee),
                 ("K", "stride_xt", "stride_al", "stride_ar"))  # fmt: skip
        types = {"h_ptr": "*fp32", "b_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                 "rows_ptr": "*i32", "starts_ptr": "*i32"}  # fmt: skip
        for parts in (1, 3):  # one Linear; q | k | v in one expand
            _compile(_expand_kernel, types,
                     dict(PARTS=parts, BLOCK_M=16, BLOCK_N=64, BLOCK_R=16, IEEE=ieee),
                     ("N", "stride_bl", "stride_ot"))  # fmt: skip


def compile_mla_decode() -> None:
    """The latent-attention decode at DeepSeek-V2-Lite's row (R 512, P 64) and a small one
    (R 24 padded to 32), bf16 queries and cache, whole or split over the keys (float32
    partials; a mixed step's rows naming their requests), and float32 models' exact dots, as
    `mla_decode` launches it."""
    from pagellm.kernels.mla_decode import _mla_decode_kernel

    types = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "block_table_ptr": "*i32",
             "seq_lens_ptr": "*i32", "reqs_ptr": "*i32", "out_ptr": "*bf16", "ml_ptr": "*bf16",
             "qk_scale": "fp32"}  # fmt: skip
    for rank, rope in ((512, 64), (24, 8)):
        constexprs = dict(RANK=rank, ROPE=rope, RANK_PAD=max(16, 1 << (rank - 1).bit_length()),
                          ROPE_PAD=max(16, 1 << (rope - 1).bit_length()), BLOCK_H=16,
                          BLOCK_N=32, BLOCK_SIZE=16)  # fmt: skip
        _compile(_mla_decode_kernel, types, constexprs)
        _compile(_mla_decode_kernel, types | {"out_ptr": "*fp32", "ml_ptr": "*fp32"},
                 constexprs | {"SPLIT": True, "HAS_REQS": True})  # fmt: skip
    types |= {"q_ptr": "*fp32", "cache_ptr": "*fp32", "out_ptr": "*fp32"}  # float32 models
    _compile(_mla_decode_kernel, types, constexprs | {"FP32_DOT": True})


def _in_fresh_process(function: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
    code += f"import test_triton_compile as t; t.{function}()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_paged_attention_compiles_for_hopper():
    _in_fresh_process("compile_attention")


def test_fp8_gemm_compiles_for_hopper():
    _in_fresh_process("compile_fp8_gemm")


def test_fused_fp8_outputs_compile_for_hopper():
    _in_fresh_process("compile_fused_fp8_outputs")


def test_wna16_gemm_compiles_for_hopper():
    _in_fresh_process("compile_wna16_gemm")


def test_fused_moe_quant_compiles_for_hopper():
    _in_fresh_process("compile_fused_moe_quant")


def test_fused_moe_gpt_oss_compiles_for_hopper():
    _in_fresh_process("compile_fused_moe_gpt_oss")


def test_fused_moe_gemv_compiles_for_hopper():
    _in_fresh_process("compile_fused_moe_gemv")


def test_quantized_loops_stay_within_their_instruction_budgets():
    _in_fresh_process("quantized_instruction_budgets")


def test_lora_kernels_compile_for_hopper():
    _in_fresh_process("compile_lora")


def test_mla_decode_compiles_for_hopper():
    _in_fresh_process("compile_mla_decode")
