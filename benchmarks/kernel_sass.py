"""What a Triton kernel's main loop costs in sm_90 instructions, without a GPU: the kernel
compiled for Hopper on this machine (Triton's front end, ptxas), disassembled by the
`nvdisasm` Triton ships, and the instructions between each backward branch and its label
counted by opcode. Weight elements a thread dequantizes per iteration divide the count into
instructions an element: the number that bounded the MXFP4 MoE kernels (docs/notes.md,
"MXFP4 experts on the GPU: instructions an element").

    python benchmarks/kernel_sass.py moe_gemv_mxfp4          # the decode GEMV (gate | up)
    python benchmarks/kernel_sass.py moe_tiles_mxfp4 --dump /tmp/tiles.sass
    python benchmarks/kernel_sass.py moe_gemv_mxfp4 --block-n 16 --block-k 512
    python benchmarks/kernel_sass.py wna16_gemm --num-warps 8 --block-n 128   # dense int4

Integer arguments that are multiples of 16 at run time are marked so (Triton specializes on
that when it launches): without it the loads compile to single bytes and the count means
nothing. Not a timing: ALU issue is what it estimates (a warp issues one instruction a cycle
per scheduler, 4 a cycle per SM).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_OPCODE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


def compile_sm90(fn, types: dict, constexprs: dict, divisible: tuple[str, ...] = (), **options):
    """`fn` compiled for sm_90 (ptxas included): pointers 16-byte aligned, as torch's
    allocations are at run time, and the `divisible` integers multiples of 16, as Triton
    specializes them at run time; `types` for the pointers and float scalars (other scalars
    i32); `options` num_warps, num_stages. Every constexpr without a default must be given
    (one left out compiles as None, silently)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in fn.params}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if any(not p.has_default for p in fn.params if p.name in missing):
        raise ValueError(f"{fn.__name__}: constexprs not given: {missing}")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, kind) in enumerate(sig.items())
        if kind[0] == "*" or name in divisible
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass(fn, types: dict, constexprs: dict, divisible: tuple[str, ...], **options) -> str:
    """sm_90 SASS of a `@triton.jit` function (`compile_sm90`), by the `nvdisasm` Triton ships."""
    import triton

    compiled = compile_sm90(fn, types, constexprs, divisible, **options)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout


def loops(text: str) -> list[collections.Counter]:
    """Opcode counts of each loop body (a label to the branch back to it)."""
    lines = text.splitlines()
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if line.startswith(".L_x_")}
    bodies = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i - 5:
            ops = collections.Counter()
            for body_line in lines[labels[m.group(1)] : i + 1]:
                if op := _OPCODE.match(body_line):
                    ops[op.group(1)] += 1
            bodies.append(ops)
    return bodies


def moe_gemv_mxfp4(block_n: int, block_k: int, warps: int):
    from pagellm.kernels.fused_moe_gemv import _moe_gemv_kernel

    types = {"a_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i32", "weights_ptr": "*fp32",
             "bias_ptr": "*bf16", "z_ptr": "*u8", "w_ptr": "*u8", "s_ptr": "*u8"}  # fmt: skip
    constexprs = dict(ROWS_PER_A=4, GATED=True, APPLY_WEIGHTS=False, BITS=4, GROUP=32,
                      MXFP4=True, BLOCK_N=block_n, BLOCK_K=block_k, SUB=0, STEPS=0, PTX=True,
                      HAS_BIAS=True, CLAMPED=True, SWIGLU_ALPHA=1.702,
                      SWIGLU_LIMIT=7.0)  # fmt: skip
    divisible = ("k_dim", "k_bytes", "stride_am", "stride_wn", "stride_we", "stride_se",
                 "stride_be", "n_out")  # fmt: skip
    text = sass(_moe_gemv_kernel, types, constexprs, divisible, num_warps=warps)
    return text, 2 * block_n * block_k / (32 * warps)  # gate and up


