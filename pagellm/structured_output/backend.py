"""The xgrammar backend: parse a constraint (no tokenizer), compile it against a vocabulary,
and the per-request matcher that fills a token bitmask and follows the sampled tokens.

xgrammar imports torch and transformers (seconds), so it is imported here, lazily: by the
caller's input processor when a constrained request first arrives, and by the EngineCore's
compile threads, never by its step loop.

A bitmask row holds ceil(vocab_size / 32) int32 words; bit j of word i allows token 32 i + j.
The vocabulary is the model's (its logits' width), which may be larger than the tokenizer's:
the ids past the tokenizer's are never allowed.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# the longest whitespace run a JSON schema's grammar allows: enough for indentation, and a
# model cannot loop on newlines until max_tokens
MAX_WHITESPACE = 24
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] [^:]+:\d+: (Check failed: \(.*?\) is false: )?")


def parse(key: tuple[str, str]) -> None:
    """Raise ValueError naming what is wrong if a constraint (StructuredOutputsParams.key())
    is not a valid schema, regex or grammar. Cheap (no vocabulary): the caller runs it before
    a request is queued."""
    import xgrammar as xgr

    kind, spec = key[0].split(":")[0], key[1]
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except RuntimeError as e:
        raise ValueError(f"invalid {_NAMES[kind]}: {clean_error(e)}") from None


_NAMES = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}


def clean_error(error: Exception) -> str:
    """xgrammar's message without its C++ time stamp and source location."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(error).strip().splitlines()]
    return " ".join(line for line in lines if line)


class XgrammarBackend:
    """A grammar compiler for one vocabulary. Thread-safe: compiles run in worker threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.reasoning_ids: tuple[int, int] | None = None  # (<think>, </think>) if parsed

    def compile(self, key: tuple[str, str]) -> Any:
        """A CompiledGrammar for StructuredOutputsParams.key(); ValueError if it is invalid."""
        kind, spec = key
        compact = kind.endswith(":compact")
        kind = kind.split(":")[0]
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(
                    spec, any_whitespace=not compact, max_whitespace_cnt=MAX_WHITESPACE
                )
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            return self.compiler.compile_grammar(spec)
        except RuntimeError as e:
            raise ValueError(f"cannot compile the {kind} constraint: {clean_error(e)}") from None

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(vocab_size / 32)] int32, every token allowed."""
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)
