"""The latent-attention (MLA) decode kernel (`pagellm/kernels/mla_decode.py`) against a naive
torch reference, and the layer's CUDA decode path (absorbed query -> kernel -> W_UV) against
its torch path. Without CUDA it runs under Triton's interpreter at small shapes (float32,
float16); a `gpu`-marked test adds bf16 at DeepSeek-V2-Lite's row (R 512, P 64, 16 heads).

Poison: every cache slot no block table references and the tail of each request's last block
hold NaN, and the output starts as `torch.empty`, so a stray read or an unwritten row fails.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from test_kernels import _patch_interpreter_for_numpy_2_4

    _patch_interpreter_for_numpy_2_4()  # the key loop runs to a loaded sequence length

from pagellm.attention.base import CommonAttentionMetadata  # noqa: E402
from pagellm.attention.mla import MLAAttention  # noqa: E402
from pagellm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagellm.kernels import mla_decode as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


class LatentBatch:
    """Decode rows of requests with `seq_lens` keys in a NaN-poisoned latent cache."""

    def __init__(self, seq_lens, heads, rank, rope, block_size, dtype, seed=0) -> None:
        g = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        width = rank + rope
        self.rows = [torch.randn(n, width, generator=g).to(dtype) for n in seq_lens]
        self.q = torch.randn(len(seq_lens), heads, width, generator=g).to(dtype).to(DEVICE)
        blocks = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks) + 2
        perm = rng.permutation(num_blocks)
        cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype)
        table = np.full((len(seq_lens), max(blocks) + 1), perm[-1], dtype=np.int32)
        used = 0
        for r, (n, nb) in enumerate(zip(seq_lens, blocks)):
            table[r, :nb] = perm[used : used + nb]
            used += nb
            for pos in range(n):
                cache[table[r, pos // block_size], pos % block_size] = self.rows[r][pos]
        self.kv_cache = cache[None, :, :, None, :].to(DEVICE)  # [1, blocks, bs, 1, R + P]
        self.block_table = torch.from_numpy(table).to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.rank = rank

    def reference(self, scale: float) -> torch.Tensor:  # [n, H, R] float32
        out = []
        for q, rows in zip(self.q.float().cpu(), self.rows):
            probs = torch.softmax(q @ rows.float().T * scale, dim=-1)  # [H, L]
            out.append(probs @ rows.float()[:, : self.rank])
        return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "seq_lens, heads, rank, rope, block_size, num_splits",
    [
        ([1, 5, 37, 16], 4, 32, 8, 4, 1),
        ([70, 3], 20, 24, 8, 16, 1),  # 20 heads: two programs, the second masked
        ([70, 3, 1], 20, 24, 8, 16, 3),  # segments; the short requests' later ones empty
        ([1, 33], 4, 32, 8, 4, None),  # the wrapper's choice (an H100's SMs: many splits)
        ([70, 3, 1], 40, 24, 8, 16, 3),  # 32 heads a program (block_h): two, one masked
    ],
)
def test_kernel_equals_torch_reference(dtype, seq_lens, heads, rank, rope, block_size, num_splits):
    batch = LatentBatch(seq_lens, heads, rank, rope, block_size, dtype)
    out = kernel.mla_decode(
        batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, rank, 0.3,
        max_seq_len=max(seq_lens), block_n=16, num_splits=num_splits,
        block_h=32 if heads > 32 else 16,
    )  # fmt: skip
    assert out.shape == (len(seq_lens), heads, rank) and out.dtype == dtype
    torch.testing.assert_close(
        out.float().cpu(), batch.reference(0.3), atol=TOL[dtype], rtol=TOL[dtype]
    )


def test_split_count_fills_the_gpu_without_empty_steps():
    assert kernel.choose_num_splits(programs=1, max_seq_len=4096, block_n=32, num_sms=132) == 64
    assert kernel.choose_num_splits(programs=1, max_seq_len=100, block_n=32, num_sms=132) == 4
    assert kernel.choose_num_splits(programs=512, max_seq_len=4096, block_n=32, num_sms=132) == 1


def test_wrapper_refuses_a_per_head_cache():
    batch = LatentBatch([4], 4, 32, 8, 4, torch.float32)
    per_head = torch.zeros(2, 4, 4, 1, 40, device=DEVICE)
    with pytest.raises(ValueError, match="latent cache"):
        kernel.mla_decode(batch.q, per_head, batch.block_table, batch.seq_lens, 32, 0.3)
    with pytest.raises(ValueError, match="R = 48"):
        kernel.mla_decode(batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, 48, 0.3)


def _step(batch: LatentBatch, query_lens: list[int], block_size: int):
    """A step's metadata over `batch`'s requests: the last `query_lens[r]` tokens of request
    r are this step's (written again by the layer at their own slots)."""
    seq_lens = batch.seq_lens.cpu().numpy()
    table = batch.block_table.cpu().numpy()
    positions = [
        (r, p) for r, (s, q) in enumerate(zip(seq_lens, query_lens)) for p in range(s - q, s)
    ]
    slots = [table[r, p // block_size] * block_size + p % block_size for r, p in positions]
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    common = CommonAttentionMetadata(
        num_reqs=len(query_lens), block_size=block_size, num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(qsl).to(DEVICE), seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )  # fmt: skip
    new_rows = torch.cat([r[len(r) - q :] for r, q in zip(batch.rows, query_lens)])
    return TorchAttentionBackend.build_metadata(common), new_rows.to(DEVICE)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 6, 1]])  # decode-only; mixed
