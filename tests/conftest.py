"""Shared fixtures: the embedded model (loaded once per session) and HF references."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

# Without CUDA the Triton kernels' tests run them under the interpreter. It must be chosen before
# the first `import triton` of the session: a `@triton.jit` helper made by a module imported
# earlier without it cannot be called from an interpreted kernel ("Cannot call @triton.jit'd
# outside of the scope of a kernel"), so a test module's own setdefault came too late whenever
# another module collected first had imported the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a little robot who",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In machine learning, a transformer is",
    "My favourite recipe for pancakes:",
    "The quick brown fox",
]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    e2e_on_cpu = os.environ.get("PAGELLM_E2E_DEVICE") == "cpu"  # test_gpu_e2e's checks on the CPU
    for item in items:
        if "gpu" in item.keywords and not (e2e_on_cpu and item.module.__name__ == "test_gpu_e2e"):
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def embedded_gguf() -> tuple[str, str]:
    """(folder, file name) of the embedded SmolLM2 GGUF file."""
    from pagellm.loader import resolve_model_source

    path = resolve_model_source(None, "auto", None).path
    return os.path.dirname(path), os.path.basename(path)


@pytest.fixture(scope="session")
def hf_smollm(embedded_gguf):
    """HF transformers' own model from the same GGUF file, float32: the reference."""
    from transformers import AutoModelForCausalLM

    folder, name = embedded_gguf
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def llm():
    """One engine on the embedded model for the whole session (float32, greedy-exact)."""
    from pagellm import LLM

    engine = LLM(dtype="float32", max_model_len=1024, seed=0)
    yield engine
    engine.shutdown()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with HF's KV cache; EOS is not special (like ignore_eos=True)."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    # transformers renamed past_key_values to cache; use whichever this version takes
    cache_arg = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    past = None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            res = model(input_ids=ids, use_cache=True, **{cache_arg: past})
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """A tiny random Llama with the embedded model's tokenizer (vocabulary and all): an engine
    on it starts in seconds and its outputs detokenize to text."""
    from model_utils import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


SERVER_MAX_BODY = 256 * 1024  # the shared server's --max-request-body-bytes


@pytest.fixture(scope="session")
def api_server(request, tmp_path_factory):
    """One `pagellm serve` on the embedded model (float32, an API key, `--restart-engine`) for
    test_server.py and test_server_robustness.py; its engine core may be restarted by them."""
    from server_utils import API_KEY, start_server, stop_server, wait_healthy

    args = ["--max-model-len", "1024", "--dtype", "float32", "--api-key", API_KEY]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    args += ["--restart-engine", "--max-request-body-bytes", str(SERVER_MAX_BODY)]
    args += ["--log-stats-interval", "0.5"]
    srv = start_server(args, str(tmp_path_factory.mktemp("server") / "server.log"))
    try:
        request.getfixturevalue("llm")  # the in-process reference loads while the server boots
        wait_healthy(srv)
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="session")
def api_client(api_server):
    """The openai SDK's client of `api_server` (no retries: a test sees each reply)."""
    import openai
    from server_utils import API_KEY

    with openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(params=["none", "failing"])
def broken_compiler(request, monkeypatch, tmp_path) -> str:
    """No C++ compiler on PATH, or one that fails, and no cached CPU kernel to fall back on
    (`pagellm.cpp_build`); the kernels' cached loaders must be cleared around the test."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    if request.param == "none":
        monkeypatch.delenv("CXX", raising=False)
    else:
        monkeypatch.setenv("CXX", "/bin/false")
    return request.param
