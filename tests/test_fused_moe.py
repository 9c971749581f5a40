"""The fused-MoE Triton kernels (routing top-k, the per-expert layout, the two grouped GEMMs, and
their int4 / int8 / fp8-weight variants) against the torch path of `pagellm/layers/moe.py`.
Without CUDA they run under Triton's interpreter on tiny shapes (fp32 and fp16); `gpu`-marked
tests add bf16 at Qwen3-30B-A3B's shapes and a CUDA-graph replay. Kernel outputs start as
`torch.empty`, so an unwritten row fails the comparison."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from test_kernels import _patch_interpreter_for_numpy_2_4

    _patch_interpreter_for_numpy_2_4()  # the GEMM loops to a runtime bound

from pagellm.kernels import fused_moe as fm  # noqa: E402
from pagellm.kernels import fused_moe_quant as fq  # noqa: E402
from pagellm.layers.moe import experts_torch, select_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
TINY = fm.MoEConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)
# the quantized experts' decode path (fused_moe_gemv.py): K steps of 32, tails masked
TINY_GEMV = fq.GemvConfig(block_n=16, block_k=32, num_warps=4)
X_DTYPE_QUANT = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _problem(t, e, h, i, dtype, top_k=2, unused_expert=True, seed=0):
    """x, w13, w2 and routing (weights, ids) from random logits; the last expert gets no
    rows when `unused_expert`."""
    x = _randn(t, h, dtype=dtype, seed=seed)
    w13 = _randn(e, 2 * i, h, dtype=dtype, seed=seed + 1, scale=h**-0.5)
    w2 = _randn(e, h, i, dtype=dtype, seed=seed + 2, scale=i**-0.5)
    logits = _randn(t, e, seed=seed + 3)
    if unused_expert:
        logits[:, -1] = -30.0
    weights, ids = select_experts(logits.cpu(), top_k, renormalize=True)
    return x, w13, w2, weights.to(DEVICE), ids.to(DEVICE)


def _close(out, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (6, 3)])
def test_topk_softmax_matches_torch(renormalize, num_experts, top_k):
    logits = _randn(7, num_experts, seed=4)
    weights, ids = fm.topk_softmax(logits, top_k, renormalize)
    ref_weights, ref_ids = select_experts(logits.cpu(), top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 9])
def test_align_groups_every_row_once_per_expert_block(num_tokens):
    e, k, block_m = 5, 2, 16
    _, _, _, _, ids = _problem(num_tokens, e, 32, 32, torch.float32)
    layout = fm.align_by_expert(ids, e, block_m)
    sorted_ids, expert_ids = layout.sorted_ids.cpu(), layout.expert_ids.cpu()
    n = num_tokens * k
    assert sorted_ids.numel() == fm.max_padded_rows(n, e, block_m)
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=e)
    assert counts[-1] == 0  # an expert with no rows gets no block
    used = int(sum(-(-c // block_m) * block_m for c in counts.tolist()))
    assert layout.num_padded.item() == used
    assert (sorted_ids[used:] == n).all() and (expert_ids[used // block_m :] >= e).all()
    rows = sorted_ids[:used].view(-1, block_m)  # one block per line
    flat_ids = ids.flatten().cpu()
    for block, expert in zip(rows, expert_ids[: used // block_m].tolist()):
        real = block[block < n]
        assert (flat_ids[real.long()] == expert).all() and (block[len(real) :] == n).all()
    assert sorted(sorted_ids[sorted_ids < n].tolist()) == list(range(n))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_experts,hidden,inter", [(1, 4, 32, 32), (5, 8, 64, 48), (13, 8, 64, 32)]
)
def test_fused_moe_matches_torch(dtype, num_tokens, num_experts, hidden, inter):
    x, w13, w2, weights, ids = _problem(num_tokens, num_experts, hidden, inter, dtype)
    out = fm.fused_moe(x, w13, w2, weights, ids, TINY)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    _close(out, experts_torch(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu()), dtype)


def test_fused_moe_default_config_and_top_one():
    """The H200 table's decode tile (BLOCK_K larger than H: masked K), top-1 routing."""
    x, w13, w2, weights, ids = _problem(3, 4, 48, 32, torch.float32, top_k=1)
    out = fm.fused_moe(x, w13, w2, weights, ids)
    _close(out, experts_torch(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu()), x.dtype)


