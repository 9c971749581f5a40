"""The CPU LoRA kernel (`pagellm/csrc/lora_cpu.cpp`) against a float64 reference, and LoRA
steps inside the C++ decoder loop (`pagellm.layers.cpu_decoder`): a step whose rows
mix adapters and the base model stays in the loop, which adds each projection's deltas with
the kernel the Python layers call (`pagellm.kernels.lora_cpu`), so its logits are the
layers' bit for bit (bf16 and float32, prefill chunks and decodes shuffled); every step
runs in the loop. Through the engine (float32, in this process so the loop's calls can be
counted): greedy ids equal HF + PEFT with adapters mixed in one batch, and the loop ran the
mixed steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_utils import assert_mixed_equal_hf_peft, make_peft_adapter
from model_utils import PagedRunner, hf_model, load_our_model, make_tiny_hf_model, run_paged

from pagellm import LLM, LoRARequest
from pagellm.config.lora import LoRAConfig
from pagellm.kernels import cpu_gemm, lora_cpu, panel_gemm
from pagellm.layers import cpu_decoder
from pagellm.lora.slots import LoRASlotManager
from pagellm.models.llama import LlamaDecoderLayer

peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
    pytest.mark.skipif(
        cpu_decoder._entry() is None or not lora_cpu.available(),
        reason="the C++ decoder loop and LoRA kernel need a compiler (x86)",
    ),
    pytest.mark.skipif(not panel_gemm.supported(torch.float32), reason="float32 panels"),
]

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> LoraConfig arguments
    "attn": dict(r=4, lora_alpha=8, target_modules=ATTN),
    "mlp_rs": dict(r=8, lora_alpha=4, target_modules=[*MLP, "q_proj"], use_rslora=True),
    "all": dict(r=2, lora_alpha=6, target_modules=ATTN + MLP),
}
PROMPTS = [[5, 9, 33, 2, 71, 8, 100, 41, 3], [7] * 23, [60, 61, 62], list(range(40, 75)), [9] * 5]
ASSIGNED = ("attn", None, "mlp_rs", "all", "attn")  # per prompt (None: the base model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("max_rank", [16, 8, 6])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_kernel_equals_reference(dtype, max_rank, kernel, monkeypatch):
    """`LoRASlots` on the CPU (the kernel; torch where it cannot be built): rows of three
    slots and none, parts of widths on and off the vector paths (K not a multiple of 4,
    columns not of 64), ranks under R, a part one slot lacks."""
    from pagellm.lora.layers import LoRASlots, LoRAStep

    if not kernel:
        monkeypatch.setattr(lora_cpu, "available", lambda: False)

    parts, k = {"q": (0, 136), "k": (136, 169), "v": (169, 200)}, 75
    step = LoRAStep()
    slots = LoRASlots(k, parts, 3, max_rank, step, torch.device("cpu"), dtype)
    gen, ref = torch.Generator().manual_seed(0), {}
    for slot, rank in enumerate((max_rank, 4, 1)):
        for name, (lo, hi) in parts.items():
            if (slot, name) != (1, "k"):
                a = torch.randn(rank, k, generator=gen).to(dtype)
                b = torch.randn(hi - lo, rank, generator=gen).to(dtype)
                slots.set_part(slot, name, a, b)
                ref[slot, name] = (a.double(), b.double())
    rows, scales = np.array([0, -1, 1, 2, 0, 1, -1, 2, 2, 0]), [0.5, 2.0, 1.0]
    step.set_rows(rows, scales, [max_rank, 4, 1], torch.device("cpu"))
    x, base = torch.randn(10, k, generator=gen).to(dtype), torch.randn(10, 200, generator=gen)
    base = base.to(dtype)
    got = slots(x, base.clone()).double()
    want = base.double()
    for (slot, name), (a, b) in ref.items():
        lo, hi = parts[name]
        for t in np.nonzero(rows == slot)[0]:
            want[t, lo:hi] += (x[t].double() @ a.T) @ b.T * scales[slot]
    tol = dict(atol=1e-3, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.25, rtol=8e-3)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[[1, 6]], want[[1, 6]])  # no adapter: untouched


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(tiny Llama folder, {name: LoRARequest}, {name or None: HF + PEFT model})."""
    tmp = tmp_path_factory.mktemp("lora_loop")
    folder = make_tiny_hf_model("llama", tmp, std=0.3)
    refs, loras = {None: hf_model(folder)}, {}
    for i, name in enumerate(ADAPTERS):
        path, refs[name] = make_peft_adapter(folder, ADAPTERS[name], tmp / name, seed=20 + i)
        loras[name] = LoRARequest(name, i + 1, path)
    return folder, loras, refs


@pytest.fixture
def our_kernels(monkeypatch):
    """The GEMM plan with our kernels (the loop's GEMMs), restored afterwards."""
    monkeypatch.setenv("PAGELLM_CPU_BF16_KERNEL", "1")
    monkeypatch.setenv("PAGELLM_CPU_FP32_GEMM", "pagellm")
    cpu_gemm.cpu_gemm_plan.cache_clear()
    yield
    cpu_gemm.cpu_gemm_plan.cache_clear()


