"""`quantization="gguf"` (the default for GGUF files where the block kernel runs): a GGUF
file's quantized tensors stay quantized on the CPU.

With the block kernel (`gguf_kernel.py`, x86 with AVX-512 or AVX2 + FMA): Q4_0 / Q4_1 / Q8_0
tensors are read as they are, with float32 accumulation on the model dtype's activations, for
GEMMs of up to 8 rows (float32 activations; 2 for bfloat16, whose dense oneDNN GEMM reads half
the bytes of float32: `GGUFBlockWeight.MAX_ROWS`, PAGELLM_CPU_QUANT_MAX_ROWS); a dequantized copy
serves larger ones (prefill chunks), so every path computes the file's exact weights. Where the
copies would not fit (`cpu_int.DenseCopies`, PAGELLM_CPU_QUANT_DENSE_COPY) none is kept: each
larger batch dequantizes a layer's blocks into one reused buffer before its GEMM.
Other types (K-quants, fused projections whose parts differ) are dequantized at load. The
tied LM head (SmolLM2's `token_embd`, Q8_0) reads the embedding's blocks the same way.

Without it (no C++ compiler), torch's int4 / int8 kernels (AVX512-BF16; bfloat16
activations: 45% of the embedded model's greedy continuations agree with the dequantized
path, docs/benchmarks.md), per Linear:

    Q4_0, Q4_1   exact: a block's (d, m) is an int4 group of 32 (scale d, zero m + 8 d, both
                 rounded to bfloat16, which the kernel requires)
    Q4_K         requantized to int4 groups of 32 (its sub-blocks are groups of 32 whose 6-bit
                 scales and mins multiply a float16 pair: the same grid when a group spans
                 0..15, close otherwise)
    Q8_0, Q5_*, Q6_K, other K-quants
                 requantized to int8 with one scale per output row (the int8 kernel has no
                 groups)
    F32, F16, BF16
                 unquantized (the model dtype)

and the tied LM head is requantized the same way from the embedding's dequantized values.
The embedding lookup itself always reads the dequantized table.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from pagellm import envs
from pagellm.quantization import gguf_kernel
from pagellm.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizedWeight,
    checkpoint_names,
    drop_params,
    param_bytes,
    replace_param,
)
from pagellm.quantization.cpu_int import (
    DenseCopies,
    FloatToIntMethod,
    dense_weight,
    float_weight_to_int,
    int4_bytes,
    int4_fits,
    int4_weight,
)
from pagellm.quantization.gguf_dequant import block_bytes, decode_blocks, q4_parts
from pagellm.quantization.gguf_kernel import BlockPlanes

Q = GGMLQuantizationType
EXACT_INT4 = (Q.Q4_0, Q.Q4_1)
FOUR_BIT = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
UNQUANTIZED = (Q.F32, Q.F16, Q.BF16, Q.F64)


class GGUFBlockWeight(QuantizedWeight):
    """GGUF blocks read as they are by `gguf_kernel.block_gemm` for a few rows (float32 or
    bfloat16 activations, float32 accumulation), the dequantized copy for larger batches, or
    without one (more rows on the blocks, then) the blocks dequantized per call."""

    # rows up to which the blocks beat the dense copy, by activation dtype (the embedded model,
    # end to end: float32 2.7x at 4 rows, 1.7x at 8; bf16 1.18x at 1, 1.05x at 2, 0.86x at 4)
    MAX_ROWS = {torch.float32: 8, torch.bfloat16: 2}
    # without a copy, up to which they beat dequantizing the layer and a dense GEMM, which at
    # these rows reads the whole dequantized weight (2 threads: even at ~22 rows for 3,072 x
    # 576 and ~48 for 14,336 x 4,096 in float32; ~6 and ~12 in bf16)
    MAX_ROWS_NO_COPY = {torch.float32: 32, torch.bfloat16: 12}

    def __init__(self, planes: BlockPlanes, dense) -> None:
        self.planes = planes
        # x [T, in], bias -> [T, out] in x's dtype; None: no copy kept (`DenseCopies`), the
        # blocks dequantized into a reused buffer for each large batch
        self.dense = dense
        limits = self.MAX_ROWS if dense is not None else self.MAX_ROWS_NO_COPY
        self.max_rows = {dt: envs.cpu_quant_max_rows(n) for dt, n in limits.items()}

    def blocks_take(self, x: torch.Tensor) -> bool:
        """Whether x's rows go through the block kernel (else a dense weight)."""
        return x.shape[0] <= self.max_rows.get(x.dtype, 0)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.blocks_take(x):
            return gguf_kernel.block_gemm(x, self.planes, None if bias is None else bias.float())
        if self.dense is not None:
            return self.dense(x, bias)
        return F.linear(x, gguf_kernel.dequantize_into_scratch(self.planes, x.dtype), bias)


