"""The paged attention and fp8 GEMM kernels compiled for Hopper (sm_90) on this CPU-only
machine: Triton's front end, its GPU passes and ptxas, without a device. The interpreter runs
the kernels' semantics in CI, but accepts Python the compiler refuses (an `if` on a float
constexpr once broke every GPU run); this catches that class of error before device time is
spent."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagellm.kernels.paged_attention import _paged_attention_kernel  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
_POINTERS = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")
_INT_POINTERS = ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr", "tile_req_ptr",
                 "tile_q_ptr")  # fmt: skip
_FLOAT_POINTERS = ("part_acc_ptr", "part_max_ptr", "part_sum_ptr", "kv_scale_ptr")


def _signature(fn, kv_fp8: bool) -> dict[str, str]:
    types = {name: "*bf16" for name in _POINTERS}
    if kv_fp8:
        types["k_cache_ptr"] = types["v_cache_ptr"] = "*fp8e4nv"
    types |= {name: "*i32" for name in _INT_POINTERS}
    types |= {name: "*fp32" for name in _FLOAT_POINTERS}
    types["qk_scale"] = "fp32"
    return _typed(fn, types)


def _typed(fn, types: dict[str, str]) -> dict[str, str]:
    """Triton's signature of `fn`: constexprs, the given types, i32 for the other scalars."""
    return {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in fn.params}


@pytest.mark.parametrize(
    ("window", "soft_cap_log2", "kv_fp8", "split"),
    [(0, 0.0, False, False), (64, 72.13, False, True), (0, 0.0, True, True),
     (4096, 0.0, True, False)],
)  # fmt: skip
def test_paged_attention_compiles_for_hopper(window, soft_cap_log2, kv_fp8, split):
    constexprs = dict(
        QUERIES_PER_KV=2, HEAD_GROUPS=1, HEADS_PER_PROG=2, BLOCK_Q=16, BLOCK_N=32, HEAD_DIM=64,
        BLOCK_SIZE=16, HAS_TILE_MAP=True, SPLIT=split, FP32_DOT=False, WINDOW=window,
        SOFT_CAP_LOG2=soft_cap_log2, KV_FP8=kv_fp8,
    )  # fmt: skip
    fn = _paged_attention_kernel
    src = ASTSource(fn=fn, signature=_signature(fn, kv_fp8), constexprs=constexprs)
    compiled = triton.compile(src, target=HOPPER)
    assert compiled.asm["cubin"]  # through ptxas: sm_90 machine code


@pytest.mark.parametrize(
    ("a_fp8", "w_block", "block_m"), [(False, 0, 16), (True, 0, 64), (True, 128, 64)]
)
def test_fp8_gemm_compiles_for_hopper(a_fp8, w_block, block_m):
    from pagellm.kernels.fp8_gemm import _fp8_gemm_kernel

    types = {"a_ptr": "*fp8e4nv" if a_fp8 else "*bf16", "w_ptr": "*fp8e4nv", "c_ptr": "*bf16",
             "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16"}  # fmt: skip
    constexprs = dict(A_FP8=a_fp8, W_BLOCK=w_block, HAS_BIAS=True, BLOCK_M=block_m,
                      BLOCK_N=64, BLOCK_K=128)  # fmt: skip
    src = ASTSource(fn=_fp8_gemm_kernel, signature=_typed(_fp8_gemm_kernel, types),
                    constexprs=constexprs)  # fmt: skip
    assert triton.compile(src, target=HOPPER).asm["cubin"]
