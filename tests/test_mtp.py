"""Speculative decoding with a checkpoint's own multi-token-prediction layer (`method: "mtp"`),
on the CPU in float32: a tiny random Xiaomi MiMo checkpoint (a Qwen2 decoder saved by
transformers, its config MiMo's: `model_type: "mimo"`, `num_nextn_predict_layers: 1`, and
`model.mtp_layers.0.*` added to its safetensors).

The target alone is HF's Qwen2 on the same weights (the MTP tensors skipped); with `mtp`,
greedy outputs equal speculation off token for token, drafts verified; every proposal is
what a plain-torch MTP layer (vLLM's formula, from the checkpoint's tensors, over HF's
hidden states of the target) drafts after the request's tokens; `mtp` on a target without
MTP layers is a start-up error naming the families served.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_utils import make_tiny_hf_model
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.config import SpeculativeConfig
from pagellm.engine.arg_utils import EngineArgs

K = 3
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SPEC = {"method": "mtp", "num_speculative_tokens": K, "adaptive": False}
SMALL = dict(
    dtype="float32", block_size=4, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4,
    num_gpu_blocks_override=40,
)  # fmt: skip
MTP = "model.mtp_layers.0."


def make_tiny_mimo(folder: Path, std: float = 0.3) -> str:
    """A random MiMo checkpoint: HF's Qwen2 saved, its config made MiMo's, an MTP layer's
    tensors added to its safetensors."""
    path = Path(make_tiny_hf_model("qwen2", folder))
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    cfg["auto_map"] = {"AutoConfig": "configuration_mimo.MiMoConfig"}  # as published
    (path / "config.json").write_text(json.dumps(cfg))
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = hidden // heads
    gen = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    shapes = {
        "self_attn.q_proj.weight": (heads * hd, hidden), "self_attn.q_proj.bias": (heads * hd,),
        "self_attn.k_proj.weight": (kv_heads * hd, hidden),
        "self_attn.k_proj.bias": (kv_heads * hd,),
        "self_attn.v_proj.weight": (kv_heads * hd, hidden),
        "self_attn.v_proj.bias": (kv_heads * hd,),
        "self_attn.o_proj.weight": (hidden, heads * hd), "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden), "mlp.down_proj.weight": (hidden, inter),
        "input_proj.weight": (hidden, 2 * hidden),
    }  # fmt: skip
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({MTP + name: randn(*shape) for name, shape in shapes.items()})
    for norm in ("token_layernorm", "hidden_layernorm", "input_layernorm",
                 "post_attention_layernorm", "final_layernorm"):  # fmt: skip
        tensors[f"{MTP}{norm}.weight"] = torch.rand(hidden, generator=gen) + 0.5
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return make_tiny_mimo(tmp_path_factory.mktemp("mimo"))


@pytest.fixture(scope="module")
def hf_target(target):
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 70)]


@pytest.fixture(scope="module")
def hf_ids(hf_target, prompts) -> list[list[int]]:
    """HF Qwen2's greedy continuations of the prompts."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(MAX_TOKENS):
                seq.append(int(hf_target(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(prompt) :])
    return out


def _generate(target: str, prompts: list[list[int]], **args) -> list:
    reqs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(model=target, **SMALL, **args) as llm:
        return llm.generate(reqs, GREEDY, use_tqdm=False)


def test_the_target_alone_is_qwen2_its_mtp_layers_skipped(target, prompts, hf_ids):
    outs = _generate(target, prompts)
    assert [o.outputs[0].token_ids for o in outs] == hf_ids


def test_greedy_outputs_equal_speculation_off(target, prompts, hf_ids, tmp_path):
    copy = shutil.copytree(target, tmp_path / "mimo")  # `model`: the MTP layers of this one
    spec = {**SPEC, "model": str(copy)}
    outs = _generate(target, prompts, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in outs] == hf_ids
    assert sum(o.metrics.num_draft_tokens for o in outs) > 50


def test_every_proposal_is_the_mtp_formula_over_the_checkpoint(target, hf_target, prompts):
    """In the EngineCore (in this process), after every step: each request's drafts are what
    the plain-torch MTP layer drafts after its tokens (async: steps without drafts overlap)."""
    from test_draft_model import check_every_proposal

    reference = DenseMtp(target, hf_target)
    spec = {**SPEC, "method": "mimo_mtp", "adaptive": True}  # vLLM's alias
    args = EngineArgs(model=target, speculative_config=spec, async_scheduling=True, **SMALL)
    checked, preemptions = check_every_proposal(args, prompts, reference.drafts)
    assert checked > 10 and preemptions > 0


def test_mtp_without_mtp_layers_is_a_start_up_error(tmp_path):
    qwen2 = make_tiny_hf_model("qwen2", tmp_path)
    with pytest.raises(ValueError, match=r"served for MiMoForCausalLM \(Xiaomi MiMo\)"):
        EngineArgs(speculative_config=SPEC).create_engine_config()  # the embedded model
    with pytest.raises(ValueError, match="is Qwen2ForCausalLM"):
        EngineArgs(model=qwen2, speculative_config=SPEC).create_engine_config()
    cfg = json.loads((Path(qwen2) / "config.json").read_text())
    cfg["architectures"] = ["MiMoForCausalLM"]  # a MiMo config without MTP layers
    (Path(qwen2) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="carries no multi-token-prediction layers"):
        EngineArgs(model=qwen2, speculative_config=SPEC).create_engine_config()


def test_mtp_aliases_and_an_optional_model():
    assert SpeculativeConfig.of({"method": "deepseek_mtp", "num_speculative_tokens": 2}).method \
        == "mtp"  # fmt: skip
    config = SpeculativeConfig.of(SPEC)
    assert config.model is None and config.num_lookahead_tokens == K
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.of({"method": "eagle3", "num_speculative_tokens": 2})


class DenseMtp:
    """vLLM's MiMo MTP layer in plain torch over whole sequences (no cache), from the
    checkpoint's tensors: h = input_proj([hidden_layernorm(target output at p),
    token_layernorm(embedding of token p + 1, zero at p = 0)]), a Qwen2 decoder layer,
    final_layernorm; the target's LM head scores it, and it is the next position's input."""

    def __init__(self, folder: str, hf_target) -> None:
        from transformers import Qwen2Model

        tensors = load_file(str(Path(folder) / "model.safetensors"))
        self.w = {k.removeprefix(MTP): v for k, v in tensors.items() if k.startswith(MTP)}
        self.target = hf_target
        config = {**hf_target.config.to_dict(), "num_hidden_layers": 1, "layer_types": None}
        config = hf_target.config.__class__(**config)
        self.block = Qwen2Model(config).eval()  # its layer and final norm: the MTP layer's
        layer = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
        state = {f"layers.0.{k}": v for k, v in self.w.items() if k.startswith(layer)}
        state["norm.weight"] = self.w["final_layernorm.weight"]
        state["embed_tokens.weight"] = hf_target.model.embed_tokens.weight
        self.block.load_state_dict(state)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        with torch.no_grad():
            hidden = self.target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
            ids, out = list(tokens[1:]), []
            for _ in range(k):
                embeds = self.target.model.embed_tokens(torch.tensor(ids))
                embeds[0] = 0.0  # position 0
                x = torch.cat([self._rms(hidden, "hidden_layernorm"),
                               self._rms(embeds, "token_layernorm")], -1)  # fmt: skip
                x = x @ self.w["input_proj.weight"].T
                outputs = self.block(inputs_embeds=x[None]).last_hidden_state[0]
                out.append(int(self.target.lm_head(outputs[-1]).argmax()))
                hidden, ids = torch.cat([hidden, outputs[-1:]]), ids + [out[-1]]
        return out

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = self.target.config.rms_norm_eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.w[f"{name}.weight"]
