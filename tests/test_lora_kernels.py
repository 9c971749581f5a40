"""The multi-LoRA shrink / expand Triton kernels (`pagellm/kernels/lora.py`) against torch:
under Triton's interpreter on tiny shapes without CUDA; the `gpu`-marked test adds bf16,
a layer's delta as `LoRASlots` computes it on CUDA, and a CUDA-graph replay with another
mix of adapters."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from test_kernels import _patch_interpreter_for_numpy_2_4

    _patch_interpreter_for_numpy_2_4()  # the shrink loops to a runtime bound

from pagellm.kernels.lora import lora_expand, lora_shrink, rows_by_slot  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x, a, b, slots, scales, out, col0):
    """The delta row by row in float32: out[t, col0:col0+N] += x[t] @ A^T @ B^T * scale."""
    expected = out.clone().float()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            h = (x[t].float() @ a[s].float().T) * scales[s]
            expected[t, col0 : col0 + b.shape[1]] += h @ b[s].float().T
    return expected


def _case(t, k, r, n, num_slots, dtype, seed=0, col0=3, extra=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(DEVICE, dtype)
    a = torch.randn(num_slots, r, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(num_slots, n, r, generator=gen).to(DEVICE, dtype)
    slots = torch.randint(-1, num_slots, (t,), generator=gen).to(DEVICE, torch.int32)
    scales = (torch.rand(num_slots, generator=gen) + 0.5).to(DEVICE)
    out = torch.randn(t, col0 + n + extra, generator=gen).to(DEVICE, dtype)
    return x, a, b, slots, scales, out, col0


CASES = [(37, 48, 8, 40), (5, 32, 16, 70), (1, 20, 4, 9), (40, 600, 16, 33)]  # (T, in, R, N)
# (the last: a shrink of three K steps, the last one partial)


def test_rows_by_slot_groups_rows_in_order():
    rows, starts = rows_by_slot(np.array([2, -1, 0, 2, 0, -1, 2]), 4)
    assert rows.tolist() == [2, 4, 0, 3, 6, -1, -1]  # slot 0's rows, slot 2's, then none
    assert starts.tolist() == [0, 2, 2, 5, 5]
    assert rows.dtype == starts.dtype == np.int32
    rows, starts = rows_by_slot(np.full(3, -1), 2)  # no row has an adapter
    assert rows.tolist() == [-1, -1, -1] and starts.tolist() == [0, 0, 0]


def check_case(t, k, r, n, dtype) -> None:
    x, a, b, slots, scales, out, col0 = _case(t, k, r, n, 3, dtype)
    expected = _reference(x, a, b, slots, scales, out, col0)
    before = out.clone()
    rows, starts = (torch.from_numpy(v).to(DEVICE) for v in rows_by_slot(slots.cpu().numpy(), 3))
    h = lora_shrink(x, a, rows, starts, scales)
    lora_expand(h, b, rows, starts, out, col0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol * 10, rtol=tol)
    untouched = slots < 0
    assert torch.equal(out[untouched], before[untouched])  # rows without an adapter
    assert torch.equal(out[:, :col0], before[:, :col0])  # columns of other parts
    assert torch.equal(out[:, col0 + n :], before[:, col0 + n :])


def check_fused_parts(ends, r, dtype) -> None:
    """A fused projection's parts (q | k | v) in one shrink and one expand: A stacked along the
    rank, B along the columns, part boundaries inside a block of columns; ranks above 64
    (more shrink programs, more expand steps)."""
    gen = torch.Generator().manual_seed(len(ends) * 100 + r)
    t, k, n, num_slots = 29, 40, ends[-1], 3
    x = torch.randn(t, k, generator=gen).to(DEVICE, dtype)
    a = torch.randn(num_slots, len(ends) * r, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(num_slots, n, r, generator=gen).to(DEVICE, dtype)
    slots = torch.randint(-1, num_slots, (t,), generator=gen).to(DEVICE, torch.int32)
    scales = (torch.rand(num_slots, generator=gen) + 0.5).to(DEVICE)
    out = torch.randn(t, n, generator=gen).to(DEVICE, dtype)
    expected = out.clone().float()
    for p, (lo, hi) in enumerate(zip((0,) + tuple(ends[:-1]), ends)):
        part = _reference(x, a[:, p * r : (p + 1) * r], b[:, lo:hi], slots, scales,
                          torch.zeros(t, hi - lo, device=DEVICE), 0)  # fmt: skip
        expected[:, lo:hi] += part
    rows, starts = (torch.from_numpy(v).to(DEVICE) for v in rows_by_slot(slots.cpu().numpy(), 3))
    h = lora_shrink(x, a, rows, starts, scales)
    lora_expand(h, b, rows, starts, out, 0, tuple(ends))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol * 10, rtol=tol)


def check_step_buffers() -> None:
    """The kernels on a `LoRAStep`'s engine-lifetime buffers as a CUDA step fills them (rows
    grouped by slot, starts and scales in one copy each), two steps in a row: the second's
    rows overwrite the first's; padding rows (a graph's) have no slot."""
    from pagellm.lora.layers import LoRAStep

    step = LoRAStep(max_tokens=64)
    for seed in (4, 5):
        x, a, b, slots, scales, out, col0 = _case(37, 40, 8, 24, 3, torch.float32, seed=seed)
        step._set_device_rows(slots.numpy(), scales.tolist(), torch.device("cpu"), 40)
        assert step.num_rows == 40 and step.rows.shape == (64,) and step.starts.shape == (4,)
        expected = _reference(x, a, b, slots, scales, out, col0)
        h = lora_shrink(x, a, step.rows, step.starts, step.scales)
        lora_expand(h, b, step.rows, step.starts, out, col0)
        torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-4)


def check_all() -> None:
    for case, dtype in itertools.product(CASES, (torch.float32, torch.float16)):
        check_case(*case, dtype)
    for ends, r, dtype in (((17, 29, 40), 8, torch.float32), ((70, 96), 80, torch.float16),
                           ((64, 80, 96), 16, torch.float16)):  # fmt: skip
        check_fused_parts(ends, r, dtype)
    check_step_buffers()


def test_shrink_expand_equal_torch():
    """Every case; under the interpreter in a fresh process: an engine test run before it in
    the same session leaves Triton's interpreter unable to call `tl.zeros` (seen with
    Triton 3.6 after tests/test_lora.py)."""
    if DEVICE == "cuda":
        check_all()
        return
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
    code += "import test_lora_kernels as t; t.check_all()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lora_slots_on_cuda_and_in_a_cuda_graph():
    """A q | k | v layer's delta from `LoRASlots` (the kernels) equals its CPU path (grouped
    torch matmuls), float32 weights (TF32 dots) at Llama-8B widths; then captured in a CUDA
    graph and replayed with another slot per row."""
    from pagellm.lora.layers import LoRASlots, LoRAStep

    parts = {"q_proj": (0, 4096), "k_proj": (4096, 5120), "v_proj": (5120, 6144)}
    gen = torch.Generator().manual_seed(1)
    layers = {}
    for device in ("cpu", "cuda"):
        slots = LoRASlots(4096, parts, 4, 16, LoRAStep(), torch.device(device), torch.float32)
        for slot, rank in enumerate((16, 8, 4, 16)):
            for name, (lo, hi) in parts.items():
                g = torch.Generator().manual_seed(slot * 7 + lo)
                a = torch.randn(rank, 4096, generator=g) * 0.05
                b = torch.randn(hi - lo, rank, generator=g) * 0.05
                slots.set_part(slot, name, a.to(device), b.to(device))
        layers[device] = slots
    x = torch.randn(64, 4096, generator=gen)
    row_slots = torch.randint(-1, 4, (64,), generator=gen)
    for device, slots in layers.items():
        slots.step.set_rows(row_slots.numpy(), [1.0, 2.0, 0.5, 1.5], [16, 8, 4, 16],
                            torch.device(device))  # fmt: skip
    base = torch.randn(64, 6144, generator=gen)
    cpu = layers["cpu"](x, base.clone())
    cuda_layer = layers["cuda"]
    got = cuda_layer(x.cuda(), base.cuda())
    torch.testing.assert_close(got.cpu(), cpu, atol=3e-2, rtol=1e-2)
    static_x, static_out = x.cuda(), base.cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_layer(static_x, static_out)
    other = torch.randint(-1, 4, (64,), generator=gen)
    cuda_layer.step.set_rows(other.numpy(), [1.0, 2.0, 0.5, 1.5], [16, 8, 4, 16],
                             torch.device("cuda"))  # fmt: skip
    layers["cpu"].step.set_rows(other.numpy(), [1.0, 2.0, 0.5, 1.5], [16, 8, 4, 16],
                                torch.device("cpu"))  # fmt: skip
    static_out.copy_(base.cuda())
    graph.replay()
    torch.testing.assert_close(
        static_out.cpu(), layers["cpu"](x, base.clone()), atol=3e-2, rtol=1e-2
    )