def test_out_of_range_ids_are_skipped():
    """A dry forward (`compile_ahead`) may hand the kernels garbage ids: they are skipped,
    and the other tokens' outputs are right."""
    x, w13, w2, weights, ids = _problem(6, 4, 32, 32, torch.float32)
    bad = ids.clone()
    bad[0] = torch.tensor([-1, 99], dtype=torch.int32)
    out = fm.fused_moe(x, w13, w2, weights, bad, TINY)
    ref = experts_torch(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    _close(out[1:], ref[1:], torch.float32)


@pytest.mark.parametrize("expert", [-1, 4])
def test_blocks_of_unknown_experts_are_skipped(expert):
    """A block whose expert id is out of range writes nothing (w13 is a view of a larger
    tensor, so a read past its 4 experts would find numbers, not a fault)."""
    x = _randn(4, 32)
    w13 = _randn(6, 64, 32, seed=1)[1:5]
    sorted_ids = torch.arange(16, dtype=torch.int32, device=DEVICE)  # rows 0-7 real, then N=8
    layout = fm.ExpertLayout(
        sorted_ids.clamp(max=8),
        torch.tensor([expert], dtype=torch.int32, device=DEVICE),
        torch.tensor([16], dtype=torch.int32, device=DEVICE),
    )
    out = torch.zeros(8, 32, device=DEVICE)
    fm.moe_gemm(x, w13, out, layout, TINY, rows_per_a=2, gated=True)
    assert (out == 0).all()


def test_fused_moe_rejects_bad_inputs():
    x, w13, w2, weights, ids = _problem(2, 4, 32, 32, torch.float32)
    with pytest.raises(ValueError, match="fused_moe"):
        fm.fused_moe(x, w13, w2[:, :, :16], weights, ids)
    with pytest.raises(ValueError, match="fused_moe"):
        fm.fused_moe(x, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match="align_by_expert"):
        fm.align_by_expert(ids.long(), 4, 16)
    with pytest.raises(ValueError, match="topk_softmax"):
        fm.topk_softmax(_randn(2, 4), 5, True)


def test_choose_config_by_rows_per_expert():
    assert fm.choose_config(1, 8, 128).block_m == 16  # decode: 1/16 row per expert
    assert fm.choose_config(8192, 8, 128).block_m == 128  # prefill: 512 rows per expert
    assert fm.choose_config(256, 2, 8).block_m == 64  # Mixtral decode of 256: 64 rows


# ---- quantized experts (fused_moe_quant.py) --------------------------------------------------


def _int_stack(e, n, k, bits, group, seed):
    """(QuantizedStack of random int experts [E, N, K] in the canonical layout, float32
    dequantized weights), asymmetric: random zero points."""
    from pagellm.quantization.wna16_formats import dequantize, pack_nibbles

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (e, n, k), generator=g, dtype=torch.uint8)
    groups = -(-k // group)
    scales = (torch.rand(e, n, groups, generator=g) + 0.5) * (2 / (k**0.5 * (1 << bits)))
    zeros = torch.randint(0, 1 << bits, (e, n, groups), generator=g, dtype=torch.uint8)
    packed = torch.stack([pack_nibbles(w) for w in q]) if bits == 4 else q
    deq = torch.stack([dequantize(*t, bits, group) for t in zip(packed, scales, zeros)])
    stack = fq.QuantizedStack(packed.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), bits, group)
    return stack, deq


