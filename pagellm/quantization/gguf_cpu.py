"""`quantization="gguf"`: a GGUF file's quantized tensors stay quantized on the CPU, in the
int4 / int8 layouts of `cpu_int.py` (opt-in: GGUF files are dequantized by default; see
`pagellm/quantization/__init__.py` for why).

How each GGUF type maps (per Linear; a fused projection maps when all its parts share one
type, and is requantized from the dequantized values otherwise):

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

The tied LM head (SmolLM2's `token_embd`, Q8_0) gets the same treatment from the embedding's
dequantized values; the embedding lookup itself reads the dequantized table.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from pagellm.loader.dequant import block_bytes, decode_blocks, q4_parts
from pagellm.loader.gguf_file import GGUFFile, read_gguf
from pagellm.loader.gguf_loader import hf_name
from pagellm.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizedWeight,
    drop_params,
    replace_param,
)
from pagellm.quantization.cpu_int import (
    FloatToIntMethod,
    float_weight_to_int,
    int4_fits,
    int4_weight,
)

Q = GGMLQuantizationType
EXACT_INT4 = (Q.Q4_0, Q.Q4_1)
FOUR_BIT = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
UNQUANTIZED = (Q.F32, Q.F16, Q.BF16, Q.F64)


class GGUFBlocksMethod(LinearMethod):
    """Q4_0 / Q4_1 blocks loaded as bytes, packed for the int4 kernel after loading."""

    def __init__(self, qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
        self.qtype = qtype
        self.dtype = dtype  # the model's: the dense copy's

    def create_weights(self, layer) -> None:
        row_bytes = layer.in_features // 32 * block_bytes(self.qtype)
        replace_param(layer, "weight", (layer.out_features, row_bytes), torch.uint8)

    def process_weights_after_loading(self, layer) -> None:
        # raw: [N, K / 32 * bytes], Q/K rows already in HF order
        n, k = layer.out_features, layer.in_features
        blocks = layer.weight.detach().reshape(-1, block_bytes(self.qtype))
        q, d, m = q4_parts(blocks, self.qtype)
        dense = decode_blocks(blocks, self.qtype).view(n, k)  # exactly the dequantized path's
        q, scale, low = q.view(n, k).to(torch.int32), d.view(n, k // 32), m.view(n, k // 32)
        layer.packed_weight = int4_weight(q, scale, low, dense.to(self.dtype))
        drop_params(layer, "weight")


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, gguf: GGUFFile, dtype: torch.dtype) -> None:
        self.dtype = dtype
        # HF name -> GGUF tensor, for every tensor of the file
        self.tensors = {hf_name(n): t for n, t in gguf.tensors.items() if n != "rope_freqs.weight"}
        self.raw_names: set[str] = set()  # loaded as blocks (see gguf_weights)

    @classmethod
    def from_model(cls, model_config, device: torch.device) -> GGUFConfig:
        return cls(read_gguf(model_config.source.path), model_config.dtype)

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        names = checkpoint_names(prefix, layer)
        tensors = [self.tensors[n] for n in names if n in self.tensors]
        qtypes = {t.qtype for t in tensors}
        if len(tensors) != len(names) or qtypes <= set(UNQUANTIZED):
            return None
        if len(qtypes) == 1 and qtypes <= set(EXACT_INT4) and int4_fits(layer.in_features):
            self.raw_names.update(names)
            return GGUFBlocksMethod(qtypes.pop(), self.dtype)
        four_bit = qtypes <= set(FOUR_BIT) and int4_fits(layer.in_features)
        return FloatToIntMethod(4 if four_bit else 8)

    def tied_head_weight(self, embedding: torch.Tensor) -> QuantizedWeight | None:
        tensor = self.tensors.get("model.embed_tokens.weight")
        if tensor is None or tensor.qtype in UNQUANTIZED:
            return None
        four_bit = tensor.qtype in FOUR_BIT and int4_fits(embedding.shape[1])
        return float_weight_to_int(embedding.detach(), 4 if four_bit else 8)

    def describe(self) -> str:
        return f"gguf ({len(self.raw_names)} tensors as int4 blocks)"


def checkpoint_names(prefix: str, layer) -> list[str]:
    """The checkpoint weights a Linear is loaded from: one per part of a fused projection."""
    shards = getattr(layer, "shard_rows", None)
    if not shards:
        return [f"{prefix}.weight"]
    parent = prefix.rpartition(".")[0]
    return [f"{parent}.{shard}.weight" for shard in shards]
