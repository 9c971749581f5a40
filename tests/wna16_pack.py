"""Test packers: a float HF checkpoint quantized to int4 / int8 and written as AWQ (GEMM),
GPTQ (v1 / v2) or compressed-tensors pack-quantized, each from its format's own spec (not
from pagellm's reader), with the dequantized float checkpoint beside it.

    quantize_folder(folder, reference, Packing("gptq", bits=4, group=64, sym=False,
                    act_order=True))

rewrites `folder` in the format and writes `reference` with every quantized weight replaced
by (q - zero) * scale in float32: the model the quantized one must reproduce. MoE experts'
projections are packed too (each expert's own tensors, as AutoGPTQ / AutoAWQ / llm-compressor
store them); routers stay float.

GPTQ's rounding (min/max grid per group: symmetric: zero 2^(bits-1), scale 2 max|w| /
(2^bits - 1); asymmetric: scale (max - min) / (2^bits - 1), zero round(-min / scale)); scales
rounded to fp16 first, as the formats store them. Act-order: a random permutation of the
input columns is the quantization order, and input k's group is (its place in it) // group,
GPTQ's g_idx.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, replace

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "w1",
    "w2",
    "w3",
    "c_fc",
    "c_proj",
)  # fmt: skip (w*: Mixtral's experts; c_*: StarCoder2's MLP)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of an int32 holds column this


@dataclass(frozen=True)
class Packing:
    method: str  # "awq" | "gptq" | "gptq_v2" | "compressed-tensors"
    bits: int = 4
    group: int = 32  # -1: one group (GPTQ) / channel strategy (compressed-tensors)
    sym: bool = True
    act_order: bool = False
    seed: int = 0
    shared_order: bool = True  # act-order: projections of one input share it (as GPTQ's do)


def quantize(w: torch.Tensor, p: Packing) -> tuple[torch.Tensor, ...]:
    """(q int64 [N, K] unsigned, scale float32 [N, G] (fp16 values), zero int64 [N, G],
    g_idx int64 [K]) for a float weight [N, K]."""
    n, k = w.shape
    size = k if p.group == -1 else p.group
    order = torch.arange(k)
    if p.act_order:
        seed = p.seed + k + (0 if p.shared_order else n)
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // size
    groups = int(g_idx.max()) + 1
    maxq = (1 << p.bits) - 1
    scale = torch.empty(n, groups)
    zero = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if p.sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / maxq).clamp(min=1e-5).half().float()
        scale[:, g] = s
        zero[:, g] = (1 << (p.bits - 1)) if p.sym else torch.round(-lo / s).clamp(0, maxq).long()
    s_k, z_k = scale[:, g_idx], zero[:, g_idx]
    q = torch.clamp(torch.round(w / s_k) + z_k, 0, maxq).long()
    return q, scale, zero, g_idx


def dequantized(q, scale, zero, g_idx) -> torch.Tensor:
    return (q - zero[:, g_idx]).float() * scale[:, g_idx]


def pack_lsb(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C / (32 / bits)]: consecutive values along dim 1, the first in the lowest bits."""
    per = 32 // bits
    v = values.long().reshape(values.shape[0], -1, per)
    word = sum(v[..., j] << (bits * j) for j in range(per))  # 0 .. 2^32 - 1
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing: int32 [R, C / 8], nibble i holding column AWQ_PACK_ORDER[i]."""
    v = values.long().reshape(values.shape[0], -1, 8)
    return pack_lsb(v[..., list(AWQ_PACK_ORDER)].reshape(values.shape[0], -1), 4)


def format_tensors(stem: str, w: torch.Tensor, p: Packing) -> tuple[dict, torch.Tensor]:
    """(checkpoint tensors of one projection, its dequantized weight)."""
    q, scale, zero, g_idx = quantize(w, p)
    out = {}
    if p.method == "awq":
        out[f"{stem}.qweight"] = pack_awq(q.t())
        out[f"{stem}.qzeros"] = pack_awq(zero.t())
        out[f"{stem}.scales"] = scale.t().half().contiguous()
    elif p.method.startswith("gptq"):
        out[f"{stem}.qweight"] = pack_lsb(q, p.bits).t().contiguous()  # [K / per, N]
        qzeros = pack_lsb(zero.t(), p.bits)
        if p.method == "gptq":  # v1 keeps zero - 1, as GPTQModel writes it: one int32
            # subtraction of 0x11111111 (8-bit: 0x01010101) a word, so a zero of 0 borrows
            ones = sum(1 << (p.bits * i) for i in range(32 // p.bits))
            word = (qzeros.long() - ones) & 0xFFFFFFFF
            qzeros = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
        out[f"{stem}.qzeros"] = qzeros
        out[f"{stem}.scales"] = scale.t().half().contiguous()
        out[f"{stem}.g_idx"] = g_idx.to(torch.int32)
    else:
        out.update(_compressed_tensors(stem, w, q, scale, zero, g_idx, p))
    return out, dequantized(q, scale, zero, g_idx)


def _compressed_tensors(stem, w, q, scale, zero, g_idx, p) -> dict:
    """compressed-tensors' own `pack_to_int32` on its signed values (q - 2^(bits-1))."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    offset = 1 << (p.bits - 1)
    out = {
        f"{stem}.weight_packed": pack_to_int32((q - offset).to(torch.int8), p.bits),
        f"{stem}.weight_scale": scale.contiguous(),
        f"{stem}.weight_shape": torch.tensor(list(w.shape)),
    }
    if not p.sym:
        zp = (zero - offset).to(torch.int8)
        out[f"{stem}.weight_zero_point"] = pack_to_int32(zp, p.bits, packed_dim=0)
    if p.act_order:
        out[f"{stem}.weight_g_idx"] = g_idx.to(torch.int32)
    return out