def _fp8_stack(e, n, k, block, seed):
    """(QuantizedStack of fp8 experts with per-row or 128-block scales, float32 dequantized)."""
    from pagellm.quantization.fp8 import FP8, dequantize_fp8

    w = _randn(e, n, k, seed=seed, scale=k**-0.5).cpu()
    shape = (e, -(-n // 128), -(-k // 128)) if block else (e, n)
    scales = (
        w.abs().amax()
        / 448
        * (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) + 1)
    )
    full = (
        scales.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
        if block
        else scales[..., None]
    )
    q = (w / full).to(FP8)
    deq = torch.stack([dequantize_fp8(a, b) for a, b in zip(q, scales)])
    return fq.QuantizedStack(q.to(DEVICE), scales.to(DEVICE), None, 0, 128 if block else 0), deq


QUANT_CASES = {  # name: (stack maker for (E, N, K, seed), hidden, inter)
    "int4-g32": (lambda e, n, k, s: _int_stack(e, n, k, 4, 32, s), 64, 32),
    "int4-channel": (lambda e, n, k, s: _int_stack(e, n, k, 4, k, s), 64, 48),
    "int4-g32-k96": (lambda e, n, k, s: _int_stack(e, n, k, 4, 32, s), 96, 32),  # K tails
    "int8-g16": (lambda e, n, k, s: _int_stack(e, n, k, 8, 16, s), 32, 48),
    "fp8-rows": (lambda e, n, k, s: _fp8_stack(e, n, k, False, s), 64, 32),
    "fp8-blocks": (lambda e, n, k, s: _fp8_stack(e, n, k, True, s), 128, 128),
}


@pytest.mark.parametrize("case", list(QUANT_CASES))
@pytest.mark.parametrize("num_tokens,kernel", [(1, "tiles"), (9, "tiles"), (1, "gemv"),
                                               (3, "gemv"), (2, "default")])  # fmt: skip
def test_fused_moe_quant_matches_torch_on_dequantized_weights(case, num_tokens, kernel):
    """int4 / int8 (asymmetric groups, one group over K) and fp8 (rows, 128 blocks) experts,
    dequantized in registers: the torch path on the dequantized weights (float32 under the
    interpreter; the tile rounds to x's dtype as a dequantized-at-load weight does). The
    tiled kernel, the GEMV (int) and the default (the GEMV at 8 rows, fp8 tiles)."""
    make, h, i = QUANT_CASES[case]
    dtype = X_DTYPE_QUANT
    x, _, _, weights, ids = _problem(num_tokens, 4, h, i, dtype)
    w13, d13 = make(4, 2 * i, h, 1)
    w2, d2 = make(4, h, i, 2)
    config = {"tiles": TINY, "gemv": TINY_GEMV, "default": None}[kernel]
    if kernel == "gemv" and case.startswith("fp8"):
        with pytest.raises(ValueError, match="not fp8"):
            fq.fused_moe_quant(x, w13, w2, weights, ids, config)
        return
    out = fq.fused_moe_quant(x, w13, w2, weights, ids, config)
    assert out.shape == (num_tokens, h) and out.dtype == dtype
    ref = experts_torch(x.cpu().float(), d13.to(dtype).float(), d2.to(dtype).float(),
                        weights.cpu(), ids.cpu())  # fmt: skip
    _close(out, ref, dtype)


@pytest.mark.parametrize("group,h,i", [(64, 128, 64), (0, 64, 48), (32, 64, 32)])
def test_int4_expert_tiles_under_fp16_x(group, h, i):
    """Under 16-bit x the int4 tiles of K steps of 64 or more are built as 16-bit pairs
    (`wna16_gemm._int4_pairs`, their scale rounded to x's dtype first; shorter steps, groups
    of 32, the float32 unpack): fp16 here (the interpreter's tl.dot misreads bf16; bf16 runs
    in the gpu tests), 9 tokens through the tiled kernel. Group 0: one group over K (the down
    projection's K = 48 takes steps of 16)."""
    x, _, _, weights, ids = _problem(9, 4, h, i, torch.float16)
    w13, d13 = _int_stack(4, 2 * i, h, 4, group or h, 1)
    w2, d2 = _int_stack(4, h, i, 4, group or i, 2)
    config = fm.MoEConfig(block_m=16, block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=2)
    out = fq.fused_moe_quant(x, w13, w2, weights, ids, config)
    ref = experts_torch(x.cpu().float(), d13.half().float(), d2.half().float(), weights.cpu(),
                        ids.cpu())  # fmt: skip
    _close(out, ref, torch.float16)


def test_fused_moe_quant_rejects_bad_inputs():
    w13, _ = _int_stack(4, 64, 32, 4, 32, 1)
    w2, _ = _int_stack(4, 32, 32, 4, 32, 2)
    x, _, _, weights, ids = _problem(2, 4, 32, 32, torch.float32)
    with pytest.raises(ValueError, match="fused_moe_quant: x"):
        fq.fused_moe_quant(x, w13, w13, weights, ids)
    fp8_named_int = fq.QuantizedStack(w2.q, w2.scales, None, 0, 0)
    with pytest.raises(ValueError, match="fp8 with bits 0"):
        fq.fused_moe_quant(x, w13, fp8_named_int, weights, ids)
    odd_group = fq.QuantizedStack(w2.q, w2.scales, w2.zeros, 4, 24)
    with pytest.raises(ValueError, match="scale groups of 24 need a multiple of 16"):
        fq.fused_moe_quant(x, w13, odd_group, weights, ids)


@pytest.mark.parametrize("config", [None, TINY, TINY_GEMV])
def test_fused_moe_quant_refuses_what_it_would_misread(config):
    """Found by a sweep: each of these was read as if laid out as expected (wrong outputs, no
    error) by one kernel or both; now a ValueError whichever runs."""
    w13, _ = _int_stack(4, 64, 32, 4, 32, 1)
    w2, _ = _int_stack(4, 32, 32, 4, 32, 2)
    x, _, _, weights, ids = _problem(2, 4, 32, 32, torch.float32)
    pairs = torch.stack([ids, ids], dim=-1)  # ids[..., 0] below: a strided view of the same
    bias13, bias2 = torch.zeros(4, 64), torch.zeros(4, 32)
    wide = torch.zeros(4, 128)
    g16, _ = _int_stack(4, 64, 32, 4, 16, 1)  # two groups a row
    expanded = g16.zeros[..., :1].expand(-1, -1, 2)  # zeros shared by a row's groups: a view
    cases = {
        "ids must be contiguous int32": dict(ids=pairs[..., 0]),
        "ids must be contiguous int32, got torch.int64": dict(ids=ids.long()),
        r"bias \(4, 32\) for weights": dict(bias13=bias13[:, :32].contiguous()),
        r"bias \(4, 64\) for weights": dict(bias13=wide[:, ::2]),  # strided
        "expected contiguous": dict(w13=fq.QuantizedStack(g16.q, g16.scales, expanded, 4, 16)),
        r"scales \(4, 64, 2\) for \(4, 64, 32\)": dict(
            w13=fq.QuantizedStack(
                w13.q, torch.ones(4, 64, 2), torch.zeros(4, 64, 1, dtype=torch.uint8), 4, 32
            )
        ),  # fmt: skip
    }
    for message, change in cases.items():
        args = dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids, bias13=None, bias2=bias2)
        args |= change
        with pytest.raises(ValueError, match=message):
            fq.fused_moe_quant(args["x"], args["w13"], args["w2"], args["weights"], args["ids"],
                               config, args["bias13"], args["bias2"])  # fmt: skip


