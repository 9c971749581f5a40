"""LoRA adapters through `pagellm serve` with the openai SDK: `--lora-modules` at start, a
request's `model` picking the adapter (greedy text equal to HF + PEFT's), `/v1/models` with
each adapter's `parent`, loading, using and unloading an adapter at run time, and the errors:
an unknown name (404 in OpenAI's shape), a bad adapter (400 naming its module), no API key
(401); the server keeps serving through them."""

from __future__ import annotations

import shutil

import openai
import pytest
from model_utils import hf_generate_greedy, hf_model
from server_utils import API_KEY, error_of, post, start_server, stop_server, wait_healthy
from transformers import AutoTokenizer

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

PROMPT = [1, 504, 2413, 314, 260, 3917, 282, 1015, 30]
NEW_TOKENS = 8
ADAPTERS = {
    "first": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "second": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "up_proj"]),
}


def _adapter(folder: str, name: str, out_dir, seed: int) -> tuple[str, list[int]]:
    """A PEFT adapter with random A and B; (its folder, HF + PEFT's greedy ids on PROMPT)."""
    import torch

    model = peft.get_peft_model(hf_model(folder), peft.LoraConfig(**ADAPTERS[name]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "lora_" in pname:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(out_dir / name)
    ids = hf_generate_greedy(model.base_model.model.eval(), [PROMPT], NEW_TOKENS)[0]
    return str(out_dir / name), ids


@pytest.fixture(scope="module")
def served(tiny_chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-server")
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    texts, paths = {}, {}
    for i, name in enumerate(ADAPTERS):
        paths[name], ids = _adapter(tiny_chat_model, name, tmp, seed=i)
        texts[name] = tokenizer.decode(ids, skip_special_tokens=True)
    base_ids = hf_generate_greedy(hf_model(tiny_chat_model), [PROMPT], NEW_TOKENS)[0]
    texts[None] = tokenizer.decode(base_ids, skip_special_tokens=True)
    args = [tiny_chat_model, "--max-model-len", "256", "--dtype", "float32", "--api-key", API_KEY]
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    at_start = shutil.copytree(paths["first"], tmp / "first_at_start")
    args += ["--lora-modules", f"first={at_start}"]
    srv = start_server(args, str(tmp / "server.log"))
    try:
        wait_healthy(srv)
        shutil.rmtree(at_start)  # read at start, as vLLM reads it: the first request needs none
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY)
        assert _complete(client, "first") == texts["first"]
        shutil.copytree(paths["first"], at_start)  # for a read again after an eviction
        yield srv, texts, paths, tiny_chat_model
    finally:
        stop_server(srv)


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0
    )
    assert out.model == model
    return out.choices[0].text


def test_adapters_served_load_use_unload(served, tmp_path):
    srv, texts, paths, base = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base, "first"}
    assert cards["first"].model_dump()["parent"] == base
    assert _complete(client, "first") == texts["first"] != texts[None]
    assert _complete(client, base) == texts[None]
    copy = shutil.copytree(paths["second"], tmp_path / "second")
    body = {"lora_name": "second", "lora_path": str(copy)}
    assert post(srv, "/v1/load_lora_adapter", body).status_code == 200
    shutil.rmtree(copy)  # read at load, as vLLM reads it: its requests need no folder
    assert "second" in {m.id for m in client.models.list().data}
    chat = client.chat.completions.create(
        model="second", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "second"
    assert _complete(client, "second") == texts["second"]
    inplace = {"lora_name": "second", "lora_path": paths["first"], "load_inplace": True}
    assert post(srv, "/v1/load_lora_adapter", inplace).status_code == 200  # vLLM's reload
    assert _complete(client, "second") == texts["first"]
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="second"):
        _complete(client, "second")
    assert _complete(client, "first") == texts["first"]


def test_errors_leave_the_server_serving(served, tmp_path):
    srv, texts, paths, base = served
    error = error_of(post(srv, "/v1/unload_lora_adapter", {"lora_name": "nobody"}), 404)
    assert "nobody" in error["message"]
    body = {"lora_name": "third", "lora_path": paths["first"]}
    assert post(srv, "/v1/load_lora_adapter", body, headers={}).status_code == 401
    error = error_of(post(srv, "/v1/load_lora_adapter", {**body, "lora_path": str(tmp_path)}), 400)
    assert "adapter_config.json" in error["message"]
    error = error_of(post(srv, "/v1/load_lora_adapter", {**body, "lora_name": "first"}), 400)
    assert "loaded already" in error["message"]
    # malformed folders: a JSON 400 naming the problem (was a plain-text 500 and a dropped
    # connection), whatever the folder holds
    for i, (config, weights) in enumerate(
        [
            ("[]", None),
            ('{"peft_type": "LORA"}', None),
            ('{"r": 0}', None),
            (None, b"not safetensors"),
        ]
    ):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(paths["first"], bad)
        if config is not None:
            (bad / "adapter_config.json").write_text(config)
        if weights is not None:
            (bad / "adapter_model.safetensors").write_bytes(weights)
        error = error_of(post(srv, "/v1/load_lora_adapter", {**body, "lora_path": str(bad)}), 400)
        assert str(bad) in error["message"], error
    # a name that cannot be echoed: refused before anything changes (was added, and then
    # GET /v1/models was a 400 for every client)
    error = error_of(post(srv, "/v1/load_lora_adapter", {**body, "lora_name": "\ud800"}), 400)
    assert "lora_name: must be valid Unicode" in error["message"]
    error_of(post(srv, "/v1/load_lora_adapter", {**body, "lora_name": ""}), 400)
    error_of(post(srv, "/v1/load_lora_adapter", {**body, "load_inplace": "yes"}), 400)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY)
    assert "first" in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        _complete(client, "third")
    assert _complete(client, "first") == texts["first"]
