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

from typing import Any

import torch

from pagellm.structured_output.errors import user_message
from pagellm.structured_output.limits import NAMES

# the longest whitespace run a JSON schema's grammar allows: enough for indentation, and a
# model cannot loop on newlines until max_tokens
MAX_WHITESPACE = 24


def parse(key: tuple[str, str]) -> Any:
    """The xgrammar Grammar of a constraint (StructuredOutputsParams.key()), as the compile
    will see it; ValueError in our words if it is not a valid schema, regex or grammar.
    No vocabulary: cheap once its limits are checked (`limits.check_limits`)."""
    import xgrammar as xgr

    kind, spec = key
    compact = kind.endswith(":compact")
    kind = kind.split(":")[0]
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(
                spec, any_whitespace=not compact, max_whitespace_cnt=MAX_WHITESPACE
            )
        if kind == "json_object":  # a JSON object, as OpenAI's json_object mode and vLLM
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=not compact, max_whitespace_cnt=MAX_WHITESPACE
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        return xgr.Grammar.from_ebnf(spec)
    except Exception as e:  # RuntimeError from C++; anything else is not the user's to read
        raise ValueError(user_message(NAMES[kind], e)) from None


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's vocabulary tables (`TokenizerInfo`) for a HF tokenizer and the model's
    vocabulary size; `serialize_json()` carries them to another process."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )


class XgrammarBackend:
    """A grammar compiler for one vocabulary (a `TokenizerInfo`). Thread-safe: compiles run
    in worker threads."""

    def __init__(self, info: Any) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.reasoning_ids: tuple[int, int] | None = None  # (<think>, </think>) if parsed

    def compile(self, key: tuple[str, str], grammar: Any = None) -> Any:
        """A CompiledGrammar for StructuredOutputsParams.key() (`grammar`: its parse, if
        done); ValueError if it is invalid."""
        if grammar is None:
            grammar = parse(key)
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as e:  # e.g. a Token(...) id outside the vocabulary
            raise ValueError(user_message(NAMES[key[0].split(":")[0]], e)) from None

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(vocab_size / 32)] int32, every token allowed."""
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)


def stop_token_ids(model_config: Any, tokenizer_eos: int | None) -> list[int]:
    """The ids a finished grammar allows: the model's EOS ids (config, tokenizer and
    generation config)."""
    eos = getattr(model_config.hf_config, "eos_token_id", None)
    ids = [*(eos if isinstance(eos, list) else [eos]), tokenizer_eos, *model_config.eos_token_ids]
    return sorted({i for i in ids if i is not None and i < model_config.vocab_size})
