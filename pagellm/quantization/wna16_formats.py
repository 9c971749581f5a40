"""The int4 / int8 weight-only checkpoint formats (AWQ, GPTQ, compressed-tensors
`pack-quantized`): what their `quantization_config` says (`WNA16Scheme`) and each stored
tensor turned into one layout (`to_canonical`), the one the rest of `wna16*.py` reads.

Every format stores w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = g_idx[k] (act-order)
or k // group_size; they differ in where the integers sit:

    AWQ (GEMM)     qweight int32 [K, N / 8]   8 columns an int32 in the order 0 2 4 6 1 3 5 7
                   qzeros  int32 [G, N / 8]   the same order; zero as stored
                   scales  fp16  [G, N]
    GPTQ           qweight int32 [K / p, N]   p = 32 / bits rows an int32, lowest bits first
                   qzeros  int32 [G, N / p]   columns packed the same way; v1 ("gptq") stores
                                              zero - 1 (one int32 subtraction of 0x11111111
                                              / 0x01010101: a 0 borrows), v2 the zero itself
                   scales  fp16  [G, N];  g_idx int32 [K] (act-order when not k // group)
    compressed-    weight_packed     int32 [N, K / p]  lowest bits first, q + 2^(bits-1)
    tensors        weight_scale      [N, G] (channel strategy: [N, 1])
                   weight_zero_point int32 [ceil(N / p), G] packed along N (asymmetric
                                     only; signed, + 2^(bits-1) like q); weight_g_idx [K]
                   weight_shape      [2] = (N, K), checked and dropped

The canonical layout, one tensor a role, output rows first (so fused projections stack by
rows and tensor-parallel ranks cut rows or groups of columns like any weight):

    qweight  uint8 [N, K * bits / 8]   4-bit: byte j holds k = 2j (low nibble), 2j + 1
    scales   float32 [N, G]            G = ceil(K / group_size) (1 for group_size -1)
    zeros    uint8 [N, G]              unsigned, 0 .. 2^bits - 1 (symmetric: 2^(bits-1))
    g_idx    int32 [1, K]              act-order only
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace

import torch

logger = logging.getLogger(__name__)

FORMATS = ("awq", "gptq", "compressed-tensors")
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of an AWQ int32 is its nibble AWQ_ORDER[j]
ROLES = ("qweight", "scales", "zeros", "g_idx")
CHECKPOINT_NAMES = {  # role -> the checkpoint's parameter name, by format
    "awq": {"qweight": "qweight", "scales": "scales", "zeros": "qzeros"},
    "gptq": {"qweight": "qweight", "scales": "scales", "zeros": "qzeros", "g_idx": "g_idx"},
    "compressed-tensors": {"qweight": "weight_packed", "scales": "weight_scale",
                           "zeros": "weight_zero_point", "g_idx": "weight_g_idx"},
}  # fmt: skip


@dataclass(frozen=True)
class WNA16Scheme:
    """One checkpoint's weight quantization, as its `quantization_config` states it."""

    method: str  # "awq" | "gptq" | "compressed-tensors"
    bits: int  # 4 | 8
    group_size: int  # -1: one group over the whole input
    sym: bool  # zero points 2^(bits-1) (compressed-tensors stores none then)
    zero_minus_one: bool = False  # GPTQ v1: qzeros hold zero - 1
    ignore: tuple[str, ...] = ()  # module names or "re:" patterns left unquantized
    lm_head: bool = False  # the LM head is quantized too
    act_order: bool = False  # the checkpoint stores each input's group (g_idx)
    names: dict[str, str] = field(default_factory=dict)  # role -> checkpoint name
    # GPTQ's `dynamic` rules in order: (regex, settings replacing the config's; None: the
    # matching modules are left unquantized)
    overrides: tuple[tuple[str, dict | None], ...] = ()

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"{self.method}: {self.bits}-bit weights are not supported (4 or 8)")
        if self.group_size != -1 and (self.group_size < 1 or self.group_size % 8):
            raise ValueError(f"{self.method}: group_size {self.group_size} is not supported")

    @property
    def has_zeros(self) -> bool:
        """Whether the checkpoint stores zero points (compressed-tensors: asymmetric only)."""
        return self.method != "compressed-tensors" or not self.sym

    @property
    def offset(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def key(self) -> tuple:
        """What tells two modules' schemes apart (`for_module`)."""
        return self.bits, self.group_size, self.sym, self.act_order

    def for_module(self, module: str) -> WNA16Scheme | None:
        """One checkpoint module's scheme: the first `overrides` rule whose regex matches its
        name from the start (as vLLM and GPTQModel read `dynamic`): None where it leaves the
        module unquantized, else its settings over the config's; the config's where none
        matches."""
        for pattern, settings in self.overrides:
            if re.match(pattern, module):
                return None if settings is None else replace(self, overrides=(), **settings)
        return self

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else -(-k // self.group_size)

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size


def parse_scheme(cfg: dict) -> WNA16Scheme:
    """The scheme of an AWQ, GPTQ or compressed-tensors pack-quantized `quantization_config`
    (ValueError naming what cannot be served)."""
    method = cfg.get("quant_method")
    if method == "awq":
        return _awq(cfg)
    if method == "gptq":
        return _gptq(cfg)
    if method == "compressed-tensors":
        return _compressed_tensors(cfg)
    raise ValueError(f"quant_method {method!r} is not an int4 / int8 weight-only format")


def _awq(cfg: dict) -> WNA16Scheme:
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (only the GEMM layout)")
    if not cfg.get("zero_point", True):
        raise ValueError("AWQ without zero points (zero_point: false) is not supported")
    bits = int(cfg.get("w_bit", cfg.get("bits", 4)))
    if bits != 4:
        raise ValueError(f"AWQ {bits}-bit weights are not supported (4-bit only)")
    group = int(cfg.get("q_group_size", cfg.get("group_size", 128)))
    ignore = tuple(cfg.get("modules_to_not_convert") or ())
    return WNA16Scheme("awq", 4, group, False, ignore=ignore, names=CHECKPOINT_NAMES["awq"])


def _gptq(cfg: dict) -> WNA16Scheme:
    fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    scheme = WNA16Scheme(
        "gptq", int(cfg.get("bits", 4)), int(cfg.get("group_size", 128)),
        bool(cfg.get("sym", True)), zero_minus_one=fmt == "gptq",
        act_order=bool(cfg.get("desc_act", False)),
        ignore=tuple(cfg.get("modules_to_not_convert") or ()),
        lm_head=bool(cfg.get("lm_head", False)), names=CHECKPOINT_NAMES["gptq"],
        overrides=_dynamic(cfg.get("dynamic") or {}),
    )  # fmt: skip
    for _, settings in scheme.overrides:  # each rule's settings checked as a scheme
        if settings is not None:
            replace(scheme, overrides=(), **settings)
    return scheme


DYNAMIC_SETTINGS = {"bits": ("bits", int), "group_size": ("group_size", int),
                    "sym": ("sym", bool), "desc_act": ("act_order", bool)}  # fmt: skip


def _dynamic(rules: dict) -> tuple[tuple[str, dict | None], ...]:
    """GPTQModel's `dynamic` config ({regex: settings}) as `WNA16Scheme.overrides`: a "-:"
    prefix leaves the matching modules unquantized; "+:" (or none) replaces the config's
    bits, group_size, sym and desc_act for them (other settings, such as damp_percent, only
    mattered to the quantizer: vLLM reads these four too)."""
    if not isinstance(rules, dict):
        raise ValueError(f"GPTQ dynamic: a {{regex: settings}} object, got {rules!r}")
    out = []
    for pattern, settings in rules.items():
        regex = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        try:
            re.compile(regex)
        except re.error as exc:
            raise ValueError(f"GPTQ dynamic rule {pattern!r}: not a regex ({exc})") from None
        if pattern.startswith("-:"):
            out.append((regex, None))
            continue
        if not isinstance(settings, dict):
            raise ValueError(f"GPTQ dynamic rule {pattern!r}: settings {settings!r} are not an "
                             "object")  # fmt: skip
        out.append((regex, {DYNAMIC_SETTINGS[k][0]: DYNAMIC_SETTINGS[k][1](v)
                            for k, v in settings.items() if k in DYNAMIC_SETTINGS}))  # fmt: skip
    return tuple(out)


def _compressed_tensors(cfg: dict) -> WNA16Scheme:
    """The config groups of a pack-quantized checkpoint (several in llm-compressor's mixed
    recipes): a module takes the group whose target names it exactly, else whose "re:"
    target matches its name from the start, else the group targeting the class "Linear" (as
    compressed-tensors matches them), as `WNA16Scheme.overrides`; a module no group targets
    stays float."""
    groups = list((cfg.get("config_groups") or {}).values())
    formats = {g.get("format") or cfg.get("format") for g in groups} or {cfg.get("format")}
    if not groups or formats != {"pack-quantized"}:
        raise ValueError(
            f"compressed-tensors: config groups in format pack-quantized are supported, "
            f"got {len(groups)} group(s) in {sorted(map(str, formats))}"
        )
    ignore = tuple(cfg.get("ignore") or ())
    settings = [_ct_settings(group) for group in groups]
    targets = [tuple(group.get("targets") or ()) for group in groups]
    by_class = [i for i, t in enumerate(targets) if "Linear" in t]
    if len(by_class) > 1:
        raise ValueError("compressed-tensors: more than one config group targets 'Linear'")
    unknown = {t for ts in targets for t in ts if t != "Linear" and not t.startswith("re:")
               and not re.fullmatch(r"[\w.]+", t)}  # fmt: skip
    if unknown:
        raise ValueError(f"compressed-tensors: targets {sorted(unknown)} are neither module "
                         "names, 're:' patterns nor 'Linear'")  # fmt: skip
    base = settings[by_class[0]] if by_class else settings[0]
    overrides = [(re.escape(t) + "$", settings[i]) for i, ts in enumerate(targets) for t in ts
                 if t != "Linear" and not t.startswith("re:")]  # fmt: skip
    overrides += [(t[3:], settings[i]) for i, ts in enumerate(targets) for t in ts
                  if t.startswith("re:")]  # fmt: skip
    if overrides or not by_class:  # the rest: the "Linear" group's, else left float
        overrides.append((".*", base if by_class else None))
    scheme = WNA16Scheme(
        "compressed-tensors", **base, ignore=ignore,
        lm_head=any(_targets_lm_head(group, ignore) for group in groups),
        names=CHECKPOINT_NAMES["compressed-tensors"], overrides=tuple(overrides),
    )  # fmt: skip
    for _, each in scheme.overrides:  # each group's settings checked as a scheme
        if each is not None:
            replace(scheme, overrides=(), **each)
    return scheme


def _ct_settings(group: dict) -> dict:
    """One compressed-tensors config group's weights as `WNA16Scheme` fields."""
    w = group.get("weights") or {}
    if group.get("input_activations") or w.get("type", "int") != "int":
        raise ValueError("compressed-tensors pack-quantized: only int weights with float "
                         "activations (W4A16 / W8A16) are supported")  # fmt: skip
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported "
                         "(group, channel)")  # fmt: skip
    size = int(w.get("group_size") or 0) if strategy == "group" else -1
    if strategy == "group" and size <= 0:
        raise ValueError("compressed-tensors group strategy without a group_size")
    act_order = str(w.get("actorder")).lower() in ("group", "dynamic", "true")
    return {"bits": int(w.get("num_bits", 4)), "group_size": size,
            "sym": bool(w.get("symmetric", True)), "act_order": act_order}  # fmt: skip


def _targets_lm_head(group: dict, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors quantizes the LM head where a target names it or its class
    ("Linear") and no ignore entry does (names exactly, "re:" patterns by re.match)."""

    def names_it(entries) -> bool:
        return any(e == "lm_head" or (e.startswith("re:") and re.match(e[3:], "lm_head"))
                   for e in entries)  # fmt: skip

    targets = group.get("targets") or ()
    return (names_it(targets) or "Linear" in targets) and not names_it(ignore)


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] with 32 / bits values an int32, lowest bits first -> uint8 [R, C * 32 /
    bits] (little-endian bytes: for 4 and 8 bits this is a view and a split)."""
    raw = packed.contiguous().view(torch.uint8).reshape(packed.shape[0], -1)
    if bits == 8:
        return raw
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(raw.shape[0], -1)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [R, K] (K even) -> the canonical [R, K / 2]: low nibble first."""
    v = values.to(torch.uint8).reshape(values.shape[0], -1, 2)
    return v[..., 0] | (v[..., 1] << 4)


def unpack_canonical(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The canonical qweight [N, K * bits / 8] -> uint8 values [N, K]."""
    if bits == 8:
        return qweight
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C] -> uint8 [R, 8 C] in column order."""
    nibbles = unpack_int32(packed, 4).reshape(packed.shape[0], -1, 8)
    return nibbles[..., list(AWQ_ORDER)].reshape(packed.shape[0], -1)


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{name}: expected {what} of shape {list(shape)}, got {list(tensor.shape)} "
            f"{str(tensor.dtype).removeprefix('torch.')}"
        )


def _expect_int32(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.int32:
        raise ValueError(f"{name}: expected packed int32, got {tensor.dtype}")


def to_canonical(
    scheme: WNA16Scheme, role: str, name: str, tensor: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """A checkpoint tensor of one role for a projection of n outputs and k inputs (the
    checkpoint's full shape), in the canonical layout; ValueError naming the tensor and what
    was expected."""
    g = scheme.groups(k)
    if role == "g_idx":
        _expect(name, tensor, (k,), "int32 g_idx [K]")
        idx = tensor.to(torch.int32)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= g):
            raise ValueError(f"{name}: group indices outside 0..{g - 1}")
        return idx.reshape(1, k)
    if role == "scales":
        return _scales(scheme, name, tensor, n, g)
    if role == "qweight" or tensor.dtype != torch.int8:  # int8: unpacked zero points
        _expect_int32(name, tensor)
    if role == "qweight":
        return _qweight(scheme, name, tensor, n, k)
    return _zeros(scheme, name, tensor, n, g)


def _scales(scheme: WNA16Scheme, name: str, tensor: torch.Tensor, n: int, g: int):
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: expected float scales, got {tensor.dtype}")
    if scheme.method == "compressed-tensors":
        _expect(name, tensor, (n, g), "scales [N, G]")
        return tensor.float().contiguous()
    _expect(name, tensor, (g, n), "scales [G, N]")
    return tensor.float().t().contiguous()


def _qweight(scheme: WNA16Scheme, name: str, tensor: torch.Tensor, n: int, k: int):
    per = 32 // scheme.bits
    if scheme.method == "awq":
        _expect(name, tensor, (k, n // 8), "AWQ int32 qweight [K, N / 8]")
        values = _awq_unpack(tensor).t()
    elif scheme.method == "gptq":
        if k % per:
            raise ValueError(f"{name}: in_features {k} is not a multiple of {per}")
        _expect(name, tensor, (k // per, n), f"GPTQ int32 qweight [K / {per}, N]")
        return unpack_int32(tensor.t(), 8).contiguous()  # bytes along K: already canonical
    else:
        _expect(name, tensor, (n, -(-k // per)), f"int32 weight_packed [N, K / {per}]")
        values = unpack_int32(tensor, scheme.bits)[:, :k]
    return values.contiguous() if scheme.bits == 8 else pack_nibbles(values).contiguous()


_SYM_ZEROS_WARNED: set[tuple] = set()  # once a value set (a checkpoint's layers are alike)


def _warn_sym_zeros(name: str, found: tuple[int, ...], offset: int) -> None:
    if (found, offset) in _SYM_ZEROS_WARNED:
        return
    _SYM_ZEROS_WARNED.add((found, offset))
    logger.warning("%s (and the layers like it): sym: true, but its qzeros hold %s besides %d "
                   "(a checkpoint_format that does not match the tensors?): zero points %d "
                   "taken, as vLLM's kernels take them", name, list(found), offset,
                   offset)  # fmt: skip


def _zeros(scheme: WNA16Scheme, name: str, tensor: torch.Tensor, n: int, g: int):
    per = 32 // scheme.bits
    if scheme.method == "awq":
        _expect(name, tensor, (g, n // 8), "AWQ int32 qzeros [G, N / 8]")
        return _awq_unpack(tensor).t().contiguous()
    if scheme.method == "gptq":
        _expect(name, tensor, (g, -(-n // per)), f"GPTQ int32 qzeros [G, N / {per}]")
        if scheme.zero_minus_one:
            # v1 writers (gptqmodel's v2 -> v1) subtract 1 from every field as one int32
            # subtraction, so a zero of 0 borrows from the next field: add it back the same
            # way (gptqmodel's v1 -> v2), not field by field
            word = sum(1 << (scheme.bits * i) for i in range(per))  # 0x11111111 / 0x01010101
            summed = (tensor.to(torch.int64) + word) & 0xFFFFFFFF
            tensor = torch.where(summed >= 1 << 31, summed - (1 << 32), summed).to(torch.int32)
        zeros = unpack_int32(tensor, scheme.bits)[:, :n]
        if scheme.sym and not bool((zeros == scheme.offset).all()):
            # vLLM's kernels never read a symmetric layer's qzeros: a checkpoint_format that
            # does not match the tensors (v1 stores zero - 1) is served as vLLM serves it
            found = tuple(sorted({int(v) for v in zeros.unique()} - {scheme.offset})[:4])
            _warn_sym_zeros(name, found, scheme.offset)
            zeros = torch.full_like(zeros, scheme.offset)
        return zeros.t().contiguous()
    if tensor.dtype == torch.int8:  # unpacked signed zero points (older compressed-tensors)
        _expect(name, tensor, (n, g), "int8 weight_zero_point [N, G]")
        return (tensor.to(torch.int32) + scheme.offset).to(torch.uint8)
    _expect(name, tensor, (-(-n // per), g), f"int32 weight_zero_point [N / {per}, G]")
    return unpack_int32(tensor.t(), scheme.bits)[:, :n].t().contiguous()


def dequantize(
    qweight: torch.Tensor,  # [N, K * bits / 8] uint8, canonical
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor,  # [N, G] uint8
    bits: int,
    group: int,  # inputs a group (the last may be short)
    g_idx: torch.Tensor | None = None,  # [K] group of each input column (act-order)
) -> torch.Tensor:
    """float32 [N, K]: w = (q - zero) * scale, each column's group from `g_idx` or, without
    it, k // group (the reference every kernel is tested against)."""
    q = unpack_canonical(qweight, bits)
    if g_idx is None:
        g_idx = torch.arange(q.shape[1], device=q.device) // group
    g_idx = g_idx.long()
    return (q.float() - zeros[:, g_idx].float()) * scales[:, g_idx].float()


def sort_groups(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The permutation of the input columns that makes act-order groups contiguous and whole
    (group j at columns j * group ..), or None where sorting cannot (a rank holding parts of
    groups)."""
    perm = torch.argsort(g_idx.long(), stable=True)
    expected = torch.arange(g_idx.numel(), device=g_idx.device) // group
    return perm if torch.equal(g_idx.long()[perm], expected) else None


def permute_columns(qweight: torch.Tensor, bits: int, perm: torch.Tensor) -> torch.Tensor:
    """The canonical qweight with its input columns taken in `perm` order."""
    values = unpack_canonical(qweight, bits)[:, perm]
    return values.contiguous() if bits == 8 else pack_nibbles(values).contiguous()


def unpermuted(dense: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """A weight [N, K] whose column j is checkpoint column perm[j], back in checkpoint order."""
    if perm is None:
        return dense
    return torch.empty_like(dense).index_copy_(1, perm, dense)


def default_config(method: str) -> dict:
    """The `quantization_config` most checkpoints of `method` carry (4-bit, groups of 128;
    GPTQ symmetric without act-order, AWQ with zero points, compressed-tensors W4A16
    symmetric): what `load_format="dummy"` draws random int weights for."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                "desc_act": False, "checkpoint_format": "gptq"}  # fmt: skip
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 128}  # fmt: skip
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}  # fmt: skip


def random_canonical(
    scheme: WNA16Scheme, role: str, n: int, k: int, std: float, generator: torch.Generator
) -> torch.Tensor:
    """Random weights at a projection's canonical shapes (n outputs, k inputs, on the
    generator's device): uniform integers, zero points in the middle of their range, scales
    that give the dequantized weight about `std` (a uniform 4-bit q has a standard deviation
    of ~4.6, an 8-bit one ~74); act-order groups in order."""
    device = generator.device
    g = scheme.groups(k)
    if role == "qweight":
        shape = (n, k * scheme.bits // 8)
        return torch.randint(0, 256, shape, generator=generator, device=device, dtype=torch.uint8)
    if role == "scales":
        q_std = ((1 << (2 * scheme.bits)) - 1) ** 0.5 / 12**0.5
        jitter = torch.rand((n, g), generator=generator, device=device) + 0.5
        return (jitter * (std / q_std)).half().float()  # fp16 values, as checkpoints store
    if role == "zeros":
        return torch.full((n, g), scheme.offset, dtype=torch.uint8, device=device)
    group = scheme.group(k)
    return (torch.arange(k, device=device, dtype=torch.int32) // group).reshape(1, k)