def _run(model, manager, monkeypatch, loop: bool) -> tuple[list, int, int]:
    """run_paged with each step's rows under their adapters: (results, steps, loop calls)."""
    counts = {"steps": 0, "loop": 0}
    decoder = cpu_decoder.CpuDecoder.build(model.model, LlamaDecoderLayer) if loop else None
    if decoder is not None:
        run = decoder.run

        def counted(*args):
            counts["loop"] += 1
            return run(*args)

        decoder.run = counted
    model.model.cpu_decoder, model.model._cpu_decoder_built = decoder, True
    step = PagedRunner.step

    def with_adapters(runner, schedule):
        counts["steps"] += 1
        ids, sizes = [str(i) for i, _ in schedule], np.array([n for _, n in schedule])
        manager.prepare_step(ids, sizes)
        return step(runner, schedule)

    monkeypatch.setattr(PagedRunner, "step", with_adapters)
    out = run_paged(model, PROMPTS, num_decode_steps=4, chunk_size=6, stagger=True, shuffle=True)
    monkeypatch.setattr(PagedRunner, "step", step)
    return out, counts["steps"], counts["loop"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_mixed_lora_steps_stay_in_the_loop(adapters, our_kernels, monkeypatch, dtype):
    if dtype == torch.bfloat16 and not panel_gemm.supported():
        pytest.skip("bf16 panels need AVX512-BF16")
    folder, loras, _ = adapters
    model = load_our_model(folder, dtype=dtype)
    model.prepack_cpu_weights(batch_hint=16)  # as the runner does
    config = LoRAConfig(max_loras=3, max_lora_rank=16, max_cpu_loras=3)  # 16: the vector path
    manager = LoRASlotManager(model, config, torch.device("cpu"), dtype, 256)
    for i, name in enumerate(ASSIGNED):
        manager.add_request(str(i), None if name is None else loras[name])
    looped, steps, calls = _run(model, manager, monkeypatch, loop=True)
    assert steps > 5 and calls == steps  # every step, adapters mixed, in the loop
    plain, _, none = _run(model, manager, monkeypatch, loop=False)
    assert none == 0
    for (tokens_a, logits_a), (tokens_b, logits_b) in zip(looped, plain, strict=True):
        assert tokens_a == tokens_b
        assert torch.equal(logits_a, logits_b)
    for i in range(len(PROMPTS)):  # the adapters changed the output
        manager.add_request(str(i), None)
    base, _, _ = _run(model, manager, monkeypatch, loop=True)
    changed = [not torch.equal(a[1], b[1]) for a, b in zip(looped, base, strict=True)]
    assert changed == [name is not None for name in ASSIGNED]


def test_engine_mixed_adapters_in_the_loop_equal_hf_peft(adapters, our_kernels, monkeypatch):
    """float32 through the engine (in this process): HF + PEFT's greedy ids for a batch that
    mixes three adapters and the base model, the decoder layers in the C++ loop throughout."""
    folder, loras, refs = adapters
    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=32,
              enable_lora=True, max_loras=3, max_lora_rank=16)  # fmt: skip
    try:
        core = llm.llm_engine.engine_core.engine_core
        model = core.model_executor.driver_worker.model_runner.model.model
        calls = {"n": 0}
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)  # builds the loop
        decoder = model.cpu_decoder
        assert decoder is not None
        run = decoder.run

        def counted(*args):
            calls["n"] += 1
            return run(*args)

        decoder.run = counted
        layer_forward = LlamaDecoderLayer.forward
        monkeypatch.setattr(LlamaDecoderLayer, "forward", _refuse)
        assert_mixed_equal_hf_peft(llm, PROMPTS, ASSIGNED, loras, refs, new_tokens=8)
        monkeypatch.setattr(LlamaDecoderLayer, "forward", layer_forward)
        assert calls["n"] >= 8
    finally:
        llm.shutdown()


def _refuse(*args, **kwargs):
    raise AssertionError("a step left the C++ decoder loop for the Python layers")


def test_benchmark_script_runs(adapters, monkeypatch):
    """benchmarks/lora.py's CPU path on the tiny model (its PEFT folders, both workloads,
    both engines), so the script cannot rot."""
    from benchmark_modules import load

    monkeypatch.setenv("PAGELLM_ENABLE_MULTIPROCESSING", "0")
    argv = ["--model", adapters[0], "--rounds", "1", "--num-requests", "3", "--max-tokens", "3",
            "--batch1-requests", "2", "--num-adapters", "2", "--rank", "4"]  # fmt: skip
    result = load("lora").main(argv)
    for workload in ("batch1", "batched"):
        assert result[f"ratio_{workload}"] > 0 and len(result[f"load_{workload}_lora"]) == 1
