"""ModelRunner: weights, KV cache tensors, the flat batch of one step, forward and sampling.

`execute_model(scheduler_output)` applies the scheduler's diff to the InputBatch, builds one
flat batch (input_ids, positions, slot_mapping, block table, query_start_loc, seq_lens),
runs the model, computes logits only where a request samples, and samples.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagellm.attention.base import CommonAttentionMetadata, get_attn_backend_cls
from pagellm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.sample.sampler import Sampler
from pagellm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


class StepBatch:
    """The flat batch of one step, on the host; `rows` are InputBatch rows in batch order."""

    __slots__ = ("req_ids", "rows", "num_scheduled", "positions", "query_start_loc", "seq_lens")

    def __init__(self, req_ids: list[str], rows: np.ndarray, num_scheduled: np.ndarray) -> None:
        self.req_ids = req_ids
        self.rows = rows  # [R] int64
        self.num_scheduled = num_scheduled  # [R] int64
        self.query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)  # [R + 1]
        np.cumsum(num_scheduled, out=self.query_start_loc[1:])
        self.positions = np.empty(0, dtype=np.int64)  # [T], set by the runner
        self.seq_lens = np.empty(0, dtype=np.int32)  # [R], set by the runner


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from pagellm import loader

        self.config = config
        self.model_config = config.model_config
        self.device = torch.device(config.device)
        self.block_size = config.cache_config.block_size
        torch.manual_seed(config.seed)
        self.attn_backend_cls = get_attn_backend_cls(self.device)
        self.model = loader.load_model(self.model_config, self.device, self.attn_backend_cls)
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, self.model_config.max_model_len, self.block_size
        )
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []

    # ---- KV cache -------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        mc = self.model_config
        per_layer = 2 * self.block_size * mc.num_kv_heads * mc.head_dim * mc.dtype.itemsize
        return per_layer * mc.num_layers

    def determine_num_kv_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        budget = cc.kv_cache_memory_bytes or self._default_kv_budget()
        num_blocks = budget // self.kv_block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds fewer than 2 blocks of "
                f"{self.kv_block_bytes} bytes; raise kv_cache_memory_bytes"
            )
        return int(num_blocks)

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        return int(total * self.config.cache_config.gpu_memory_utilization - used)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = self.attn_backend_cls.kv_cache_shape(
            num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=mc.dtype, device=self.device) for _ in range(mc.num_layers)
        ]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_block_bytes / (1 << 30),
        )

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        batch = self._prepare_batch(sched)
        common = self._attention_metadata(batch)
        input_ids = self._input_ids(batch)
        positions = torch.from_numpy(batch.positions).to(self.device, non_blocking=True)
        attn_metadata = self.attn_backend_cls.build_metadata(common)
        hidden = self.model(input_ids, positions, self.kv_caches, attn_metadata)
        return self._sample(batch, hidden)

    def _update_states(self, sched: SchedulerOutput) -> None:
        ib = self.input_batch
        for req_id in sched.finished_req_ids:
            ib.remove_request(req_id)
        for new in sched.scheduled_new_reqs:
            ib.add_request(new)
        cached = sched.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = ib.req_id_to_row[req_id]
            ib.num_computed_tokens[row] = num_computed
            if block_ids:
                ib.append_block_ids(row, block_ids)

    def _prepare_batch(self, sched: SchedulerOutput) -> StepBatch:
        ib = self.input_batch
        req_ids = list(sched.num_scheduled_tokens)
        rows = np.fromiter((ib.req_id_to_row[r] for r in req_ids), np.int64, len(req_ids))
        num_scheduled = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, len(req_ids))
        batch = StepBatch(req_ids, rows, num_scheduled)
        num_computed = ib.num_computed_tokens[rows]
        # position of each token: its request's computed count + its index within the request
        offsets = np.arange(batch.query_start_loc[-1]) - np.repeat(
            batch.query_start_loc[:-1], num_scheduled
        )
        batch.positions = np.repeat(num_computed, num_scheduled) + offsets
        batch.seq_lens = (num_computed + num_scheduled).astype(np.int32)
        return batch

    def _token_rows(self, batch: StepBatch) -> np.ndarray:
        return np.repeat(batch.rows, batch.num_scheduled)  # [T]

    def _input_ids(self, batch: StepBatch) -> torch.Tensor:
        ids = self.input_batch.token_ids[self._token_rows(batch), batch.positions]  # [T]
        return torch.from_numpy(ids).to(self.device, non_blocking=True)

    def _attention_metadata(self, batch: StepBatch) -> CommonAttentionMetadata:
        ib, bs = self.input_batch, self.block_size
        token_rows = self._token_rows(batch)
        block_ids = ib.block_table[token_rows, batch.positions // bs]
        slot_mapping = block_ids.astype(np.int64) * bs + batch.positions % bs  # [T]
        max_seq_len = int(batch.seq_lens.max())
        block_table = ib.block_table[batch.rows, : -(-max_seq_len // bs)]  # [R, max_blocks]
        to_dev = self._to_device
        return CommonAttentionMetadata(
            num_reqs=len(batch.rows),
            block_size=bs,
            num_actual_tokens=int(batch.query_start_loc[-1]),
            max_query_len=int(batch.num_scheduled.max()),
            max_seq_len=max_seq_len,
            query_start_loc=to_dev(batch.query_start_loc),
            seq_lens=to_dev(batch.seq_lens),
            block_table=to_dev(block_table),
            slot_mapping=to_dev(slot_mapping),
            query_start_loc_cpu=batch.query_start_loc,
            seq_lens_cpu=batch.seq_lens,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    def _sample(self, batch: StepBatch, hidden: torch.Tensor) -> ModelRunnerOutput:
        ib = self.input_batch
        # a request samples when this step brings its KV cache to the end of its tokens
        samples = batch.seq_lens == ib.num_tokens[batch.rows]  # [R] bool
        sample_idx = np.flatnonzero(samples)
        sampled_ids: list[list[int]] = [[] for _ in batch.req_ids]
        output = ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=sampled_ids)
        if len(sample_idx) == 0:
            return output
        rows = batch.rows[sample_idx]
        logits_idx = torch.from_numpy(batch.query_start_loc[1:][sample_idx] - 1).to(self.device)
        logits = self.model.compute_logits(hidden[logits_idx])  # [S, vocab] float32
        result = self.sampler(logits, ib.sampling_metadata(rows, self.device))
        tokens = result.sampled.cpu().numpy()  # the step's one host sync
        ib.append_sampled(rows, tokens)
        for i, token in zip(sample_idx.tolist(), tokens.tolist()):
            sampled_ids[i].append(token)
        if result.logprobs is not None:
            self._attach_logprobs(output, sample_idx, result)
        return output

    def _attach_logprobs(self, output: ModelRunnerOutput, sample_idx: np.ndarray, result) -> None:
        values = result.logprobs.cpu().tolist()
        ids = result.logprob_ids.cpu().tolist()
        output.logprobs = [[] for _ in output.req_ids]
        output.logprob_token_ids = [[] for _ in output.req_ids]
        for j, i in enumerate(sample_idx.tolist()):
            output.logprobs[i] = values[j]
            output.logprob_token_ids[i] = ids[j]
