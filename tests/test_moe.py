"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert) equal HF
transformers on the CPU in float32: logits through the paged KV cache, and greedy token ids
from the engine with requests batched and preempted. Also: expert weights from either
checkpoint layout, clear errors for expert tensors that do not fit, and the shipped MoE
configs at their real sizes."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy
from model_utils import (
    assert_fused_experts_load_alike,
    hf_logits,
    load_our_model,
    make_tiny_hf_model,
    run_paged,
)
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from pagellm import LLM, SamplingParams
from pagellm.layers.moe import SparseMoeBlock, is_sparse_layer

QWEN_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    # layer 0 dense (mlp_only_layers), layer 1 sparse; renormalized top-k
    "qwen3_moe": dict(**QWEN_MOE, head_dim=32, norm_topk_prob=True, mlp_only_layers=[0]),
    # every layer sparse, with a shared expert; top-k not renormalized
    "qwen2_moe": dict(**QWEN_MOE, shared_expert_intermediate_size=48, norm_topk_prob=False),
}
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy machine every matmul
    would wait for it: one thread for this module (the in-process engine's too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint folder, HF model) of one tiny random MoE model."""
    folder = make_tiny_hf_model(
        request.param, tmp_path_factory.mktemp(request.param), **FAMILIES[request.param]
    )
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in lengths]


def test_logits_match_hf_through_the_paged_cache(family):
    folder, hf = family
    ours = load_our_model(folder)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert sparse == ([False, True] if "qwen3" in folder else [True, True])
    prompts = _prompts(12, 30, 7, 1)
    results = run_paged(ours, prompts, num_decode_steps=4, chunk_size=7, stagger=True, shuffle=True)
    for tokens, logits in results:
        expected = hf_logits(hf, tokens)
        # logits up to ~17; float32 noise: on Mixtral's 30-token prompt 1.9e-4 from HF with
        # SDPA's prefill (HF's own kernel), 2.9e-4 with the CPU paged kernel, which is the
        # closer of the two to float64 attention (random prefills: 1.2e-6 vs 3e-6 off)
        torch.testing.assert_close(logits, expected, atol=4e-4, rtol=1e-5)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_ids_match_hf_batched_and_preempted(family, monkeypatch):
    """Four requests in one engine whose 24 KV blocks of 4 tokens cannot hold them all (the
    EngineCore in this process: the same code, without a second start-up)."""
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    folder, hf = family
    prompts = _prompts(5, 17, 33, 24, seed=2)
    args = dict(dtype="float32", block_size=4, num_gpu_blocks_override=24)
    requests = [{"prompt_token_ids": p} for p in prompts]
    with LLM(model=folder, max_num_batched_tokens=32, **args) as llm:
        outputs = llm.generate(requests, GREEDY_32, use_tqdm=False)
        assert llm.llm_engine.call_utility("get_stats")["num_preemptions"] > 0
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32)


def test_fused_expert_tensors_load_like_per_expert_ones(family, tmp_path):
    """transformers 5 keeps a layer's experts as `experts.gate_up_proj` / `down_proj`
    stacks: a checkpoint written from its state dict loads to the same parameters."""
    folder, hf = family
    assert_fused_experts_load_alike(folder, hf, tmp_path)


def _rewrite_checkpoint(folder: str, tmp_path, edit) -> str:
    from safetensors.torch import load_file

    state = load_file(f"{folder}/model.safetensors")
    edit(state)
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(open(f"{folder}/config.json").read())
    save_file(state, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_expert_tensors_that_do_not_fit_are_named(tmp_path):
    folder = make_tiny_hf_model("mixtral", tmp_path, **FAMILIES["mixtral"])
    prefix = "model.layers.1.block_sparse_moe.experts"

    def extra_expert(state):
        state[f"{prefix}.4.w1.weight"] = state[f"{prefix}.0.w1.weight"].clone()

    def wrong_shape(state):
        state[f"{prefix}.2.w3.weight"] = state[f"{prefix}.2.w3.weight"][:, :10].contiguous()

    def missing(state):
        del state[f"{prefix}.3.w2.weight"]

    extra = r"block_sparse_moe\.experts\.4\.w1\.weight'?: expert 4 of w13: the layer has 4"
    with pytest.raises(ValueError, match=extra):
        load_our_model(_rewrite_checkpoint(folder, tmp_path / "extra", extra_expert))
    shape = r"experts\.2\.w3\.weight'?: expert 2 of w13, shard 1: expected \(48, 64\), got"
    with pytest.raises(ValueError, match=shape):
        load_our_model(_rewrite_checkpoint(folder, tmp_path / "shape", wrong_shape))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.w2"):
        load_our_model(_rewrite_checkpoint(folder, tmp_path / "missing", missing))


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    from types import SimpleNamespace

    # the EngineCore's config view of transformers 5 names Qwen3-MoE's experts like Mixtral's
    cfg = SimpleNamespace(num_local_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_sparse_layer(cfg, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not is_sparse_layer(SimpleNamespace(num_experts=0), 0)


@pytest.mark.gpu
def test_dummy_qwen3_30b_a3b_weights_are_drawn_on_the_gpu():
    """61 GB of random bf16 weights come from the device's generator: the host's peak memory
    barely grows. Then a prefill and two decode steps through the fused-MoE kernels."""
    import resource

    from pagellm.attention.triton_backend import TritonAttentionBackend

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    model = load_our_model("qwen3-30b-a3b", torch.bfloat16, "dummy", "cuda", TritonAttentionBackend)
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    assert grown_gib < 4, f"host peak memory grew by {grown_gib:.1f} GiB"
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) * 2 > 60e9
    for _, logits in run_paged(model, _prompts(40, 3, 17), num_decode_steps=2):
        assert torch.isfinite(logits).all()
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    "name,params,experts", [("qwen3-30b-a3b", 30.53e9, (128, 8)), ("mixtral-8x7b", 46.70e9, (8, 2))]
)
def test_shipped_moe_configs_build_at_real_size(name, params, experts):
    """The shipped configs' models, built on `meta` (no memory), have the real sizes."""
    from pagellm.attention.torch_backend import TorchAttentionBackend
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.models import get_model_cls

    config = EngineArgs(model=name, load_format="dummy").create_model_config(torch.device("cpu"))
    assert config.source.kind == "dummy"
    with torch.device("meta"):
        model = get_model_cls(config.architecture)(config.hf_config, TorchAttentionBackend)
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - params) / params < 0.005, total
    block = model.model.layers[-1].mlp
    assert (block.experts.w13.shape[0], block.experts.top_k) == experts
