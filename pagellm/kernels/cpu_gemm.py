"""CPU GEMMs: each Linear weight packed once for the library that runs it fastest here.

Which library is fastest differs between x86 machines by up to 4x, and the CPU's flags do
not tell (2 cores each, decode-sized GEMMs; docs/notes.md):

    Intel with AMX               float32: MKL            bf16: oneDNN (AMX tiles)
    Intel, AVX512-BF16, no AMX   float32: MKL            bf16: oneDNN below 8 rows, then
                                                         float32 arithmetic (1.2-1.7x)
    AMD EPYC, AVX512-BF16        float32: oneDNN (MKL    bf16: oneDNN (3-6x the float32
                                 is 2-4x slower)         arithmetic)

and our own kernels (`pagellm/kernels/panel_gemm.py`: bf16 with AVX512-BF16, float32 with
AVX-512 or AVX2 + FMA) stream a decode step's weights at about twice oneDNN's rate (the AMD
EPYC, bf16: 1.6-2x at 1-8 rows, weights read from memory; level with it or ahead up to 512
rows from cache; float32 faster still). So
`cpu_gemm_plan` times the candidates once per process on one weight of a typical shape,
and `PackedWeight` holds each weight in the layouts the plan names. A plain weight would be
re-laid for the matmul on every call, which costs 1.1-1.5x at decode batch sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm import envs
from pagellm.kernels import panel_gemm
from pagellm.kernels.panel_gemm import Panels

# name -> how the log writes it ("pagellm": our panels, `pagellm.kernels.panel_gemm`)
FP32_LIBRARIES = {"mkl": "MKL", "onednn": "oneDNN", "pagellm": "pagellm's panel kernel"}


def cpu_prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `Linear.prepack` is used: x86 CPU, float32 or bfloat16, oneDNN present."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and envs.cpu_prepack()
    )


@dataclass(frozen=True)
class CpuGemmPlan:
    """Which library runs the CPU GEMMs.

    fp32_library: "mkl" (its packed sgemm), "onednn" or "pagellm" (our panels), for float32
        weights and for bf16 weights held in float32 (below).
    bf16_fp32_from_rows: bf16 GEMMs of this many rows or more run in float32 arithmetic on
        the weight widened to float32 (exact products, float32 sums as in oneDNN's bf16
        kernel, one rounding to bf16); fewer rows stay in oneDNN's bf16 kernel, which
        streams half the bytes. None: always oneDNN bf16. Where oneDNN has no bf16 GEMM
        (CPUs without AVX-512: `onednn_bf16_supported`), every bf16 GEMM runs in float32.
    bf16_kernel: bf16 GEMMs of every size run in our AVX512-BF16 kernel (`Panels`, one
        copy of the weight) instead of the two above.
    note: how it was chosen, for the start-up log.
    """

    fp32_library: str = "mkl"
    bf16_fp32_from_rows: int | None = None
    bf16_kernel: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        if self.fp32_library not in FP32_LIBRARIES:
            raise ValueError(f"fp32_library must be one of {sorted(FP32_LIBRARIES)}")

    def setting(self) -> str:
        """The plan as PAGELLM_CPU_GEMM_PLAN takes it."""
        fields = dataclasses.asdict(self)
        del fields["note"]
        return json.dumps(fields, separators=(",", ":"))

    def describe(self, dtype: torch.dtype) -> str:
        library = FP32_LIBRARIES[self.fp32_library]
        if dtype != torch.bfloat16:
            what = f"float32 GEMMs in {library}"
        elif self.bf16_kernel:
            what = "bf16 GEMMs in pagellm's AVX512-BF16 kernel"
        elif not onednn_bf16_supported():
            what = f"bf16 GEMMs in float32 arithmetic ({library}): no bf16 GEMM on this CPU"
        elif self.bf16_fp32_from_rows is None:
            what = "bf16 GEMMs in oneDNN"
        else:
            rows = self.bf16_fp32_from_rows
            what = f"bf16 GEMMs of >= {rows} rows in float32 arithmetic ({library}), fewer oneDNN"
        return f"{what} ({self.note})" if self.note else what


class PackedWeight:
    """A Linear weight `[out, in]` re-laid once for a CPU GEMM library; `packed(x, bias)` is
    `F.linear(x, weight, bias)`. `batch_hint` is the typical number of rows it multiplies.

    One copy in our kernels' panels where the plan names them for the weight's dtype (bf16:
    with an even input size); else float32: one copy for the plan's float32 library;
    bfloat16: oneDNN's bf16 layout, and, where the plan says float32 arithmetic pays from
    some row count, also a float32 copy (then the weight takes 3x its bf16 memory).
    """

    def __init__(
        self, weight: torch.Tensor, batch_hint: int, plan: CpuGemmPlan | None = None
    ) -> None:
        plan = plan or cpu_gemm_plan()
        weight = weight.detach()
        self.onednn: torch.Tensor | None = None  # oneDNN's layout in the weight's own dtype
        self.fp32: Fp32Gemm | None = None  # float32 arithmetic, from `fp32_from_rows` rows
        self.fp32_from_rows = 0
        self.panels: Panels | None = None  # our kernels' layout, in the weight's dtype
        if weight.dtype == torch.float32:
            if plan.fp32_library == "pagellm":
                self.panels = Panels(weight)
            else:
                self.fp32 = Fp32Gemm(weight, plan.fp32_library, batch_hint)
            return
        if plan.bf16_kernel and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
            self.panels = Panels(weight)
            return
        from_rows = plan.bf16_fp32_from_rows
        if weight.dtype == torch.bfloat16 and not onednn_bf16_supported():
            from_rows = 0  # no bf16 GEMM in oneDNN here (AVX2): all in float32 arithmetic
        if weight.dtype != torch.bfloat16 or from_rows != 0:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        if weight.dtype == torch.bfloat16 and from_rows is not None:
            self.fp32 = Fp32Gemm(weight.float(), plan.fp32_library, batch_hint)
            self.fp32_from_rows = from_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.panels is not None:
            return self.panels(x, bias)
        rows = x.numel() // x.shape[-1]
        if self.fp32 is None or rows < self.fp32_from_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        if x.dtype != torch.float32:  # a bf16 weight held in float32 too (see the class doc)
            bias = None if bias is None else bias.float()
            return self.fp32(x.float(), bias, rows).to(x.dtype)
        return self.fp32(x, bias, rows)


class Fp32Gemm:
    """A float32 weight packed for MKL's sgemm or oneDNN; `gemm(x, bias, rows)`."""

    def __init__(self, weight: torch.Tensor, library: str, batch_hint: int) -> None:
        self.library = library
        self.panels: Panels | None = None
        if library == "pagellm":
            self.panels = Panels(weight)
        elif library == "mkl":
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, batch_hint)
            # the op reads only sizes and dtype from this: a zero-stride stand-in, no memory
            self.sizes = torch.zeros((), dtype=weight.dtype).expand(weight.shape)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        if self.panels is not None:
            return self.panels(x, bias)
        if self.library == "mkl":
            # told that the batch is the packed one, the op always takes the packed path
            return torch.ops.mkl._mkl_linear(x, self.packed, self.sizes, bias, rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


# -- choosing the plan ------------------------------------------------------------------------

CALIBRATION_SHAPE = (2048, 1024)  # [out, in]: an MLP projection of a small model
FP32_ROWS = (1, 8, 32)  # decode batch sizes: the library that wins over these
BF16_ROWS = (8, 32)  # the row counts from which float32 arithmetic may start
FP32_FROM_ROWS = BF16_ROWS[0]  # where PAGELLM_CPU_BF16_FP32_GEMM=1 starts float32 arithmetic
MARGIN = 1.15  # leave the default only for a clear win (noise must not flip the choice)


@functools.cache
def cpu_gemm_plan() -> CpuGemmPlan:
    """The plan for this process: PAGELLM_CPU_GEMM_PLAN where set; else PAGELLM_CPU_FP32_GEMM /
    PAGELLM_CPU_BF16_FP32_GEMM / PAGELLM_CPU_BF16_KERNEL where set, the rest timed here once
    (~50 ms)."""
    whole = envs.cpu_gemm_plan()
    if whole is not None:
        return CpuGemmPlan(**whole, note="set by PAGELLM_CPU_GEMM_PLAN")
    library = envs.cpu_fp32_gemm()
    bf16_fp32 = envs.cpu_bf16_fp32_gemm()
    kernel = envs.cpu_bf16_kernel()
    if kernel is not False and (bf16_fp32 or not panel_gemm.supported()):
        kernel = False
    mkl_ok = mkl_packing_is_batch_independent()
    if library == "mkl" and not mkl_ok:
        library = "onednn"
    if library == "pagellm" and not panel_gemm.supported(torch.float32):
        library = "onednn"
    if not onednn_bf16_supported():
        bf16_fp32 = bf16_fp32 if bf16_fp32 is not None else True  # nothing to time it against
    times = time_candidates(
        fp32=library is None and mkl_ok, bf16=bf16_fp32 is None or kernel is None,
        library=library, kernel=kernel is None,
    )  # fmt: skip
    return choose_plan(times, library or ("mkl" if mkl_ok else "onednn"), bf16_fp32, kernel)


def chosen_plan_setting() -> str | None:
    """This process's plan as PAGELLM_CPU_GEMM_PLAN takes it, if it has chosen one."""
    return cpu_gemm_plan().setting() if cpu_gemm_plan.cache_info().currsize else None


def choose_plan(
    times: dict[tuple[str, int], float],
    library: str,
    bf16_fp32: bool | None,
    bf16_kernel: bool | None = False,
) -> CpuGemmPlan:
    """The plan from `time_candidates`' timings (us; keys (candidate, rows)). `library` is the
    float32 library when the timings have no ("onednn", rows) entries; `bf16_fp32` forces
    float32 arithmetic for bf16 (from FP32_FROM_ROWS rows) or forbids it; `bf16_kernel`
    forces our bf16 kernel or forbids it; None (either): timed.

    Our kernel is taken unless it is clearly slower on the timing weight, which stays in
    cache: at decode sizes the weights come from memory, which it reads faster."""
    notes = []
    if ("onednn", FP32_ROWS[0]) in times:  # MKL against oneDNN on float32
        ratio = _geomean([times["mkl", r] / times["onednn", r] for r in FP32_ROWS])
        library = "onednn" if ratio > MARGIN else "mkl"
        notes.append(f"float32: MKL {ratio:.2f}x oneDNN's time")
        if ("pagellm", FP32_ROWS[0]) in times:  # ours, unless clearly slower (see above)
            ours = _geomean([times["pagellm", r] / times[library, r] for r in FP32_ROWS])
            notes.append(f"our kernel {ours:.2f}x {FP32_LIBRARIES[library]}'s")
            library = "pagellm" if ours <= MARGIN else library
    if bf16_kernel is None and ("bf16_kernel", BF16_ROWS[0]) in times:
        best = [min(times["bf16", r], times["bf16_in_fp32", r]) for r in BF16_ROWS]
        ratio = _geomean([times["bf16_kernel", r] / b for r, b in zip(BF16_ROWS, best)])
        bf16_kernel = ratio <= MARGIN
        notes.append(f"bf16: our kernel {ratio:.2f}x the best oneDNN path's time")
    from_rows = FP32_FROM_ROWS if bf16_fp32 else None
    if bf16_fp32 is None and not bf16_kernel:
        wins = [times["bf16", r] > MARGIN * times["bf16_in_fp32", r] for r in BF16_ROWS]
        for i, rows in enumerate(BF16_ROWS):  # the first row count from which it always wins
            if all(wins[i:]):
                from_rows = rows
                break
        ratio = times["bf16", BF16_ROWS[-1]] / times["bf16_in_fp32", BF16_ROWS[-1]]
        notes.append(f"bf16 at {BF16_ROWS[-1]} rows: oneDNN bf16 {ratio:.2f}x float32's time")
    if bf16_kernel:
        from_rows = None
    note = "timed at start-up: " + "; ".join(notes) if notes else "set by PAGELLM_CPU_*"
    return CpuGemmPlan(library, from_rows, bool(bf16_kernel), note)


def time_candidates(
    fp32: bool, bf16: bool, library: str | None, kernel: bool = False
) -> dict[tuple[str, int], float]:
    """Microseconds per GEMM on CALIBRATION_SHAPE: ("mkl" | "onednn", rows) for float32 when
    `fp32`; ("bf16", rows) for oneDNN's bf16 kernel and ("bf16_in_fp32", rows) for the same
    weight in float32 arithmetic (through `library`, or the float32 winner) when `bf16`;
    ("bf16_kernel", rows) for ours when `kernel` too."""
    times: dict[tuple[str, int], float] = {}
    if not (fp32 or bf16):
        return times
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*CALIBRATION_SHAPE, generator=gen) * 0.02
    xs = {r: torch.randn(r, CALIBRATION_SHAPE[1], generator=gen) for r in (*FP32_ROWS, *BF16_ROWS)}
    if fp32:
        for lib in FP32_LIBRARIES:
            if lib == "pagellm" and not panel_gemm.supported(torch.float32):
                continue
            gemm = Fp32Gemm(weight, lib, 32)
            for r in FP32_ROWS:
                times[lib, r] = _best_us(gemm, xs[r], None, r)
        library = choose_plan(times, "mkl", False).fp32_library
    if bf16:
        library = library or "onednn"
        plain = PackedWeight(weight.bfloat16(), 32, CpuGemmPlan(library))
        wide = PackedWeight(weight.bfloat16(), 32, CpuGemmPlan(library, bf16_fp32_from_rows=1))
        ours = Panels(weight.bfloat16()) if kernel else None
        for r in BF16_ROWS:
            x = xs[r].bfloat16()
            times["bf16", r] = _best_us(plain, x)
            times["bf16_in_fp32", r] = _best_us(wide, x)
            if kernel:
                times["bf16_kernel", r] = _best_us(ours, x)
    return times


