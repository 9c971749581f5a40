"""Speculative decoding with an EAGLE-3 head (`method: "eagle3"`), on the CPU in float32: a tiny
random Llama target of 8 layers and a random head in the published checkpoint layout
(`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`; a draft vocabulary of a quarter of the
target's, mapped by `d2t`).

Greedy outputs equal speculation off token for token (prompts batched, prefilled in chunks,
preempted by a small KV cache); every proposal is what a plain-torch EAGLE-3 head computes
from HF's hidden states of the target (the residual stream entering layers 2, 4 and 5); a
head that does not fit its target is a start-up error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_utils import make_tiny_hf_model
from safetensors.torch import save_file

from pagellm import LLM, SamplingParams
from pagellm.engine.arg_utils import EngineArgs
from pagellm.models.eagle3 import aux_hidden_layers

K = 3
LAYERS = 8  # EAGLE-3 reads layers (2, n // 2, n - 3): 2, 4, 5
AUX = (2, 4, 5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SMALL = dict(
    dtype="float32", block_size=4, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4,
    num_gpu_blocks_override=50,
)  # fmt: skip


def _spec(head: str) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": K, "adaptive": False}


def make_eagle3_head(folder: Path, target: str, std: float = 0.3, **overrides) -> str:
    """A random EAGLE-3 head for the tiny `target`, saved as the published checkpoints are."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, vocab = hidden // heads, cfg["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "vocab_size": vocab,
        "draft_vocab_size": vocab // 4, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, **overrides,
    }  # fmt: skip
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    draft_vocab = config["draft_vocab_size"]
    target_ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    tensors = {
        "midlayer.self_attn.q_proj.weight": randn(heads * hd, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": randn(kv_heads * hd, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": randn(kv_heads * hd, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": randn(hidden, heads * hd),
        "midlayer.mlp.gate_proj.weight": randn(inter, hidden),
        "midlayer.mlp.up_proj.weight": randn(inter, hidden),
        "midlayer.mlp.down_proj.weight": randn(hidden, inter),
        "fc.weight": randn(hidden, 3 * config.get("target_hidden_size", hidden)),
        "lm_head.weight": randn(draft_vocab, hidden),
        "d2t": target_ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = torch.rand(hidden, generator=gen) + 0.5
    tensors["norm.weight"] = torch.rand(hidden, generator=gen) + 0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("target"), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory) -> str:
    return make_eagle3_head(tmp_path_factory.mktemp("head") / "eagle3", target)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 17, 33, 70, 40)]


