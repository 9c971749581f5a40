"""fp8 tiles read as int16 pairs and converted to fp16 in registers (Triton helpers).

Loading an fp8 tile and converting it with `.to()` lets Triton move the conversion past the
change to the MMA operand layout: the tile then goes through shared memory as fp8 and is read
back one byte at a time (`ld.shared.b8`, four to five instructions an element), which made
fp8 K/V attention slower than bf16 and the weight-only fp8 GEMM slower than cuBLAS in bf16.
Loaded as int16 pairs and converted by PTX's `cvt.rn.f16x2.e4m3x2` (one instruction a pair),
the tile is fp16 before any layout change, so it reaches the MMA through `ldmatrix` as a
16-bit tile does. The interpreter runs no PTX: there the same values come from integer ops.
"""

from __future__ import annotations

import triton
import triton.language as tl

# off: fp8 tiles loaded as fp8 and converted by `.to()` (the benchmarks' A/B)
ENABLED = True


@triton.jit
def load_fp8_pairs(ptr, rows, mask, WIDTH: tl.constexpr):
    """[R, WIDTH / 2] int16: WIDTH fp8 bytes from each of R rows (element offsets `rows`,
    even), read as pairs; 0 where `mask` [R] is False."""
    pair_ptr = ptr.to(tl.pointer_type(tl.int16))
    return tl.load(pair_ptr + (rows // 2)[:, None] + tl.arange(0, WIDTH // 2)[None, :],
                   mask=mask[:, None], other=0)  # fmt: skip


@triton.jit
def fp8_pairs_to_f16(pairs, FP8_PAIRS: tl.constexpr, PTX_CVT: tl.constexpr):
    """[R, 2 C] fp16 from [R, C] int16 pairs of fp8 (FP8_PAIRS 1: e4m3fn, 2: e5m2), in the
    load's layout: `cvt.rn.f16x2.e4m3x2` (e5m2x2) where PTX_CVT, integer ops otherwise."""
    if PTX_CVT:
        if FP8_PAIRS == 1:
            asm: tl.constexpr = "cvt.rn.f16x2.e4m3x2 $0, $1;"
        else:
            asm: tl.constexpr = "cvt.rn.f16x2.e5m2x2 $0, $1;"
        f16x2 = tl.inline_asm_elementwise(
            asm, "=r,h", [pairs], dtype=tl.int32, is_pure=True, pack=1
        )
        lo = (f16x2 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)  # element 2i
        hi = (f16x2 >> 16).to(tl.int16).to(tl.float16, bitcast=True)  # element 2i + 1
    else:
        bits = pairs.to(tl.int32) & 0xFFFF
        lo = _fp8_byte_to_f16(bits & 0xFF, FP8_PAIRS)
        hi = _fp8_byte_to_f16(bits >> 8, FP8_PAIRS)
    return tl.interleave(lo, hi)


@triton.jit
def _fp8_byte_to_f16(b, FP8_PAIRS: tl.constexpr):
    """fp16 of fp8 bytes b (int32 0..255). e5m2 is the top byte of an fp16. e4m3fn: its
    exponent and mantissa shifted into an fp16's (bias 15, not 7: times 2^8 after), which
    also maps e4m3's subnormals exactly; NaN is not stored by the cache."""
    if FP8_PAIRS == 2:
        return (b << 8).to(tl.int16).to(tl.float16, bitcast=True)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.to(tl.int16).to(tl.float16, bitcast=True) * 256.0
