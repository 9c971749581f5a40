"""LoRA on CUDA with CUDA graphs: decode steps replay graphs whose LoRA kernels read each
row's slot and each slot's scale from buffers the step fills before the replay (a graph's
padding rows -1). A tiny Llama in float32 serves three adapters over two slots, mixed with
base-model requests; the graphs engine's greedy ids equal the eager engine's and HF + PEFT's
(on the CPU), and graphs were replayed. The second call puts an adapter of MLP targets only
into the slot of one with attention targets too: the slot's old parts must read as zero.
Needs a CUDA device (the merger's H100); skipped elsewhere. Graphs with LoRA are the default
(PAGELLM_LORA_CUDA_GRAPHS=0 turns them off)."""

from __future__ import annotations

import pytest
import torch
from lora_utils import make_peft_adapter
from model_utils import hf_generate_greedy, hf_model, make_tiny_hf_model, save_tiny_tokenizer

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.worker.cuda_graphs import CudaGraphRunner

pytest.importorskip("peft")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
]

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = [
    dict(r=8, lora_alpha=16, target_modules=ATTN + MLP),
    dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
    dict(r=2, lora_alpha=6, target_modules=MLP),
]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
CALLS = [[0, None, 1, 0, None], [2, 1, None]]  # adapters per prompt, two generate calls


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-gpu")
    folder = make_tiny_hf_model("llama", tmp)
    save_tiny_tokenizer(folder)
    refs, loras = {None: hf_model(folder)}, {None: None}
    for i, config in enumerate(ADAPTERS):
        path, refs[i] = make_peft_adapter(folder, config, tmp / f"a{i}", seed=40 + i, std=0.2)
        loras[i] = LoRARequest(f"a{i}", i + 1, path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(6, 500, (9 + 5 * i,), generator=gen).tolist() for i in range(5)]
    return folder, loras, refs, prompts


def _serve(folder, loras, prompts, monkeypatch, enforce_eager: bool):
    """Each call's greedy ids and the graph replays the engine made."""
    replays = []
    replay = CudaGraphRunner.replay

    def counted(self, size):
        replays.append(size)
        return replay(self, size)

    monkeypatch.setattr(CudaGraphRunner, "replay", counted)
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")  # the runner in this process
    monkeypatch.delenv("PAGELLM_LORA_CUDA_GRAPHS", raising=False)  # the default: graphs
    ids = []
    with LLM(
        folder, dtype="float32", device="cuda", max_model_len=128, max_num_seqs=8,
        kv_cache_memory_bytes=1 << 24, enforce_eager=enforce_eager, enable_lora=True,
        max_loras=2, max_lora_rank=8,
    ) as llm:  # fmt: skip
        for names in CALLS:
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts[: len(names)]], GREEDY,
                use_tqdm=False, lora_request=[loras[n] for n in names],
            )  # fmt: skip
            ids.append([o.outputs[0].token_ids for o in outs])
    return ids, replays


def test_lora_decode_replays_graphs_and_equals_eager_and_hf_peft(setup, monkeypatch):
    folder, loras, refs, prompts = setup
    graphed, replays = _serve(folder, loras, prompts, monkeypatch, enforce_eager=False)
    assert len(replays) >= NEW_TOKENS  # decode steps replayed graphs
    eager, none = _serve(folder, loras, prompts, monkeypatch, enforce_eager=True)
    assert none == []
    assert graphed == eager
    for names, got in zip(CALLS, graphed):
        for prompt, name, ids in zip(prompts, names, got):
            want = hf_generate_greedy(refs[name], [prompt], NEW_TOKENS)[0]
            assert ids == want, name
            if name is not None:
                assert want != hf_generate_greedy(refs[None], [prompt], NEW_TOKENS)[0], name