@pytest.fixture(scope="module")
def reference_ids(target, prompts) -> list[list[int]]:
    reqs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(model=target, dtype="float32", block_size=4, max_model_len=256) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(reqs, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-adaptive"])
def test_greedy_outputs_equal_speculation_off(
    target, head, prompts, reference_ids, async_scheduling
):
    """Async with adaptive drafts: a random head's drafts fail, most steps go without and
    overlap (the next step queued before the last one's tokens are back)."""
    spec = {**_spec(head), "adaptive": async_scheduling}
    reqs = [{"prompt_token_ids": p} for p in prompts]
    args = dict(speculative_config=spec, async_scheduling=async_scheduling, **SMALL)
    with LLM(model=target, **args) as llm:
        outs = llm.generate(reqs, GREEDY, use_tqdm=False)
        stats = llm.llm_engine.engine_core.call_utility("get_stats")
    assert [o.outputs[0].token_ids for o in outs] == reference_ids
    assert sum(o.metrics.num_draft_tokens for o in outs) > (20 if async_scheduling else 100)
    assert stats["num_preemptions"] > 0


def test_every_proposal_is_the_heads_own(target, head, prompts):
    """In the EngineCore (in this process), after every step: each request's drafts are what
    a dense EAGLE-3 head over HF's hidden states of the target proposes after its tokens."""
    from test_draft_model import check_every_proposal
    from transformers import AutoModelForCausalLM

    hf_target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    reference = DenseEagle3(head, hf_target)
    for adaptive in (False, True):  # adaptive, async: steps without drafts overlap
        spec = {**_spec(head), "adaptive": adaptive}
        args = EngineArgs(model=target, speculative_config=spec, async_scheduling=adaptive, **SMALL)
        checked, preemptions = check_every_proposal(args, prompts, reference.drafts)
        assert checked > (10 if adaptive else 40) and preemptions > 0


def test_a_head_that_does_not_fit_is_a_start_up_error(target, head, tmp_path):
    args = dict(model=target, dtype="float32", max_model_len=256)
    config = EngineArgs(**args, speculative_config=_spec(head)).create_engine_config()
    assert config.draft_model_config.hf_config.max_position_embeddings == 256  # stretched
    assert config.enforce_eager
    wide = make_eagle3_head(tmp_path / "wide", target, target_hidden_size=96)
    with pytest.raises(ValueError, match="reads hidden states of size 96"):
        EngineArgs(**args, speculative_config=_spec(wide)).create_engine_config()
    other = make_eagle3_head(tmp_path / "vocab", target, vocab_size=640)
    with pytest.raises(ValueError, match="vocabulary of 640 tokens"):
        EngineArgs(**args, speculative_config=_spec(other)).create_engine_config()
    with pytest.raises(ValueError, match="needs an EAGLE-3 head"):
        EngineArgs(**args, speculative_config=_spec(target)).create_engine_config()
    with pytest.raises(ValueError, match="is an EAGLE-3 head: serve its target"):
        EngineArgs(model=head, dtype="float32").create_engine_config()


def test_aux_layers_from_the_config_or_eagle3s_default():
    class Config:
        eagle_config = {"eagle_aux_hidden_state_layer_ids": [5, 1, 3]}

    assert aux_hidden_layers(Config(), 8) == (1, 3, 5)
    assert aux_hidden_layers(object(), 32) == (2, 16, 29)
    with pytest.raises(ValueError, match="3 distinct layers"):
        aux_hidden_layers(object(), 4)  # (2, 2, 1)


class DenseEagle3:
    """EAGLE-3's head in plain torch over whole sequences (no cache), from the checkpoint."""

    def __init__(self, folder: str, hf_target) -> None:
        from safetensors.torch import load_file

        self.w = load_file(str(Path(folder) / "model.safetensors"))
        self.cfg = json.loads((Path(folder) / "config.json").read_text())
        self.target = hf_target

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        with torch.no_grad():
            states = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            feature = torch.cat([states[i][0] for i in AUX], dim=-1)[:-1] @ self.w["fc.weight"].T
            ids, out = list(tokens[1:]), []
            for _ in range(k):
                hidden = self._layer(feature, torch.tensor(ids))
                logits = self._rms(hidden[-1], "norm") @ self.w["lm_head.weight"].T
                draft = int(logits.argmax())
                out.append(draft + int(self.w["d2t"][draft]))
                feature, ids = torch.cat([feature, hidden[-1:]]), ids + [out[-1]]
        return out

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = self.cfg["rms_norm_eps"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.w[f"{name}.weight"]

    def _layer(self, feature: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w, n = self.w, len(ids)
        embeds = self.target.model.embed_tokens(ids)
        normed = self._rms(embeds, "midlayer.input_layernorm")
        x = torch.cat([normed, self._rms(feature, "midlayer.hidden_norm")], -1)
        heads, kv_heads = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        hd = self.cfg["hidden_size"] // heads
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, hd)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, hd)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, hd)
        inv = 1.0 / self.cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
        angles = torch.arange(n).float()[:, None] * inv
        cos, sin = [torch.cat([f(angles)] * 2, -1)[:, None] for f in (torch.cos, torch.sin)]

        def rotate(t: torch.Tensor) -> torch.Tensor:
            half = torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1)
            return t * cos + half * sin

        q, k = rotate(q), rotate(k).repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
        hidden = feature + attn @ w["midlayer.self_attn.o_proj.weight"].T
        h = self._rms(hidden, "midlayer.post_attention_layernorm")
        gate, up = h @ w["midlayer.mlp.gate_proj.weight"].T, h @ w["midlayer.mlp.up_proj.weight"].T
        return hidden + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
