"""`compile_ahead`: inside the block an uncompiled Triton kernel is queued, not launched;
after it the kernel runs from its cache without compiling again; a kernel compiled before
the block launches normally inside it. Needs CUDA (nothing is compiled under the
interpreter, so the module is skipped without CUDA)."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
    # (importing triton here, before other modules set TRITON_INTERPRET, would break them)
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagellm.kernels.compile_ahead import compile_ahead  # noqa: E402


@triton.jit
def _fill_kernel(out_ptr, value, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full([BLOCK], value, tl.float32))


@pytest.mark.gpu
def test_uncompiled_kernels_are_queued_then_cached():
    device = torch.device("cuda")
    out = torch.zeros(64, device=device)
    _fill_kernel[(1,)](out, 1.0, BLOCK=32)  # compiled before the block
    compiled = []
    from triton import knobs

    other = torch.zeros(8, device=device)
    with compile_ahead(device):
        _fill_kernel[(1,)](out, 2.0, BLOCK=32)  # launches: already compiled
        _fill_kernel[(1,)](out[32:], 3.0, BLOCK=16)  # a new variant: queued, skipped
        # another thread's launches are not this block's business: compiled and run
        thread = threading.Thread(target=lambda: _fill_kernel[(1,)](other, 4.0, BLOCK=8))
        thread.start()
        thread.join()
        torch.cuda.synchronize()
        assert out[:32].eq(2.0).all() and out[32:].eq(0.0).all()
        assert other.eq(4.0).all()
    assert knobs.runtime.jit_cache_hook is None  # the hook is removed on exit
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["key"])
    try:
        _fill_kernel[(1,)](out[32:], 3.0, BLOCK=16)
    finally:
        knobs.runtime.jit_post_compile_hook = None
    torch.cuda.synchronize()
    assert out[32:48].eq(3.0).all() and out[48:].eq(0.0).all()
    assert compiled == []  # found in the kernel's cache: no compile at the launch