def block_weight(blocks: torch.Tensor, qtype: GGMLQuantizationType, dense: torch.Tensor | None):
    """The `QuantizedWeight` of one GGUF tensor's blocks [N, K / 32 * bytes] (Q/K rows in HF
    order); `dense` [N, K] is its dequantized weight in the model dtype, or None (no copy)."""
    planes = BlockPlanes.from_blocks(blocks, qtype)
    return GGUFBlockWeight(planes, None if dense is None else dense_weight(dense))


class GGUFBlocksMethod(LinearMethod):
    """Blocks loaded as bytes: for the block kernel (Q4_0, Q4_1, Q8_0) or, without it,
    packed for torch's int4 kernel (Q4_0, Q4_1)."""

    def __init__(self, qtype: GGMLQuantizationType, dtype: torch.dtype, block_kernel: bool,
                 copies: DenseCopies) -> None:  # fmt: skip
        self.qtype = qtype
        self.dtype = dtype  # the model's: the dense copy's
        self.block_kernel = block_kernel  # else torch's int4 kernel
        self.copies = copies  # whether the block kernel's layers keep a dequantized copy

    def create_weights(self, layer) -> None:
        row_bytes = layer.in_features // 32 * block_bytes(self.qtype)
        replace_param(layer, "weight", (layer.out_features, row_bytes), torch.uint8)

    def process_weights_after_loading(self, layer) -> None:
        # raw: [N, K / 32 * bytes], Q/K rows already in HF order
        n, k = layer.out_features, layer.in_features
        raw = layer.weight.detach()
        blocks = raw.reshape(-1, block_bytes(self.qtype))
        dense = decode_blocks(blocks, self.qtype).view(n, k)  # exactly the dequantized path's
        if self.block_kernel:
            copy = dense.to(self.dtype) if self.copies.keep() else None
            layer.packed_weight = block_weight(raw.contiguous(), self.qtype, copy)
        else:
            q, d, m = q4_parts(blocks, self.qtype)
            q, scale, low = q.view(n, k).to(torch.int32), d.view(n, k // 32), m.view(n, k // 32)
            layer.packed_weight = int4_weight(q, scale, low, dense.to(self.dtype))
        drop_params(layer, "weight")

    def weight_bytes(self, layer) -> int:
        # the blocks (the block kernel's), or int4 values and bfloat16 (scale, zero) pairs;
        # and the dequantized copy for large batches, where kept
        n, k = layer.out_features, layer.in_features
        dense = n * k * self.dtype.itemsize
        if self.block_kernel:
            return param_bytes(layer) + (dense if self.copies.keep() else 0)
        return param_bytes(layer, but=("weight",)) + int4_bytes(n, k) + dense


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, tensors: dict[str, Any], dtype: torch.dtype) -> None:
        self.dtype = dtype
        # HF name -> GGUF tensor (its `qtype`, `data`), for every weight of the file
        self.tensors = tensors
        self.raw_names: set[str] = set()  # loaded as blocks (see gguf_weights)
        self.block_kernel = gguf_kernel.supported()  # decided once, for every layer
        self.copies = DenseCopies()  # the block layers' dequantized copies: kept or not

    @classmethod
    def from_model(cls, model_config, device: torch.device, checkpoint=None) -> GGUFConfig:
        if checkpoint is None:
            raise ValueError("quantization='gguf' needs the GGUF file's tensors from the loader")
        return cls(checkpoint, model_config.dtype)

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        names = checkpoint_names(prefix, layer)
        tensors = [self.tensors[n] for n in names if n in self.tensors]
        qtypes = {t.qtype for t in tensors}
        if len(tensors) != len(names) or qtypes <= set(UNQUANTIZED):
            return None
        exact = set(gguf_kernel.QTYPES if self.block_kernel else EXACT_INT4)
        if len(qtypes) == 1 and qtypes <= exact and int4_fits(layer.in_features):
            self.raw_names.update(names)
            if self.block_kernel:
                self.copies.count(layer.out_features, layer.in_features, self.dtype)
            return GGUFBlocksMethod(qtypes.pop(), self.dtype, self.block_kernel, self.copies)
        if self.block_kernel:  # other types (K-quants, mixed parts) stay dequantized: exact
            return None
        four_bit = qtypes <= set(FOUR_BIT) and int4_fits(layer.in_features)
        return FloatToIntMethod(4 if four_bit else 8)

    def tied_head_weight(self, embedding: torch.Tensor) -> QuantizedWeight | None:
        tensor = self.tensors.get("model.embed_tokens.weight")
        if tensor is None or tensor.qtype in UNQUANTIZED:
            return None
        if self.block_kernel:
            if tensor.qtype not in gguf_kernel.QTYPES:
                return None
            blocks = torch.from_numpy(tensor.data).reshape(embedding.shape[0], -1)
            return block_weight(blocks.contiguous(), tensor.qtype, embedding.detach())
        four_bit = tensor.qtype in FOUR_BIT and int4_fits(embedding.shape[1])
        return float_weight_to_int(embedding.detach(), 4 if four_bit else 8)

    def describe(self) -> str:
        how = "read by the block kernel" if self.block_kernel else "as int4 blocks"
        return f"gguf ({len(self.raw_names)} tensors {how})"
