"""Hugging Face Hub ids (`org/name`) to local snapshot folders, through `huggingface_hub`.

Only what the engine reads is fetched: config and generation config, tokenizer files, and
the weights: the shards a `*.index.json` names, else the top-level `*.safetensors`, else the
top-level `*.bin` (PyTorch) files. The cache is huggingface_hub's own (`HF_HOME`,
`HF_HUB_CACHE`, or `download_dir`); `HF_TOKEN` is sent by huggingface_hub; with
`HF_HUB_OFFLINE=1` (read when called, not at import) only the cache is looked at. A Hub that
cannot be reached falls back to the cache too.
"""

from __future__ import annotations

import fnmatch
import json
import os

# config, generation config, tokenizer and chat template files, and the weights' index files
META_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt"]
TOKENIZER_PATTERNS += ["*.model", "chat_template.*", "added_tokens.json", "config.json"]
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
ADAPTER_PATTERNS = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "scheduler.bin", "scaler.bin")


class HubModelNotFound(ValueError):
    """A Hub id that is neither cached nor downloadable; the message says what was tried."""


def hub_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def download_model(
    repo_id: str, revision: str | None, cache_dir: str | None, with_weights: bool
) -> str:
    """The local snapshot folder of `repo_id` with its config, tokenizer and (if asked)
    weights; raises HubModelNotFound."""
    listing, reason = _list_files(repo_id, revision)
    folder = _snapshot(repo_id, revision, cache_dir, META_PATTERNS, reason)
    if not with_weights:
        return folder
    weights = _index_shards(folder) or _top_level_weights(listing)
    if not weights:  # the repository has none: the folder's check says so
        return folder
    return _snapshot(repo_id, revision, cache_dir, weights, reason)


def download_config(repo_id: str, revision: str | None, cache_dir: str | None) -> str:
    """The local snapshot folder of `repo_id` with its config.json only (`pagellm plan`)."""
    _, reason = _list_files(repo_id, revision)
    return _snapshot(repo_id, revision, cache_dir, ["config.json"], reason)


def download_adapter(repo_id: str, cache_dir: str | None = None) -> str:
    """The local snapshot folder of a PEFT adapter's repo (its config and weights files)."""
    _, reason = _list_files(repo_id, None)
    return _snapshot(repo_id, None, cache_dir, ADAPTER_PATTERNS, reason)


def download_tokenizer(repo_id: str, revision: str | None, cache_dir: str | None) -> str:
    _, reason = _list_files(repo_id, revision)
    return _snapshot(repo_id, revision, cache_dir, TOKENIZER_PATTERNS, reason)


def _list_files(repo_id: str, revision: str | None) -> tuple[list[str] | None, str | None]:
    """(the repo's files, None) when the Hub answers, else (None, why not)."""
    if hub_offline():
        return None, "HF_HUB_OFFLINE is set, so the Hub was not asked"
    from huggingface_hub import HfApi

    try:
        return HfApi().list_repo_files(repo_id, revision=revision), None
    except Exception as e:  # not found, gated, no network: the cache may still have it
        return None, f"the Hub answered {type(e).__name__}: {_first_line(e)}"


def _snapshot(
    repo_id: str,
    revision: str | None,
    cache_dir: str | None,
    patterns: list[str],
    reason: str | None,
) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=patterns,
            local_files_only=reason is not None,
        )
    except Exception as e:
        raise HubModelNotFound(_not_found(repo_id, revision, cache_dir, reason, e)) from e


def _not_found(
    repo_id: str, revision: str | None, cache_dir: str | None, reason: str | None, e: Exception
) -> str:
    from huggingface_hub import constants

    cache = os.path.abspath(os.path.expanduser(cache_dir or constants.HF_HUB_CACHE))
    tried = f"not a local file or folder ({os.path.abspath(repo_id)})"
    tried += f"; not in the Hugging Face cache {cache}"
    if revision:
        tried += f" at revision {revision!r}"
    tried += f"; {reason}" if reason else f"; the download failed: {_first_line(e)}"
    return f"model {repo_id!r} was not found: {tried}"


def _index_shards(folder: str) -> list[str]:
    """The weight files named by a sharded checkpoint's index, if the snapshot has one."""
    for index in WEIGHT_INDEXES:
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            with open(path) as f:
                return sorted(set(json.load(f)["weight_map"].values()))
    return []


def _top_level_weights(listing: list[str] | None) -> list[str]:
    """`*.safetensors` at the top level, else `*.bin`; offline (no listing): patterns."""
    if listing is None:
        return ["*.safetensors", "*.bin"]
    top = [name for name in listing if "/" not in name and name not in _NOT_WEIGHTS]
    return fnmatch.filter(top, "*.safetensors") or fnmatch.filter(top, "*.bin")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