def _moe_tiles(block_n: int, block_k: int, warps: int, block_m: int, mxfp4: bool):
    from pagellm.kernels.fused_moe_quant import _moe_quant_gemm_kernel

    types = {"a_ptr": "*bf16", "w_ptr": "*u8" if mxfp4 else "*i32",
             "s_ptr": "*u8" if mxfp4 else "*fp32", "z_ptr": "*u8", "out_ptr": "*bf16",
             "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_padded_ptr": "*i32",
             "weights_ptr": "*fp32", "bias_ptr": "*bf16"}  # fmt: skip
    constexprs = dict(ROWS_PER_A=4 if mxfp4 else 1, GATED=True, APPLY_WEIGHTS=False, BITS=4,
                      GROUP=32 if mxfp4 else 128, PTX_CVT=True, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1)  # fmt: skip
    if mxfp4:  # gpt-oss's biases and clamped SwiGLU
        constexprs |= dict(MXFP4=True, HAS_BIAS=True, CLAMPED=True, SWIGLU_ALPHA=1.702,
                           SWIGLU_LIMIT=7.0)  # fmt: skip
    divisible = ("k_dim", "stride_am", "stride_wn", "stride_we", "stride_se", "stride_sn",
                 "stride_be", "n_out")  # fmt: skip
    text = sass(_moe_quant_gemm_kernel, types, constexprs, divisible, num_warps=warps,
                num_stages=3)  # fmt: skip
    return text, 2 * block_n * block_k / (32 * warps)  # gate and up


def moe_tiles_mxfp4(block_n: int, block_k: int, warps: int, block_m: int = 64):
    """gpt-oss's MXFP4 experts' tiles (groups of 32, E8M0 scales)."""
    return _moe_tiles(block_n, block_k, warps, block_m, mxfp4=True)


def moe_tiles_int4(block_n: int, block_k: int, warps: int, block_m: int = 64):
    """The int4 experts' tiles (Qwen3-MoE's GPTQ shape: groups of 128, bf16 x)."""
    return _moe_tiles(block_n, block_k, warps, block_m, mxfp4=False)


def _wna16(kernel, constexprs: dict, warps: int, **options) -> str:
    types = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
             "bias_ptr": "*bf16", "y_ptr": "*bf16"}  # fmt: skip
    divisible = ("K", "KW", "G", "stride_xm", "stride_qn", "stride_ym")
    constexprs = dict(BITS=4, GROUP=128, HAS_BIAS=False, PTX=True) | constexprs
    return sass(kernel, types, constexprs, divisible, num_warps=warps, **options)


def wna16_gemv(block_n: int, block_k: int, warps: int):
    """The dense int4 GEMV at one row (Llama-3.1-8B's narrow projections' tile)."""
    from pagellm.kernels.wna16_gemm import _sub_blocks, _wna16_gemv_kernel

    sub, steps = _sub_blocks(block_k, 128, 4)
    constexprs = dict(ROWS=1, ROWS_PAD=1, BLOCK_N=block_n, SUB=sub, STEPS=steps)
    return _wna16(_wna16_gemv_kernel, constexprs, warps), block_n * block_k / (32 * warps)


def wna16_gemm(block_n: int, block_k: int, warps: int, block_m: int = 64):
    """The dense int4 tensor-core GEMM (a many-row decode step), bf16 x."""
    from pagellm.kernels.wna16_gemm import _wna16_gemm_kernel

    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PAIRS=True, EVEN_K=True)
    text = _wna16(_wna16_gemm_kernel, constexprs, warps, num_stages=3)
    return text, block_n * block_k / (32 * warps)


KERNELS = {
    "moe_gemv_mxfp4": (moe_gemv_mxfp4, 8, 1024),
    "moe_tiles_mxfp4": (moe_tiles_mxfp4, 64, 64),  # gpt-oss's: K = 2,880 takes steps of 64
    "moe_tiles_int4": (moe_tiles_int4, 64, 128),
    "wna16_gemv": (wna16_gemv, 8, 2048),
    "wna16_gemm": (wna16_gemm, 64, 128),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("--block-n", type=int)
    ap.add_argument("--block-k", type=int)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--dump", help="write the whole SASS here")
    args = ap.parse_args()
    build, block_n, block_k = KERNELS[args.kernel]
    text, per_thread = build(args.block_n or block_n, args.block_k or block_k, args.num_warps)
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(text)
    for ops in loops(text):
        total = sum(ops.values())
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(12))
        print(f"loop: {total} instructions, {total / per_thread:.1f} a weight element "
              f"({per_thread:g} elements a thread an iteration): {top}")  # fmt: skip


if __name__ == "__main__":
    main()