def quantization_config(p: Packing) -> dict:
    if p.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": p.group, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    if p.method.startswith("gptq"):
        return {"quant_method": "gptq", "bits": p.bits, "group_size": p.group, "sym": p.sym,
                "desc_act": p.act_order, "checkpoint_format": p.method}  # fmt: skip
    weights = {"num_bits": p.bits, "type": "int", "symmetric": p.sym,
               "strategy": "channel" if p.group == -1 else "group",
               "group_size": None if p.group == -1 else p.group,
               "actorder": "group" if p.act_order else None}  # fmt: skip
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}  # fmt: skip


def quantize_folder(folder: str, reference: str, p: Packing, dynamic: dict | None = None,
                    lm_head: bool = False, groups: dict | None = None) -> None:  # fmt: skip
    """Rewrite the HF folder's projections in format `p`; write the dequantized model to
    `reference` (a copy of the folder with float weights). GPTQ only: `dynamic`, GPTQModel's
    per-module rules ({regex: settings}; the first whose regex matches a module's name from
    its start applies; "-:" leaves the module float, else bits / group_size / sym /
    desc_act replace p's), written into the config; `lm_head`: the LM head packed too.
    compressed-tensors only: `groups`, {name: (targets, Packing)} config groups in place of
    p's one (a module packed by the group whose target is its name, else a "re:" pattern
    matching it, else "Linear"; none: left float)."""
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    shutil.copytree(folder, reference, dirs_exist_ok=True)
    ref_state = dict(state)
    for name in [n for n in state if n.endswith(".weight")]:
        stem = name.removesuffix(".weight")
        leaf = stem.rpartition(".")[2]
        if leaf not in PROJECTIONS and not (lm_head and stem == "lm_head"):
            continue  # MoE experts are packed too; routers ("gate") are not
        packing = _group(groups, stem) if groups else _rule(p, dynamic or {}, stem)
        if packing is None:
            continue
        tensors, deq = format_tensors(stem, state.pop(name), packing)
        state.update({k: v.contiguous() for k, v in tensors.items()})
        ref_state[name] = deq
    save_file(state, path)
    save_file(ref_state, os.path.join(reference, "model.safetensors"))
    config_path = os.path.join(folder, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"] = quantization_config(p)
    if dynamic:
        config["quantization_config"]["dynamic"] = dynamic
    if lm_head:
        config["quantization_config"]["lm_head"] = True
    if groups:
        config["quantization_config"]["config_groups"] = {
            name: quantization_config(packing)["config_groups"]["group_0"] | {"targets": targets}
            for name, (targets, packing) in groups.items()
        }
    json.dump(config, open(config_path, "w"), indent=1)


def _group(groups: dict, module: str) -> Packing | None:
    """The packing of one module under compressed-tensors config groups."""
    by_name = lambda t: t == module  # noqa: E731
    by_regex = lambda t: t.startswith("re:") and re.match(t[3:], module)  # noqa: E731
    for matches in (by_name, by_regex, lambda t: t == "Linear"):
        for targets, packing in groups.values():
            if any(matches(t) for t in targets):
                return packing
    return None


def _rule(p: Packing, dynamic: dict, module: str) -> Packing | None:
    """The packing of one module under GPTQModel's `dynamic` rules (None: left float)."""
    for pattern, settings in dynamic.items():
        if re.match(pattern.removeprefix("-:").removeprefix("+:"), module):
            if pattern.startswith("-:"):
                return None
            fields = {"bits": "bits", "group_size": "group", "sym": "sym", "desc_act": "act_order"}
            return replace(p, **{fields[k]: v for k, v in settings.items() if k in fields})
    return p
