"""A Llama-family decoder's layers in one C++ call per step on the CPU
(`pagellm/csrc/cpu_decoder.cpp`).

The layers' own forward makes ~10 Python-level calls a layer (module calls, argument checks,
allocations, ctypes); at a decode step of a small model on a 2-core machine those cost about
as much as the GEMMs themselves. `CpuDecoder` runs the same kernels in the same order on the
same buffers from C++ (the C++ loop calls their entry points through pointers), so its
results are the layer-by-layer path's bit for bit; the tests hold it to that.

It serves what those kernels cover, checked once per model (`CpuDecoder.build`): bf16
weights in our bf16 kernel's panels (`pagellm.kernels.panel_gemm`), RMSNorms, SiLU-and-mul,
full rotary, optional q/k norms (Qwen3), biases, sliding windows, one tensor-parallel rank;
and per step (`runs`): a bf16 KV cache read in place by the paged kernel. Anything else
(float32, fp8 caches, quantized layers, soft-caps, other layer classes) takes the Python
layers. PAGELLM_CPU_DECODER_LOOP=0 turns it off.

LoRA adapters (`pagellm.lora`): a step with adapter rows stays in the loop, which adds each
projection's deltas through the entry point the layers' `LoRASlots` call
(`pagellm.kernels.lora_cpu`), on the step's rows grouped by slot (`LoRAStep`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch

from pagellm import cpp_build, envs
from pagellm.attention import cpu_decode
from pagellm.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from pagellm.kernels import cpu_fused, lora_cpu, panel_gemm
from pagellm.kernels.cpu_gemm import PackedWeight
from pagellm.layers.activation import SiluAndMul
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.mlp import GatedMLP
from pagellm.quantization import gguf_kernel
from pagellm.quantization.gguf_cpu import GGUFBlockWeight
from pagellm.quantization.gguf_kernel import BlockPlanes

logger = logging.getLogger(__name__)

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Fns(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("rms_norm", "rotary", "silu_and_mul", "gemm", "gemm_f32",
                                    "block_gemm", "attention")]  # fmt: skip


class _Dims(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                    "block_size", "kind")]  # fmt: skip
    _fields_ += [("eps", _F), ("scale", _F)]


class _Gemm(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("panels", "qs", "d", "m")] + [
        ("block_kind", _I64), ("block_rows", _I64), ("bias", _P), ("perm", _P)
    ]  # fmt: skip


_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Layer(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("input_norm", "post_norm", "q_norm", "k_norm", "k_cache",
                                  "v_cache")] + [("window", _I64)] + [
        (n, _Gemm) for n in _PROJECTIONS
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _I64)] + [
        (n, _P) for n in ("x", "res", "normed", "qkv", "qk", "attn", "gate_up", "act",
                          "cos_sin", "slots", "block_table")
    ] + [("block_table_stride", _I64)] + [(n, _P) for n in ("rows", "reqs", "lens")] + [
        ("num_rows", _I64), ("lora", _P)
    ]  # fmt: skip


class _Lora(ctypes.Structure):  # a step's adapter rows, as lora_cpu.cpp takes them
    _fields_ = [("add", _P), ("parts", _P), ("max_rank", _I64), ("rows", _P), ("groups", _P),
                ("num_groups", _I64)]  # fmt: skip


_LORA_PARTS = 3  # a projection's part entries in the loop's array (q | k | v at most)


@functools.cache
def _entry():
    """`pagellm_decoder_layers` and the kernels' entry points, or None where one it always
    needs is missing (the bf16 and GGUF GEMMs are each optional: a model needs one)."""
    if not envs.cpu_decoder_loop() or not cpu_fused.available():
        return None
    attention = cpu_decode.kernel()
    if attention is None:
        return None
    args = [ctypes.POINTER(_Fns), ctypes.POINTER(_Dims), ctypes.POINTER(_Layer), _I64]
    run = cpp_build.entry_point(
        "cpu_decoder", "pagellm_decoder_layers", [*args, ctypes.POINTER(_Step)], ctypes.c_int,
        "the decoder layers run one by one",
    )  # fmt: skip
    if run is None:
        return None
    lib = cpu_fused._library()
    gemm = panel_gemm.kernel() if panel_gemm.supported() else None
    gemm_f32 = panel_gemm.kernel(torch.float32) if panel_gemm.supported(torch.float32) else None
    blocks = gguf_kernel.kernel() if gguf_kernel.supported() else None
    ptrs = [lib.pagellm_rms_norm, lib.pagellm_rotary, lib.pagellm_silu_and_mul, gemm, gemm_f32]
    ptrs.append(blocks)
    ptrs.append(attention)
    return run, _Fns(*(None if p is None else ctypes.cast(p, _P).value for p in ptrs))


_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_UNLIMITED = 1 << 62


class CpuDecoder:
    """The layers of one `LlamaModel` as one C++ call a step; `build` says whether it can."""

    def __init__(self, model, run, fns: _Fns) -> None:
        self.model = model
        self.run, self.fns = run, fns
        first = model.layers[0]
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = (
            attn.num_heads, attn.num_kv_heads, attn.head_dim
        )  # fmt: skip
        self.hidden = first.input_layernorm.weight.shape[0]
        self.intermediate = first.mlp.down_proj.in_features
        self.eps = first.input_layernorm.eps
        self.scale = attn.attn.impl.scale
        self.dtype = first.input_layernorm.weight.dtype
        linears = [lin for layer in model.layers for lin in _linears(layer)]
        # a step of T rows runs here if every projection has a layout for it: GGUF blocks up
        # to their row limit, our kernels' panels beyond
        blocks = [_blocks(lin, self.dtype) for lin in linears]
        self.block_rows = min((rows for _, rows in blocks), default=0)  # all through blocks
        without_panels = [rows for (_, rows), lin in zip(blocks, linears, strict=True)
                          if _panels(lin, self.dtype) is None]  # fmt: skip
        self.panel_rows_limit = min(without_panels, default=_UNLIMITED)
        self._float_biases: list[torch.Tensor] = []  # kept alive: the layers point at them
        self._layers: ctypes.Array | None = None
        self._cache_ptrs: tuple[int, ...] = ()
        self._dims: _Dims | None = None
        self._lora: tuple | None = None  # (adapter parts, LoRAStep), on the first step

    @classmethod
    def build(cls, model, layer_cls: type) -> CpuDecoder | None:
        """A decoder for `model` (a LlamaModel with its weights packed) whose layers are all
        `layer_cls` (Llama's own, not a family's subclass) with a `GatedMLP`, or None where a
        layer needs something the C++ loop does not do."""

        entry = _entry()
        if entry is None or not model.layers:
            return None
        fns = entry[1]
        layers = list(model.layers)
        kinds = {(type(layer), type(layer.mlp)) for layer in layers}
        if kinds != {(layer_cls, GatedMLP)}:
            return None  # OLMo 2's layers, MoE blocks, or another model's own layers
        first = layers[0]
        eps, dtype = first.input_layernorm.eps, first.input_layernorm.weight.dtype
        gemm = fns.gemm if dtype == torch.bfloat16 else fns.gemm_f32
        head_dim = first.self_attn.head_dim
        if model.rotary_emb.cos_sin.shape[-1] != head_dim or dtype not in _KINDS:
            return None  # partial rotary, or a dtype the kernels do not take
        for layer in layers:
            attn = layer.self_attn
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [attn.q_norm, attn.k_norm] if attn.qk_norm else []
            impl = attn.attn.impl
            blocks = fns.block_gemm
            layouts = [
                (_panels(lin, dtype) is not None and gemm, _blocks(lin, dtype)[1] and blocks)
                for lin in _linears(layer)
            ]
            if (
                not attn.rotary  # a NoPE layer: the loop rotates every layer
                or type(layer.mlp.act_fn) is not SiluAndMul
                or any(type(n) is not RMSNorm or n.eps != eps for n in norms)
                or any(n.weight.dtype != dtype for n in norms)
                or not isinstance(impl, TorchAttentionBackend)
                or not impl.in_place
                or impl.logits_soft_cap is not None
                or attn.attn.sinks is not None  # gpt-oss: the loop has no sinks
                or impl.scale != first.self_attn.attn.impl.scale
                or attn.o_proj.reduce
                or not all(panels or blocks for panels, blocks in layouts)
            ):
                return None
        decoder = cls(model, *entry)
        logger.info("decoder layers: one C++ call a step (%s)", decoder.describe())
        return decoder

    def describe(self) -> str:
        """Which GEMMs the loop runs, for the start-up log."""
        kind = "float32" if self.dtype == torch.float32 else "bf16"
        if self.block_rows and self.panel_rows_limit >= _UNLIMITED:
            gemms = f"GGUF blocks up to {self.block_rows} rows, our kernel's panels beyond"
        elif self.block_rows:
            gemms = f"GGUF blocks; steps of more than {self.block_rows} rows take the layers"
        else:
            gemms = "our kernel's panels"
        return f"{kind}, {gemms}"

    def runs(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor], metadata: Any) -> bool:
        """Whether this step can take the C++ loop: the model's dtype on the CPU, a cache of
        it (never fp8, so no KV scales to compute), every row of the flat batch a real token,
        a GEMM layout for its rows in every projection."""
        t = hidden.shape[0]
        return (
            t <= self.panel_rows_limit
            and hidden.dtype == self.dtype
            and hidden.device.type == "cpu"
            and isinstance(metadata, TorchAttentionMetadata)
            and metadata.num_actual_tokens == t
            and kv_caches[0].dtype == self.dtype
            and self._lora_args() is not False
        )

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the embeddings
        cos_sin: torch.Tensor,  # [T, 1, D]
        kv_caches: list[torch.Tensor],  # [2, blocks, block_size, H_kv, D] per layer
        metadata: TorchAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (last layer's output, residual stream)
        t = hidden.shape[0]
        layers = self._layer_array(kv_caches)
        x = hidden.clone(memory_format=torch.contiguous_format)  # written layer by layer
        h, d = self.num_heads, self.head_dim
        kv, inter = self.num_kv_heads, self.intermediate
        empty = functools.partial(torch.empty, dtype=self.dtype)
        res, normed = empty((t, self.hidden)), empty((t, self.hidden))
        qkv, qk, attn = empty((t, (h + 2 * kv) * d)), empty((t, h + kv, d)), empty((t, h, d))
        gate_up, act = empty((t, 2 * inter)), empty((t, inter))
        cos_sin = cos_sin.to(self.dtype).contiguous()
        common, rows = metadata.common, metadata.kernel_rows
        slots = metadata.slot_mapping.contiguous()
        table = common.block_table
        if slots.dtype != torch.int64 or table.dtype != torch.int32 or table.stride(1) != 1:
            raise ValueError("CpuDecoder: slots must be int64 and the block table int32 rows")
        step = _Step(
            t, x.data_ptr(), res.data_ptr(), normed.data_ptr(), qkv.data_ptr(), qk.data_ptr(),
            attn.data_ptr(), gate_up.data_ptr(), act.data_ptr(), cos_sin.data_ptr(),
            slots.data_ptr(), table.data_ptr(), table.stride(0), rows.rows.data_ptr(),
            rows.reqs.data_ptr(), rows.lens.data_ptr(), rows.rows.numel(), self._lora_args(),
        )  # fmt: skip
        if self.run(ctypes.byref(self.fns), ctypes.byref(self._dims), layers, len(layers),
                    ctypes.byref(step)):  # fmt: skip
            raise ValueError(f"CpuDecoder: a GEMM could not run a step of {t} rows")
        return x, res

    def _lora_args(self) -> int | None | bool:
        """This step's adapter rows for the loop (their address; None: none this step), or
        False where the loop cannot add them (no LoRA kernel, a projection of more parts
        than the loop keeps, adapters of another dtype)."""
        if self._lora is None:
            self._lora = self._build_lora()
        parts, step = self._lora
        if step is None or not step.groups:
            return None
        if parts is None or not lora_cpu.available():
            return False
        args = _Lora(lora_cpu.pointer(lora_cpu.entry_point()), ctypes.addressof(parts),
                     step.max_rank, step.kernel_rows.data_ptr(),
                     ctypes.addressof(step.kernel_groups), len(step.kernel_groups))  # fmt: skip
        self._lora_keep = (args, step.kernel_rows, step.kernel_groups)  # alive for the call
        return ctypes.addressof(args)

    def _build_lora(self) -> tuple[ctypes.Array | None, Any]:
        """(every projection's adapter parts, `LoRASlots.kernel_parts`, padded to 3 entries
        [layers][4][3], or None where the loop cannot take them; the `LoRAStep` the layers'
        slots share, or None without LoRA)."""
        entries, step, fits = [], None, True
        for layer in self.model.layers:
            for linear in _linears(layer):
                slots = linear.lora
                if slots is None:
                    entries += [lora_cpu.LoraPart()] * _LORA_PARTS
                    continue
                step = slots.step
                parts = slots.kernel_parts
                fits = fits and parts is not None and len(parts) <= _LORA_PARTS
                fits = fits and next(iter(slots.a.values())).dtype == self.dtype
                if fits:
                    entries += [*parts, *[lora_cpu.LoraPart()] * (_LORA_PARTS - len(parts))]
        return ((lora_cpu.LoraPart * len(entries))(*entries) if fits else None), step

    def _layer_array(self, kv_caches: list[torch.Tensor]) -> ctypes.Array:
        """The layers' pointers, built once (again if the caches move)."""
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if self._layers is not None and ptrs == self._cache_ptrs:
            return self._layers
        cache = kv_caches[0]
        for c in kv_caches:
            if c.dtype != self.dtype or not c.is_contiguous() or c.shape != cache.shape:
                raise ValueError("CpuDecoder: the KV caches must be alike and contiguous")
        self._dims = _Dims(self.hidden, self.num_heads, self.num_kv_heads, self.head_dim,
                           self.intermediate, cache.shape[2], _KINDS[self.dtype], self.eps,
                           self.scale)  # fmt: skip
        self._float_biases = []
        entries = []
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            attn = layer.self_attn
            gemms = [self._gemm(lin) for lin in _linears(layer)]
            entries.append(_Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                attn.q_norm.weight.data_ptr() if attn.qk_norm else None,
                attn.k_norm.weight.data_ptr() if attn.qk_norm else None,
                kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                attn.attn.impl.sliding_window or 0, *gemms,
            ))  # fmt: skip
        self._layers = (_Layer * len(entries))(*entries)
        self._cache_ptrs = ptrs
        return self._layers

    def _gemm(self, linear) -> _Gemm:
        panels = _panels(linear, self.dtype)
        planes, rows = _blocks(linear, self.dtype)
        bias = None
        if linear.bias is not None:
            copy = linear.bias.detach().float().contiguous()
            self._float_biases.append(copy)
            bias = copy.data_ptr()
        if planes is None:
            return _Gemm(panels.panels.data_ptr(), None, None, None, 0, 0, bias)
        kind, qs, d, m, _ = planes._args
        perm = getattr(linear.packed_weight, "perm", None)  # act-order: x gathered by it
        return _Gemm(None if panels is None else panels.panels.data_ptr(), qs, d, m, kind, rows,
                     bias, None if perm is None else perm.data_ptr())  # fmt: skip


def _linears(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _panels(linear, dtype: torch.dtype) -> panel_gemm.Panels | None:
    """The layer's weight as our kernels' panels in `dtype` (a GGUF layer's dense copy's), or
    None."""
    packed = linear.packed_weight
    if isinstance(packed, GGUFBlockWeight):  # the blocks serve up to its max_rows rows
        packed = packed.dense
    panels = packed.panels if isinstance(packed, PackedWeight) else None
    return panels if panels is not None and panels.dtype == dtype else None


def _blocks(linear, dtype: torch.dtype) -> tuple[BlockPlanes | None, int]:
    """A GGUF layer's block planes (or an int4 checkpoint's, `wna16_cpu.py`) and the most rows
    it reads them for with activations of `dtype`; (None, 0) for other layers, or where it
    never does."""
    packed = linear.packed_weight
    rows = packed.max_rows.get(dtype, 0) if isinstance(packed, GGUFBlockWeight) else 0
    return (packed.planes, rows) if rows > 0 else (None, 0)
