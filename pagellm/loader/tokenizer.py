"""The HF fast tokenizer of a model source.

Converting a GGUF vocabulary to a fast tokenizer takes ~6 s, so the result is saved once under
`$PAGELLM_CACHE_DIR/tokenizers/<file stem>-<key>` (default `~/.cache/pagellm`), the key hashing
the file's absolute path, size and mtime, and loaded from there afterwards (~0.3 s).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagellm import envs
from pagellm.loader.gguf_file import read_gguf
from pagellm.loader.source import ModelSource, has_tokenizer_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase | None:
    """A fast tokenizer, or None for a folder without tokenizer files (a shipped config, a test
    checkpoint): such a model can still be driven with token ids. transformers is imported
    only here: the EngineCore process never needs it."""
    if source.tokenizer is not None:
        return _from_pretrained(source.tokenizer)
    if source.path.endswith(".gguf"):
        return gguf_tokenizer(source.path)
    if not has_tokenizer_files(source.path):
        return None
    return _from_pretrained(source.path)


def _from_pretrained(folder: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # a broken or partial tokenizer: say which folder
        raise ValueError(f"the tokenizer in {os.path.abspath(folder)} cannot be loaded: {e}") from e


def gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer and chat template stored in a GGUF file, through the disk cache."""
    from transformers import AutoTokenizer

    cached = tokenizer_cache_dir(path)
    gguf = read_gguf(path)
    if (cached / "tokenizer.json").is_file():
        return _gguf_special_tokens(AutoTokenizer.from_pretrained(str(cached)), gguf)
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = _gguf_special_tokens(AutoTokenizer.from_pretrained(folder, gguf_file=name), gguf)
    if not tokenizer.chat_template:
        tokenizer.chat_template = gguf.get("tokenizer.chat_template")
    _save_atomically(tokenizer, cached)
    return tokenizer


_SPECIAL_TOKENS = {  # the tokenizer's attribute: the GGUF key of its id
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _gguf_special_tokens(tokenizer: PreTrainedTokenizerBase, gguf: Any) -> PreTrainedTokenizerBase:
    """The special tokens the file names, whatever transformers' conversion made of them
    (transformers 5.17 gave the embedded SmolLM2 <|im_start|> as its EOS, where the file, and
    later versions, say <|im_end|>: replies and grammars then ended on the wrong token)."""
    for attr, key in _SPECIAL_TOKENS.items():
        token_id = gguf.get(key)
        if token_id is not None and 0 <= int(token_id) < len(tokenizer):
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(token_id)))
    return tokenizer


def tokenizer_cache_dir(path: str) -> Path:
    stat = os.stat(path)
    ident = f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    root = os.path.expanduser(envs.cache_dir())
    return Path(root) / "tokenizers" / f"{Path(path).stem}-{key}"


def _save_atomically(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save to a private folder, then rename: concurrent processes never see half a cache."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(tmp))
        os.rename(tmp, target)
    except OSError:  # another process won the race, or the cache is not writable
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
