"""ModelRunner: weights, KV cache tensors, the flat batch of one step, forward and sampling.

`execute_model(scheduler_output)` applies the scheduler's diff to the InputBatch, builds one
flat batch on the host (input_ids, positions, slot_mapping, block table, query_start_loc,
seq_lens), stages it into persistent buffers (`StepInputs`: pinned host memory and
non-blocking copies on CUDA), runs the model, computes logits only where a request samples,
and samples on the device with one host sync (the sampled ids).

On CUDA the KV cache is sized from a profiling forward over `max_num_batched_tokens` dummy
tokens and `gpu_memory_utilization`, and decode-only steps replay CUDA graphs captured for a
ladder of batch sizes (`cuda_graphs.py`) unless `enforce_eager`; other steps run eagerly.

`execute_model_async` returns as soon as the step is queued on the device: its sampled ids
are copied back without blocking, and `AsyncModelRunnerOutput.get_output()` waits for them.
Meanwhile the next step can be prepared and queued (async scheduling): a request's newest
token, sampled by the step still in flight, is not on the host yet, so its row counts it as
a placeholder and the next step's input id is copied from the previous step's sampled
tensor on the device (`async_output.PendingTokens`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pagellm import envs
from pagellm.attention.base import CommonAttentionMetadata
from pagellm.attention.selector import get_attn_backend_cls
from pagellm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels.compile_ahead import compile_ahead
from pagellm.kernels.cpu_gemm import cpu_gemm_plan, cpu_prepack_supported
from pagellm.kv_cache_dtype import is_fp8, kv_cache_torch_dtype
from pagellm.kv_cache_size import kv_block_bytes, num_kv_blocks
from pagellm.layers.attention import Attention
from pagellm.layers.linear import heads_per_rank
from pagellm.layers.rope import long_rope
from pagellm.lora.slots import LoRASlotManager
from pagellm.sample.greedy_head import GreedyHead
from pagellm.sample.logits_processor.penalties import Penalties
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.rank0_sampler import Rank0Sampler
from pagellm.sample.sampler import Sampler
from pagellm.structured_output.bitmask import GrammarBitmask
from pagellm.utils import cpu_bf16_units, to_device
from pagellm.worker.async_output import AsyncModelRunnerOutput, PendingTokens, SampledTokens
from pagellm.worker.cuda_graphs import CudaGraphRunner, capture_sizes
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.kv_cache import ProfiledMemory, profiled_kv_budget, zeros_kv
from pagellm.worker.logprobs import attach_logprobs, prompt_logprobs
from pagellm.worker.pooler import Pooler
from pagellm.worker.spec_decode import SpecDecoder
from pagellm.worker.step_batch import (
    StepBatch,
    block_table_rows,
    dummy_inputs,
    host_arrays,
    prepare_batch,
    profile_step,
)
from pagellm.worker.step_inputs import StepInputs, pad_decode

logger = logging.getLogger(__name__)

# context length the decode graphs are planned for (it fixes their split-KV count)
GRAPH_PLAN_SEQ_LEN = 4096


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from pagellm import loader

        self.config = config
        self.model_config = config.model_config
        self.device = torch.device(config.device)
        self.block_size = config.cache_config.block_size
        cc = config.cache_config
        self.kv_cache_dtype = kv_cache_torch_dtype(cc.cache_dtype, self.model_config.dtype)
        # fp8 with calculate_kv_scales: the first real step's forward sets every layer's scales
        self.kv_scales_pending = cc.calculate_kv_scales and is_fp8(self.kv_cache_dtype)
        torch.manual_seed(config.seed)
        self.attn_backend_cls = get_attn_backend_cls(self.device)
        start = time.perf_counter()
        self.model = loader.load_model(self.model_config, self.device, self.attn_backend_cls)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        sc = config.scheduler_config
        if cpu_prepack_supported(self.device, self.model_config.dtype):
            self.model.prepack_cpu_weights(batch_hint=sc.max_num_seqs)
        logger.info(
            "model %s loaded in %.1f s (%s, %s%s): %.2f GiB of weights", self.model_config.model,
            time.perf_counter() - start, self.model_config.dtype, self.attn_backend_cls.name,
            _cpu_note(self.device, self.model_config.dtype), self.weight_bytes / (1 << 30),
        )  # fmt: skip
        # this rank's KV heads (all of them with one rank)
        _, self.num_kv_heads = heads_per_rank(
            self.model_config.hf_config.num_attention_heads, self.model_config.num_kv_heads
        )
        self.input_batch = InputBatch(
            sc.max_num_seqs, self.model_config.max_model_len, self.block_size, self.device,
            vocab_size=self.model_config.vocab_size,
        )  # fmt: skip
        max_blocks = self.input_batch.block_table.shape[1]
        max_tokens = max(sc.max_num_batched_tokens, sc.max_num_seqs)
        self.inputs = StepInputs(max_tokens, sc.max_num_seqs, max_blocks, self.device)
        self.sampler = Sampler() if get_tp_group().size == 1 else Rank0Sampler(Sampler())
        # small greedy CPU steps: the argmax from an 8-bit copy of the LM head, a few float rows
        self.greedy_head = GreedyHead.build(self.model, config)
        self.kv_caches: list[torch.Tensor] = []
        self.profiled: ProfiledMemory | None = None  # a GPU's, once its KV budget is found
        self.graphs: CudaGraphRunner | None = None
        # the last queued step's samples: their ids feed the next step's inputs on the device
        self.pending = PendingTokens(sc.max_num_seqs)
        # the journey trace's dump of one request's paging, (batch, host arrays) each step
        self.trace_paging: Callable[[StepBatch, dict[str, np.ndarray]], None] | None = None
        # a longrope model's long-factor rows follow this many short ones in its rotary table
        rope = long_rope(self.model_config.hf_config)
        self.long_rope_rows = 0 if rope is None else rope[1]
        # speculative decoding: drafts verified in the step's forward, proposed after it
        spec = config.speculative_config
        self.spec = None if spec is None else SpecDecoder(spec, self)
        # LoRA adapters: slots on every target projection, filled between steps
        self.lora = None if config.lora_config is None else LoRASlotManager(
            self.model, config.lora_config, self.device, self.model_config.dtype, max_tokens
        )  # fmt: skip
        # a pooling model: requests finish with a pooled vector instead of sampling
        mc = self.model_config
        self.pooler = (
            Pooler(mc.pooler_config, self.model, self.device) if mc.runner == "pooling" else None
        )

    # ---- KV cache -------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        """One block of every layer's cache: the target's, and a draft model's (its K/V at
        the same block ids) where the proposer keeps one."""
        mc = self.model_config
        own = kv_block_bytes(
            mc.num_layers, self.num_kv_heads, mc.head_dim, self.kv_element_size, self.block_size,
            mc.kv_parts,
        )  # fmt: skip
        return own + (
            0 if self.spec is None else self.spec.proposer.kv_block_bytes(self.block_size)
        )

    @property
    def kv_element_size(self) -> int:
        return self.kv_cache_dtype.itemsize

    def determine_num_kv_blocks(self) -> int:
        cc = self.config.cache_config
        if self.is_encoder:  # blocks only count tokens: enough for every request at once
            sc = self.config.scheduler_config
            return sc.max_num_seqs * -(-self.model_config.max_model_len // self.block_size) + 1
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        budget = cc.kv_cache_memory_bytes or self._default_kv_budget()
        return num_kv_blocks(budget, self.kv_block_bytes)

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        utilization = self.config.cache_config.gpu_memory_utilization
        self.profiled = profiled_kv_budget(self.device, self.profile_run, utilization)
        return self.profiled.budget

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward over max_num_batched_tokens dummy tokens (prefill chunks and one decode,
        so both launch variants compile now; cache writes skipped, reads from a one-block
        cache), then logits and sampling for max_num_seqs rows.

        On CUDA the Triton kernels of this forward and of the decode-only forwards that CUDA
        graphs capture are compiled first, side by side (`compile_ahead`: dry passes)."""
        sc, mc = self.config.scheduler_config, self.model_config
        query_lens, seq_lens = profile_step(
            sc.max_num_batched_tokens, sc.max_num_seqs, mc.max_model_len, self.block_size
        )
        shape = self.attn_backend_cls.kv_cache_shape(
            1, self.block_size, self.num_kv_heads, mc.head_dim, mc.kv_parts
        )
        kv = [zeros_kv(shape, self.kv_cache_dtype, self.device) for _ in range(mc.num_layers)]
        if self.device.type == "cuda" and envs.triton_compile_ahead():
            sizes = capture_sizes(sc.max_num_seqs)
            graph_seq_len = min(mc.max_model_len, GRAPH_PLAN_SEQ_LEN)
            with compile_ahead(self.device):
                self._forward(*dummy_inputs(self.block_size, query_lens, seq_lens), kv)
                for size in sorted({sizes[0], sizes[min(1, len(sizes) - 1)], sizes[-1]}):
                    ones = np.ones(size, np.int32)
                    self._forward(*dummy_inputs(self.block_size, ones, ones * graph_seq_len), kv)
        hidden = self._forward(*dummy_inputs(self.block_size, query_lens, seq_lens), kv)
        if self.pooler is not None:
            return  # nothing samples
        rows = min(sc.max_num_seqs, int(query_lens.sum()))
        meta = _profile_sampling(rows, self.device, self.input_batch.logits_processor(Penalties))
        self.sampler(self.model.compute_logits(hidden[:rows]), meta)

    @property
    def is_encoder(self) -> bool:
        """An encoder (`models/bert.py`) reads no cache: no KV tensors, no CUDA graphs."""
        return getattr(self.model, "is_encoder", False)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.is_encoder:
            logger.info("no KV cache: an encoder runs each prompt in one forward")
            return
        mc = self.model_config
        shape = self.attn_backend_cls.kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, mc.head_dim, mc.kv_parts
        )
        dtype = self.kv_cache_dtype
        self.kv_caches = [zeros_kv(shape, dtype, self.device) for _ in range(mc.num_layers)]
        if self.spec is not None:
            self.spec.proposer.initialize_kv_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s)",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_block_bytes / (1 << 30),
            str(self.kv_cache_dtype).removeprefix("torch."),
        )
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self.capture_cuda_graphs()

    # ---- CUDA graphs ----------------------------------------------------------------------

    def capture_cuda_graphs(self) -> None:
        start = time.perf_counter()
        sizes = capture_sizes(self.config.scheduler_config.max_num_seqs)
        empty = {k: np.zeros(0, np.int64) for k in ("input_ids", "positions", "slot_mapping")}
        empty["seq_lens"] = np.zeros(0, np.int32)
        self._stage(pad_decode(empty, sizes[-1]), np.zeros((sizes[-1], 1), np.int32))
        graphs = CudaGraphRunner(sizes)
        with torch.inference_mode():
            graphs.capture(self._graph_forward)
        self.graphs = graphs
        logger.info("captured %d CUDA graphs in %.1f s", len(sizes), time.perf_counter() - start)

    def _graph_forward(self, size: int) -> torch.Tensor:
        """A padded decode forward of `size` tokens over the staged buffers: [size, hidden]."""
        seq_len = min(self.model_config.max_model_len, GRAPH_PLAN_SEQ_LEN)
        arrays = {  # host copies only plan the launch; the graph reads the device buffers
            "query_start_loc": np.arange(size + 1, dtype=np.int32),
            "seq_lens": np.full(size, seq_len, np.int32),
        }
        dev = {
            name: buf[: size + (name == "query_start_loc")] for name, buf in self.inputs.dev.items()
        }
        dev["block_table"] = self.inputs.block_table[:size]
        if self.lora is not None:  # the graph's LoRA kernels read the step's slot buffers
            self.lora.prepare_graph(size)
        return self._run_model(arrays, dev, self.kv_caches)

    # ---- one step -------------------------------------------------------------------------

    def execute_model(
        self, sched: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        return self.execute_model_async(sched, grammar).get_output()

    def execute_model_async(
        self, sched: SchedulerOutput, grammar: GrammarBitmask | None = None
    ) -> AsyncModelRunnerOutput:
        """Queue the step on the device; the result's get_output() waits for its tokens."""
        return self.sample_async(self.forward_async(sched), grammar)

    @torch.inference_mode()
    def sample_async(
        self, forwarded: tuple[StepBatch, torch.Tensor] | None, grammar: GrammarBitmask | None
    ) -> AsyncModelRunnerOutput:
        """Queue the sampling of a forwarded step, its constrained rows masked by `grammar`."""
        if forwarded is None:
            return AsyncModelRunnerOutput(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        return self._sample(*forwarded, grammar)

    @torch.inference_mode()
    def forward_async(self, sched: SchedulerOutput) -> tuple[StepBatch, torch.Tensor] | None:
        """Queue the step's forward: (its batch, hidden states [T, hidden]); None if empty."""
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return None
        batch = prepare_batch(self.input_batch, sched)
        forward = batch
        if self.spec is not None:  # its drafts' cost timed; verify rows as one-token rows
            self.spec.step_started(batch)
            forward = self.spec.as_decode_rows(batch)
        arrays = host_arrays(self.input_batch, forward, self.block_size)
        if self.trace_paging is not None:
            self.trace_paging(forward, arrays)
        size = self._graph_size(forward)
        if self.lora is not None:  # the step's adapters in their slots, its tokens grouped
            self.lora.prepare_step(batch.req_ids, batch.num_scheduled, size)
        staged = arrays if size is None else pad_decode(arrays, size)
        dev = self._stage(staged, block_table_rows(self.input_batch, forward, self.block_size))
        self.pending.patch_inputs(forward, self.input_batch.num_tokens, dev["input_ids"])
        if self.pooler is not None:  # an encoder's token types (a cross-encoder's pairs)
            self.pooler.prepare_step(batch)
        if self.kv_scales_pending:  # this (eager, unpadded) step's K/V set the fp8 scales
            self._calculate_kv_scales_once()
        if size is None:
            hidden = self._run_model(arrays, dev, self.kv_caches)
        else:
            hidden = self.graphs.replay(size)
        return batch, hidden

    def _graph_size(self, batch: StepBatch) -> int | None:
        if self.graphs is None or not batch.is_decode_only or self.kv_scales_pending:
            return None
        return self.graphs.size_for(len(batch.rows))

    def _calculate_kv_scales_once(self) -> None:
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.calculate_kv_scales = True
        self.kv_scales_pending = False
        logger.info("fp8 KV cache: k/v scales from the first batch (calculate_kv_scales)")

    def _update_states(self, sched: SchedulerOutput) -> None:
        ib = self.input_batch
        for req_id in sched.finished_req_ids:
            row = ib.req_id_to_row.get(req_id)
            if row is not None:
                self.pending.drop_row(row)
            ib.remove_request(req_id)
            if self.lora is not None:
                self.lora.remove_request(req_id)
            if self.spec is not None:
                self.spec.remove_request(req_id)
            if self.pooler is not None:
                self.pooler.remove_request(req_id)
        for new in sched.scheduled_new_reqs:
            ib.add_request(new, self.long_rope_rows if new.long_rope else 0)
            if self.lora is not None:
                self.lora.add_request(new.req_id, new.lora_request)
            if self.pooler is not None:
                self.pooler.add_request(new.req_id, new.pooling_params)
        cached = sched.scheduled_cached_reqs
        for req_id, block_ids, num_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_blocks, cached.num_computed_tokens
        ):
            row = ib.req_id_to_row[req_id]
            ib.num_computed_tokens[row] = num_computed
            ib.num_blocks[row] = num_blocks - len(block_ids)  # fewer: drafts' blocks freed
            if block_ids:
                ib.append_block_ids(row, block_ids)
        if self.spec is not None:
            self.spec.add_drafts(ib, sched)

    def _stage(self, arrays: dict[str, np.ndarray], block_rows: np.ndarray) -> dict:
        self.inputs.begin()
        dev = {name: self.inputs.stage(name, a) for name, a in arrays.items()}
        dev["block_table"] = self.inputs.stage_block_table(block_rows)
        self.inputs.end()
        return dev

    def _forward(self, arrays: dict, block_rows: np.ndarray, kv_caches: list) -> torch.Tensor:
        """Eager forward of a flat batch given as host arrays: [T, hidden]."""
        return self._run_model(arrays, self._stage(arrays, block_rows), kv_caches)

    def _run_model(self, arrays: dict, dev: dict, kv_caches: list, model=None) -> torch.Tensor:
        """`model` (default: the target; a draft model) over staged inputs: [T, hidden]."""
        qsl, seq_lens = arrays["query_start_loc"], arrays["seq_lens"]
        common = CommonAttentionMetadata(
            num_reqs=len(seq_lens),
            block_size=self.block_size,
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int(np.diff(qsl).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            block_table=dev["block_table"],
            slot_mapping=dev["slot_mapping"],
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        model = self.model if model is None else model
        encoder = getattr(model, "is_encoder", False)  # it attends within each request itself
        attn_metadata = common if encoder else self.attn_backend_cls.build_metadata(common)
        return model(dev["input_ids"], dev["positions"], kv_caches, attn_metadata)

    def _sample(
        self, batch: StepBatch, hidden: torch.Tensor, grammar: GrammarBitmask | None = None
    ) -> AsyncModelRunnerOutput:
        if self.pooler is not None:  # no sampling: the requests whose prompt ends get a vector
            pooled = self.pooler.output(batch, hidden, self.input_batch.num_tokens[batch.rows])
            return AsyncModelRunnerOutput(pooled)
        if self.spec is not None:
            self.spec.proposer.after_forward(batch, hidden)  # a head takes the hidden states
            if self.spec.verifies(batch):
                return self.spec.sample(batch, hidden, grammar)
        ib = self.input_batch
        # a request samples when this step brings its KV cache to the end of its tokens
        samples = batch.seq_lens == ib.num_tokens[batch.rows]  # [R] bool
        sample_idx = np.flatnonzero(samples)
        sampled_ids: list[list[int]] = [[] for _ in batch.req_ids]
        output = ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=sampled_ids)
        if ib.prompt_logprob_rows:
            output.prompt_logprobs = prompt_logprobs(self.model, ib, batch, hidden, self.device)
        if len(sample_idx) == 0:
            return AsyncModelRunnerOutput(output)
        rows = batch.rows[sample_idx]
        last = hidden[self._logits_index(batch, sample_idx)]
        req_ids = [batch.req_ids[i] for i in sample_idx.tolist()]
        # constrained rows' disallowed tokens go to -inf in the sampler (its grammar mask)
        meta = ib.sampling_metadata(rows, self.device, req_ids, grammar)
        result = None if self.greedy_head is None else self.greedy_head.sample(last, meta)
        if result is None:
            result = self.sampler(self.model.compute_logits(last), meta)  # [S, vocab]
        if meta.processors:  # e.g. penalties count the samples on the device
            meta.record(result.sampled)
        positions = ib.num_tokens[rows]
        sampled = SampledTokens(sample_idx, rows, req_ids, positions, result, self.device)
        ib.num_tokens[rows] += 1  # a placeholder until the id is read back
        self.pending.record(sampled)
        return AsyncModelRunnerOutput(output, sampled, self._read_back)

    def _read_back(self, output: ModelRunnerOutput, sampled: SampledTokens) -> None:
        """Wait for a step's sampled ids; put them in the output and in their rows."""
        tokens = sampled.wait()
        self.pending.read_back(sampled)
        ib = self.input_batch
        for i, token in zip(sampled.sample_idx.tolist(), tokens.tolist()):
            output.sampled_token_ids[i].append(token)
        # rows still held by the request that sampled get the id at its position
        held = np.fromiter(
            (ib.req_id_to_row.get(r) == row for r, row in zip(sampled.req_ids, sampled.rows)),
            bool,
            len(sampled.req_ids),
        )
        ib.token_ids[sampled.rows[held], sampled.positions[held]] = tokens[held]
        if sampled.result.logprobs is not None:
            attach_logprobs(output, sampled.sample_idx, sampled.result)
        if self.spec is not None:
            ends = (sampled.positions + 1).tolist()
            rows = zip(sampled.req_ids, sampled.rows.tolist(), ends, held.tolist())
            output.spec_token_ids = self.spec.propose([(r, w, e) for r, w, e, h in rows if h])

    def _logits_index(self, batch: StepBatch, sample_idx: np.ndarray) -> torch.Tensor | slice:
        """Rows of `hidden` to take logits from: each sampling request's last token."""
        if batch.is_decode_only and len(sample_idx) == len(batch.rows):
            return slice(0, len(batch.rows))  # every token samples: no index copy
        idx = batch.query_start_loc[1:][sample_idx] - 1
        return to_device(idx.astype(np.int64), self.device)


def _cpu_note(device: torch.device, dtype: torch.dtype) -> str:
    """What a CPU offers bf16 (dtype="auto" picks bf16 where it has AMX or AVX512-BF16), and
    which library runs the GEMMs here (`cpu_gemm_plan`)."""
    if device.type != "cpu":
        return ""
    note = f"; CPU bf16 units: {cpu_bf16_units() or 'none'}"
    if cpu_prepack_supported(device, dtype):
        note += f"; {cpu_gemm_plan().describe(dtype)}"
    return note


def _profile_sampling(rows: int, device: torch.device, penalties: Penalties) -> SamplingMetadata:
    """Random sampling with top-k, top-p and (neutral) penalties: the most memory the sampler
    may take. The penalty state stays allocated, so it counts against the KV budget too."""
    return SamplingMetadata(
        temperature=torch.ones(rows, device=device),
        all_greedy=False,
        all_random=True,
        top_k=torch.full((rows,), 50, dtype=torch.int64, device=device),
        top_p=torch.full((rows,), 0.9, device=device),
        min_p=None,
        processors=[(penalties, penalties.neutral(rows))],
    )