def test_layer_through_the_kernel_equals_its_torch_path(query_lens, monkeypatch):
    """`MLAAttention.forward` with the kernel (as on CUDA: a decode-only step's rows are its
    requests, a mixed step's decodes go by their rows and requests) against its torch path
    (decode groups, the prefill chunk expanded either way)."""
    import pagellm.attention.mla as mla

    heads, nope, rank, rope, dv, block_size = 4, 8, 32, 8, 12, 4
    batch = LatentBatch([3, 9, 14], heads, rank, rope, block_size, torch.float32, seed=1)
    g = torch.Generator().manual_seed(2)
    t = sum(query_lens)
    q_nope = torch.randn(t, heads, nope, generator=g).to(DEVICE)
    q_pe = torch.randn(t, heads, rope, generator=g).to(DEVICE)
    w_kv = (torch.randn(heads, nope + dv, rank, generator=g) * 0.3).to(DEVICE)
    attn = MLAAttention(heads, nope, rank, rope, scale=0.25)
    outputs = []
    for kernel_module in (None, kernel):
        monkeypatch.setattr(mla, "_decode_kernel", lambda q, k=kernel_module: k)
        metadata, new_rows = _step(batch, query_lens, block_size)
        cache = batch.kv_cache.clone()
        outputs.append(attn.forward(q_nope, q_pe, new_rows, w_kv, cache, metadata))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


def test_kernel_rows_name_their_requests():
    """A mixed step's decode rows through `reqs`: row i attends request reqs[i]'s keys."""
    batch = LatentBatch([5, 12, 30], 4, 32, 8, 4, torch.float32, seed=4)
    reqs = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    q = batch.q[[0, 1]]  # rows 0, 1 ask for requests 2, 0
    out = kernel.mla_decode(q, batch.kv_cache, batch.block_table, batch.seq_lens, 32, 0.3,
                            max_seq_len=30, block_n=16, reqs=reqs)  # fmt: skip
    batch.q, batch.rows = q, [batch.rows[2], batch.rows[0]]
    torch.testing.assert_close(out.cpu(), batch.reference(0.3), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_kernel_bf16_at_deepseek_v2_lite_shape():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    batch = LatentBatch([1, 300, 1000, 77], 16, 512, 64, 16, torch.bfloat16, seed=3)
    scale = 192**-0.5
    out = kernel.mla_decode(batch.q, batch.kv_cache, batch.block_table, batch.seq_lens, 512, scale)
    torch.testing.assert_close(out.float().cpu(), batch.reference(scale), atol=3e-2, rtol=3e-2)
