"""Our rotary tables (`pagellm/layers/rope.py`) against HF's rotary modules, row by row: every
rope type we serve, partial rotary, attention factors, and (dynamic, longrope) the rows HF
uses for a token decoded at each position, past the original length."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Phi3Config

from pagellm.config import HFConfigView
from pagellm.engine.arg_utils import _resolve_max_model_len
from pagellm.layers.rope import cos_sin_table, long_rope, rope_parameters, rotary_dim

ORIGINAL_32 = {"original_max_position_embeddings": 32}
BASE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
CASES = {  # name: (config class, its kwargs, decode one position at a time)
    "default": (LlamaConfig, dict(max_position_embeddings=64), False),
    "linear": (LlamaConfig, dict(rope_scaling={"rope_type": "linear", "factor": 2.5}), False),
    "llama3": (
        LlamaConfig,
        dict(
            max_position_embeddings=256,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        False,
    ),
    "yarn": (
        LlamaConfig,
        dict(
            max_position_embeddings=64,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, **ORIGINAL_32},
        ),
        False,
    ),
    "yarn-mscale-betas": (
        LlamaConfig,
        dict(
            max_position_embeddings=128,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "beta_fast": 16,
                "beta_slow": 2,
            },
        ),
        False,
    ),
    "dynamic": (
        LlamaConfig,
        dict(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        True,
    ),
    "longrope-partial": (
        Phi3Config,
        dict(
            pad_token_id=0,
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            partial_rotary_factor=0.5,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
        ),
        True,
    ),
}


def _hf_rows(config, num_positions: int, one_at_a_time: bool) -> tuple[torch.Tensor, ...]:
    # imported here: transformers' modeling modules import triton, which must not happen
    # before test_kernels sets TRITON_INTERPRET=1 at collection
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cls = Phi3RotaryEmbedding if isinstance(config, Phi3Config) else LlamaRotaryEmbedding
    rope = cls(config)
    x = torch.zeros(1, dtype=torch.float32)
    if not one_at_a_time:
        return rope(x, torch.arange(num_positions)[None])
    rows = [rope(x, torch.tensor([[p]])) for p in range(num_positions)]  # decode steps
    return tuple(torch.cat([r[i] for r in rows], dim=1) for i in range(2))


@pytest.mark.parametrize("case", sorted(CASES))
def test_table_equals_hf(case):
    cls, kwargs, one_at_a_time = CASES[case]
    config = cls(**{**BASE, **kwargs})
    view = HFConfigView(**json.loads(config.to_json_string(use_diff=False)))  # as the core sees it
    num_positions = _resolve_max_model_len(view, None)
    theta, scaling = rope_parameters(view)
    dim = rotary_dim(view, 32)
    ours = cos_sin_table(dim, num_positions, theta, scaling)  # [P, dim]: cos | sin
    pairs = [(ours, _hf_rows(config, num_positions, one_at_a_time))]
    if long_rope(view) is not None:  # HF's rows of a sequence of k tokens (short factors),
        k, rows = long_rope(view)  # and of a longer one (long factors throughout)
        assert ours.shape[0] == 2 * rows == 2 * num_positions
        pairs = [(ours[:k], _hf_rows(config, k, False))]
        pairs.append((ours[rows:], _hf_rows(config, num_positions, False)))
    for table, (cos, sin) in pairs:  # cos, sin: [1, P, dim], halves repeated
        assert cos.shape[-1] == dim == (16 if case == "longrope-partial" else 32)
        # float32 rounding of angles up to ~100 rad (dynamic: torch's vectorized pow 1 ulp off)
        half = dim // 2
        torch.testing.assert_close(table[:, :half], cos[0, :, :half], atol=1e-5, rtol=0)
        torch.testing.assert_close(table[:, half:], sin[0, :, :half], atol=1e-5, rtol=0)


def test_max_model_len_grows_with_yarn_and_dynamic():
    def limit(**kwargs):
        view = HFConfigView(**json.loads(LlamaConfig(**BASE, **kwargs).to_json_string()))
        return _resolve_max_model_len(view, None)

    assert limit(max_position_embeddings=64) == 64
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    assert limit(max_position_embeddings=64, rope_scaling=yarn) == 128  # original x factor
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert limit(max_position_embeddings=32, rope_scaling=dynamic) == 64
