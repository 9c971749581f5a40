"""Greedy steps on the CPU without reading the whole float LM head: the same argmax, exactly.

At batch 1 on the CPU the LM head is a large share of a decode step's bytes: SmolLM2-135M's
tied head is 49,152 x 576 float32 (113 MB a token, more than its int4 layers together). A
step whose rows are all greedy, with nothing between the logits and the argmax (no logits
processor: grammar, bans, bias, penalties; no logprobs), needs only the index of the largest
logit. `GreedyHead` finds it in two passes:

1. Approximate logits from an 8-bit copy of the head (Q8_0 blocks of 32, made once at load,
   a quarter of float32's bytes), by the GGUF block kernel (`pagellm.quantization.
   gguf_kernel`, exact products of the stored integers with x, float32 sums).
2. Each approximate logit a_r is within a bound B_r of the model's own logit: the row's
   largest quantization error times |x|_1, plus float32 rounding of both sums. The argmax is
   then among the rows with a_r + B_r >= max_j (a_j - B_j): a few rows, whose logits are
   computed from the float head and compared.

Both are one C++ call (`pagellm_greedy_argmax`, `pagellm/csrc/gguf_gemm.cpp`): each chunk of
64 approximate logits is bounded while still in cache, so no pass over the vocabulary follows
the 8-bit one (as torch ops the bound's six [S, V] passes cost 8% of a decode step).

The winner is the full head's argmax up to float32 summation order (the same difference as
one BLAS against another: two rows equal in real arithmetic may come out a bit apart, in either
order, from the full head as from the candidates' product; equal values go to the lower id
as `argmax` breaks them). A weight block whose scale overflows fp16 makes every bound NaN,
so the step computes the logits. When the bound is too
wide to help (more than a quarter of the vocabulary survives, or non-finite values), the
caller computes every logit as before. Built for tied float32 heads (the embedding's weight
is at hand for the exact rows; an untied head's weight lives only in its packed copy) of models
whose logits are that one product, for steps of at most MAX_ROWS sampled rows: the block
kernel's time grows with the rows where the float head's GEMM reads its bytes once for all of
them (SmolLM2's head on 2 cores: 0.8 / 1.1 / 1.4 / 2.1 ms for 1-4 rows against ~2.8 ms), and
a bf16 head is half the bytes already (1.5 ms, about what the 8-bit pass and the bound
cost). `PAGELLM_CPU_GREEDY_HEAD=0` turns it off.
"""

from __future__ import annotations

import logging

import torch

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.quantization import gguf_kernel
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import SamplerOutput

logger = logging.getLogger(__name__)

_BLOCK = gguf_kernel.BLOCK
_MAX_SHARE = 4  # more candidates than vocab / this: compute the full logits instead
MAX_ROWS = 3  # more sampled rows a step: the float head's one pass is cheaper


def quantize_q8_0(w: torch.Tensor) -> tuple[gguf_kernel.BlockPlanes, torch.Tensor]:
    """w [V, H] float -> (Q8_0 planes of w, each row's largest |w - dequantized| [V] float32).
    Per block of 32: d = max |w| / 127 in fp16, q = round(w / d) within +-127."""
    v, h = w.shape
    blocks = w.float().reshape(v, h // _BLOCK, _BLOCK)
    d = (blocks.abs().amax(-1) / 127.0).to(torch.float16)  # [V, H / 32]
    d32 = d.float()
    safe = torch.where(d32 > 0, d32, torch.ones_like(d32))
    q = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
    error = (blocks - q.float() * d32[..., None]).abs().amax(-1).amax(-1)  # [V]
    return gguf_kernel.BlockPlanes(q.reshape(v, h).contiguous(), d.contiguous(), None), error


class GreedyHead:
    def __init__(self, weight: torch.Tensor) -> None:
        # weight: [V, H] float32 on the CPU, the head the model's logits come from
        self.weight = weight.contiguous()  # the exact rows, read by the kernel
        self.planes, error = quantize_q8_0(weight)
        v, h = weight.shape
        # float32 sums of H products, in the approximation and in the exact logits: each off
        # the real value by at most ~H * 2^-24 * sum |x w| (<= |x|_1 max |w|); 2.2 covers both
        rounding = 2.2 * h * 2.0**-24 * weight.abs().amax(-1)
        self.row_bound = (error + rounding).contiguous()  # [V]: times |x|_1 bounds |a_r - l_r|
        self.max_candidates = v // _MAX_SHARE
        self._scratch = torch.empty(MAX_ROWS, v)  # the approximate logits, every step

    @classmethod
    def build(cls, model: torch.nn.Module, config: EngineConfig) -> GreedyHead | None:
        """For a CPU engine that samples (not pooling, no speculative decoding: its verify
        steps need the logits) of a model that names its head's float weight
        (`greedy_head_weight`), where the block kernel runs; else None."""
        if torch.device(config.device).type != "cpu" or not envs.cpu_greedy_head():
            return None
        if config.model_config.runner == "pooling" or config.speculative_config is not None:
            return None
        get = getattr(model, "greedy_head_weight", None)
        weight = get() if get is not None else None
        if weight is None or weight.device.type != "cpu" or not gguf_kernel.supported():
            return None
        if gguf_kernel.greedy_kernel() is None:
            return None
        if weight.dtype != torch.float32 or weight.shape[1] % _BLOCK:
            return None
        head = cls(weight)
        logger.info(
            "greedy steps read an 8-bit copy of the LM head (%.0f MB, the float head %.0f MB) "
            "and the few rows that can win from the float head",
            head.planes.qs.numel() * 1.0625 / 1e6, weight.numel() * weight.element_size() / 1e6,
        )  # fmt: skip
        return head

    def sample(self, hidden: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput | None:
        """The sampler's result for a step of greedy rows and nothing else (no logits
        processor, no logprobs), or None: the step needs the logits."""
        if not meta.all_greedy or meta.processors or meta.max_num_logprobs is not None:
            return None
        ids = self.argmax(hidden)
        return None if ids is None else SamplerOutput(ids)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [S, H] float32 (the final norm's output) -> [S] int64 ids of the largest
        logit of hidden @ weight^T per row, or None: compute the logits (more than MAX_ROWS
        rows, or the bound did not narrow)."""
        s = hidden.shape[0]
        if s > MAX_ROWS or hidden.dtype != torch.float32:
            return None
        x = hidden.contiguous()
        ids = torch.empty(s, dtype=torch.int64)
        planes = self.planes
        rc = gguf_kernel.greedy_kernel()(
            x.data_ptr(), s, x.shape[1], planes.qs.data_ptr(), planes.d.data_ptr(),
            planes.shape[0], self.row_bound.data_ptr(), self.weight.data_ptr(),
            self.max_candidates, self._scratch.data_ptr(), ids.data_ptr(),
        )  # fmt: skip
        if rc < 0:
            raise ValueError(f"greedy head: the kernel refused x {tuple(hidden.shape)}")
        return ids if rc == 0 else None
