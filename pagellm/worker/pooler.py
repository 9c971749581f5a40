"""Pooler: a pooling model's step outputs, in place of sampling.

A pooling request is prefill-only: its prompt may come in chunks over several steps, and the
step that computes its last prompt token finishes it with one vector. LAST takes that token's
final hidden state; MEAN sums every chunk's states (kept per request between steps; the
prefix cache is off for it, so every token is computed) and divides by the prompt's length;
CLS keeps the first token's. The model's `pool_head` (a classifier's score Linear) follows,
then each request's own settings: an embedding cut to `dimensions` and L2-normalized, a
classifier's logits through softmax (sigmoid for one label). All in float32.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.config import PoolerConfig
from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.pooling_params import PoolingParams
from pagellm.utils import read_weights, to_device
from pagellm.worker.step_batch import StepBatch


class Pooler:
    def __init__(self, config: PoolerConfig, model: torch.nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.params: dict[str, PoolingParams] = {}
        # MEAN: the sum of the states computed so far [hidden]; CLS: the first token's state
        self.partial: dict[str, torch.Tensor] = {}
        # sentence-transformers Dense modules: (weight [out, in], bias or None, activation)
        self.dense = [_load_dense(path, act) for path, act in config.dense]

    def add_request(self, req_id: str, params: PoolingParams | None) -> None:
        self.params[req_id] = params if params is not None else PoolingParams()
        self.partial.pop(req_id, None)  # a preempted request starts over

    def remove_request(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self.partial.pop(req_id, None)

    def prepare_step(self, batch: StepBatch) -> None:
        """A model with token type embeddings gets the step's: [T] int64 (zeros where a
        request has none)."""
        if not hasattr(self.model, "token_type_ids"):
            return
        types = [self.params[r].token_type_ids for r in batch.req_ids]
        if all(t is None for t in types):
            self.model.token_type_ids = None
            return
        flat = np.zeros(int(batch.query_start_loc[-1]), np.int64)
        starts = batch.seq_lens - batch.num_scheduled
        for i, ids in enumerate(types):
            if ids is not None:
                n, start = int(batch.num_scheduled[i]), int(starts[i])
                flat[batch.query_start_loc[i] : batch.query_start_loc[i] + n] = ids[
                    start : start + n
                ]
        self.model.token_type_ids = to_device(flat, self.device)

    def output(
        self, batch: StepBatch, hidden: torch.Tensor, num_tokens: np.ndarray
    ) -> ModelRunnerOutput:
        """The step's answer to the scheduler: no tokens, the finished requests' vectors."""
        output = ModelRunnerOutput(batch.req_ids, [[] for _ in batch.req_ids])
        output.pooler_output = self.pool(batch, hidden, num_tokens)
        return output

    def pool(
        self, batch: StepBatch, hidden: torch.Tensor, num_tokens: np.ndarray
    ) -> dict[str, bytes]:
        """hidden: [T, hidden] of the step; num_tokens: [R] each row's prompt length. The
        finished requests' vectors, as float32 bytes."""
        hidden = hidden[: int(batch.query_start_loc[-1])]  # a CUDA graph's padding rows off
        done = np.flatnonzero(batch.seq_lens == num_tokens)  # [F] rows whose prompt ends here
        kind = self.config.pooling_type
        if kind == "MEAN":
            self._add_sums(batch, hidden)
        elif kind == "CLS":
            self._keep_first(batch, hidden)
        if len(done) == 0:
            return {}
        req_ids = [batch.req_ids[i] for i in done.tolist()]
        if kind == "LAST":
            last = to_device((batch.query_start_loc[1:][done] - 1).astype(np.int64), self.device)
            pooled = hidden[last].float()  # [F, hidden]
        else:
            pooled = torch.stack([self.partial.pop(r) for r in req_ids])
            if kind == "MEAN":
                lens = torch.from_numpy(batch.seq_lens[done].astype(np.float32))
                pooled = pooled / lens.to(self.device)[:, None]
        # one copy to the host for the step (a per-request `.cpu()` waits on the device F times)
        out = self.model.pool_head(pooled).cpu()  # [F, out] float32
        return {
            r: self._finish(self.params[r], row).numpy().tobytes() for r, row in zip(req_ids, out)
        }

    def _add_sums(self, batch: StepBatch, hidden: torch.Tensor) -> None:
        """Each row's chunk summed into its request's running sum."""
        # segment_reduce, not index_add_: the CPU's index_add_ runs serially (45 ms for
        # [2048, 384], a tenth of a MiniLM step); the same sums, in the same order
        counts = to_device(batch.num_scheduled.astype(np.int64), self.device)
        sums = torch.segment_reduce(hidden.float(), "sum", lengths=counts)  # [R, hidden]
        for i, req_id in enumerate(batch.req_ids):
            before = self.partial.get(req_id)
            self.partial[req_id] = sums[i] if before is None else before + sums[i]

    def _keep_first(self, batch: StepBatch, hidden: torch.Tensor) -> None:
        starts = batch.seq_lens - batch.num_scheduled  # [R] each chunk's first position
        for i in np.flatnonzero(starts == 0).tolist():
            # a copy: a float32 row of a CUDA graph's output buffer is a view the next replay
            # overwrites (`.float()` of a float32 tensor is the tensor itself)
            row = hidden[int(batch.query_start_loc[i])]
            self.partial[batch.req_ids[i]] = row.to(torch.float32, copy=True)

    def _finish(self, params: PoolingParams, values: torch.Tensor) -> torch.Tensor:
        if self.config.task == "embed":
            for weight, bias, activation in self.dense:
                values = _ACTIVATIONS[activation](F.linear(values, weight, bias))
            if params.dimensions is not None:
                values = values[: params.dimensions]
            normalize = self.config.normalize if params.normalize is None else params.normalize
            values = F.normalize(values, dim=-1) if normalize else values
            if params.dimensions is None and self.config.truncate_dim is not None:
                values = values[: self.config.truncate_dim]  # after normalizing, as ST cuts
            return values
        if params.use_activation is False:
            return values
        activation = self.config.activation  # the config's; None: by the number of labels
        if params.task == "classify" and self.config.classify_activation is not None:
            activation = self.config.classify_activation  # HF's problem_type
        if activation == "identity":
            return values
        if activation == "sigmoid" or values.numel() == 1:
            return torch.sigmoid(values)
        return torch.softmax(values, dim=-1)


_ACTIVATIONS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": torch.relu,
                "sigmoid": torch.sigmoid, "gelu": F.gelu, "silu": F.silu}  # fmt: skip


def _load_dense(path: str, activation: str) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """A sentence-transformers Dense module's weights (its folder's model.safetensors or
    pytorch_model.bin: linear.weight, linear.bias), float32 on the host, where the pooled
    vectors are finished."""
    tensors = read_weights(path, "model", f"{path}: a Dense module")
    if tensors is None:
        tensors = read_weights(path, "pytorch_model", f"{path}: a Dense module")
    if tensors is None:
        raise ValueError(f"{path}: a Dense module without model.safetensors")
    if "linear.weight" not in tensors:
        raise ValueError(f"{path}: a Dense module's weights lack linear.weight")
    bias = tensors.get("linear.bias")
    return tensors["linear.weight"].float(), None if bias is None else bias.float(), activation