def test_tile_configs_are_checked():
    """Tiles that are not powers of two failed inside Triton ("arange's range must be a power
    of 2"); now the configs say so."""
    with pytest.raises(ValueError, match="MoEConfig: tiles"):
        fm.MoEConfig(16, 64, 96, 1, 4, 3)
    with pytest.raises(ValueError, match="GemvConfig"):
        fq.GemvConfig(24, 1024, 4)


# ---- CUDA ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 2048])
def test_fused_moe_bf16_at_qwen3_30b_shapes(num_tokens):
    """128 experts, top-8, H 2048, I 768: against the torch path in float32."""
    x, w13, w2, weights, ids = _problem(num_tokens, 128, 2048, 768, torch.bfloat16, top_k=8)
    out = fm.fused_moe(x, w13, w2, weights, ids)
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_fused_moe_replays_in_a_cuda_graph():
    """Captured once, replayed with other tokens and routing: no host sync, fixed shapes."""
    from pagellm.layers.moe import FusedMoE

    layer = FusedMoE(16, 2, 256, 128, renormalize=True).to("cuda", torch.bfloat16)
    layer.w13.data.copy_(_randn(16, 256, 256, dtype=torch.bfloat16, scale=1 / 16))
    layer.w2.data.copy_(_randn(16, 256, 128, dtype=torch.bfloat16, scale=1 / 11))
    x, logits = _randn(32, 256, dtype=torch.bfloat16), _randn(32, 16, dtype=torch.bfloat16)
    layer(x, logits)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, logits)
    for seed in (1, 2):
        x.copy_(_randn(32, 256, dtype=torch.bfloat16, seed=seed))
        logits.copy_(_randn(32, 16, dtype=torch.bfloat16, seed=seed + 10))
        graph.replay()
        weights, ids = select_experts(logits, 2, True)
        ref = experts_torch(x, layer.w13, layer.w2, weights, ids)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int4-g128", "fp8-blocks"])
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_fused_moe_quant_at_qwen3_30b_shapes(kind, num_tokens):
    """128 experts, top-8, H 2048, I 768, bf16 x: int4 groups of 128 and fp8 128-blocks
    against the torch path on the dequantized weights in float32."""
    x, _, _, weights, ids = _problem(num_tokens, 128, 2048, 768, torch.bfloat16, top_k=8)
    if kind == "fp8-blocks":
        (w13, d13), (w2, d2) = (
            _fp8_stack(128, 1536, 2048, True, 1),
            _fp8_stack(128, 2048, 768, True, 2),
        )
    else:
        (w13, d13), (w2, d2) = (
            _int_stack(128, 1536, 2048, 4, 128, 1),
            _int_stack(128, 2048, 768, 4, 128, 2),
        )
    out = fq.fused_moe_quant(x, w13, w2, weights, ids)
    ref = experts_torch(x.float(), d13.cuda().bfloat16().float(), d2.cuda().bfloat16().float(),
                        weights, ids)  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_fused_moe_quant_replays_in_a_cuda_graph():
    """int4 experts: captured once, replayed with other tokens and routing (no host sync)."""
    (w13, d13), (w2, d2) = _int_stack(16, 256, 256, 4, 128, 1), _int_stack(16, 256, 128, 4, 128, 2)
    x, logits = _randn(32, 256, dtype=torch.bfloat16), _randn(32, 16)
    weights, ids = select_experts(logits, 2, True)
    fq.fused_moe_quant(x, w13, w2, weights, ids)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fq.fused_moe_quant(x, w13, w2, weights, ids)
    for seed in (1, 2):
        x.copy_(_randn(32, 256, dtype=torch.bfloat16, seed=seed))
        new_weights, new_ids = select_experts(_randn(32, 16, seed=seed + 10), 2, True)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        ref = experts_torch(x.float(), d13.cuda().bfloat16().float(),
                            d2.cuda().bfloat16().float(), weights, ids)  # fmt: skip
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
