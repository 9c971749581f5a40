"""A model's `generation_config.json`, read as vLLM's `generation_config="auto"` reads it.

- `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` (and `max_new_tokens`, as
  `max_tokens`) become the default sampling parameters: `LLM.get_default_sampling_params()`,
  what `LLM.generate` uses without sampling params, and the server's defaults for fields a
  request leaves out;
- every id of its `eos_token_id` (one id or a list) ends a request, like the tokenizer's EOS
  (Llama 3 instruct ends a turn with 128009, not the tokenizer's 128001). Without the file,
  config.json's `eos_token_id` is used.

`generation_config="vllm"` takes nothing from the model (neutral defaults, the tokenizer's EOS
only); a folder path reads that folder's generation_config.json instead of the model's.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pagellm.loader.source import ModelSource

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    eos_token_ids: list[int] = field(default_factory=list)


def load_generation_config(source: ModelSource, hf_config: Any, mode: str) -> GenerationDefaults:
    if mode == "vllm":
        return GenerationDefaults()
    folder = _folder(source, mode)
    path = os.path.join(folder, FILE_NAME) if folder else None
    if path is None or not os.path.isfile(path):
        return GenerationDefaults(eos_token_ids=_ids(getattr(hf_config, "eos_token_id", None)))
    with open(path) as f:
        raw = json.load(f)
    defaults = GenerationDefaults(_sampling(raw), _ids(raw.get("eos_token_id")))
    logger.info(
        "From %s: default sampling params %s, EOS token ids %s "
        "(generation_config='vllm' ignores the file)",
        path,
        defaults.sampling or "{} (none set)",
        defaults.eos_token_ids,
    )
    return defaults


def _folder(source: ModelSource, mode: str) -> str | None:
    if mode != "auto":
        if not os.path.isdir(os.path.expanduser(mode)):
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a folder with {FILE_NAME}, "
                f"got {mode!r}"
            )
        return os.path.expanduser(mode)
    return source.path if os.path.isdir(source.path) else None


def _sampling(raw: dict[str, Any]) -> dict[str, Any]:
    sampling = {k: raw[k] for k in SAMPLING_FIELDS if raw.get(k) is not None}
    if raw.get("max_new_tokens") is not None:
        sampling["max_tokens"] = raw["max_new_tokens"]
    return sampling


def _ids(eos: int | list[int] | None) -> list[int]:
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(t) for t in eos]
