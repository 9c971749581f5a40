"""The host-side parts of CUDA-graph decode (run on the CPU): the batch-size ladder, padding
of a decode step to a captured size, the persistent staged inputs, and the shape of the
profiling step run before the graphs are captured."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.worker.cuda_graphs import CudaGraphRunner, capture_sizes
from pagellm.worker.step_inputs import StepInputs, pad_decode


def test_capture_sizes_ladder():
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]


def test_size_for_picks_the_smallest_graph_that_fits():
    graphs = CudaGraphRunner([1, 2, 4, 8, 16])
    assert [graphs.size_for(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, None]


def test_pad_decode_adds_one_token_requests_that_write_nothing():
    arrays = {
        "input_ids": np.array([11, 12, 13]),
        "positions": np.array([5, 0, 40]),
        "slot_mapping": np.array([37, 96, 200]),
        "query_start_loc": np.array([0, 1, 2, 3], np.int32),
        "seq_lens": np.array([6, 1, 41], np.int32),
    }
    padded = pad_decode(arrays, 5)
    assert padded["input_ids"].tolist() == [11, 12, 13, 0, 0]
    assert padded["positions"].tolist() == [5, 0, 40, 0, 0]
    assert padded["slot_mapping"].tolist() == [37, 96, 200, -1, -1]
    assert padded["seq_lens"].tolist() == [6, 1, 41, 1, 1]
    assert padded["query_start_loc"].tolist() == [0, 1, 2, 3, 4, 5]
    assert padded["query_start_loc"].dtype == np.int32 and padded["seq_lens"].dtype == np.int32
    assert pad_decode(arrays, 3) is arrays


def test_pad_decode_from_an_empty_step():
    empty = {k: np.zeros(0, np.int64) for k in ("input_ids", "positions", "slot_mapping")}
    empty["seq_lens"] = np.zeros(0, np.int32)
    padded = pad_decode(empty, 4)
    assert padded["slot_mapping"].tolist() == [-1] * 4
    assert padded["seq_lens"].tolist() == [1] * 4
    assert padded["query_start_loc"].tolist() == [0, 1, 2, 3, 4]


def test_step_inputs_stage_views_of_persistent_buffers():
    inputs = StepInputs(max_tokens=16, max_reqs=4, max_blocks=8, device=torch.device("cpu"))
    ids = inputs.stage("input_ids", np.arange(5))
    assert ids.tolist() == [0, 1, 2, 3, 4]
    assert ids.data_ptr() == inputs.dev["input_ids"].data_ptr()  # same storage every step
    table = inputs.stage_block_table(np.array([[3, 4, 5], [6, 7, 8]], np.int32))
    assert table.tolist() == [[3, 4, 5], [6, 7, 8]]
    assert table.stride() == (8, 1)  # the persistent row stride a graph was captured with
    # a later, narrower step overwrites the front and leaves the rest as it was
    table = inputs.stage_block_table(np.array([[9]], np.int32))
    assert inputs.block_table[:2, :3].tolist() == [[9, 4, 5], [6, 7, 8]]


def test_profile_step_fits_the_schedulers_limits():
    """The profiling forward (CUDA start-up) is a step the scheduler could make: at most
    max_num_seqs requests of at most max_model_len tokens (a small max_num_seqs once sent 33
    requests into a 5-entry query_start_loc)."""
    from pagellm.worker.step_batch import profile_step

    for tokens, seqs, max_len in [(8192, 256, 4096), (8192, 4, 256), (8192, 3, 3000),
                                  (8192, 1, 100_000), (2048, 64, 2048), (16, 4, 4)]:  # fmt: skip
        query_lens, seq_lens = profile_step(tokens, seqs, max_len, block_size=16)
        assert len(query_lens) <= seqs and (seq_lens <= max_len).all()
        assert (query_lens <= seq_lens).all() and query_lens.min() >= 1
        assert query_lens.sum() == min(tokens, seqs * max_len)
    assert profile_step(8192, 256, 4096, 16)[0].tolist() == [4096, 4095, 1]  # with a decode