def _best_us(fn, *args, warmup: int = 2, reps: int = 5) -> float:
    """The fastest of `reps` calls `fn(*args)` (the least disturbed by other work), in us."""
    for _ in range(warmup):
        fn(*args)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def _geomean(values: list[float]) -> float:
    product = 1.0
    for v in values:
        product *= v
    return product ** (1 / len(values))


@functools.cache
def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU (it needs AVX-512 BW/VL/DQ, AVX-NE-CONVERT
    or AMX; on an AVX2-only CPU its weight reorder raises)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


@functools.cache
def mkl_packing_is_batch_independent() -> bool:
    """Whether MKL's packed weights serve any batch size here (checked once per process).

    MKL packs a weight for a given row count, but its packed layout does not depend on it:
    one packed copy serves every batch. That is observed, not documented, so it is checked
    against F.linear on a few shapes and batch sizes; if it ever fails, oneDNN is used.
    """
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return False
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in ((96, 64), (200, 72)):
        weight = torch.randn(out_features, in_features, generator=gen)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 16)
        sizes = torch.zeros(()).expand(weight.shape)
        for rows in (1, 3, 16, 77):
            x = torch.randn(rows, in_features, generator=gen)
            got = torch.ops.mkl._mkl_linear(x, packed, sizes, None, rows)
            if not torch.allclose(got, F.linear(x, weight), rtol=1e-5, atol=1e-4):
                return False
    return True
