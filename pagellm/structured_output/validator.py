"""The whole check of an output constraint, as one pure function a killable worker process
can run: `validate(key, limits, vocab)` returns None or raises ValueError (the 400's message).

    1. limits on the text (limits.py): size, JSON nesting, counted repetitions, $refs;
    2. xgrammar's parse (no vocabulary);
    3. the parsed grammar (grammar_check.py): alternatives, nested repetitions, emptiness;
    4. with `vocab`, the compile against the model's vocabulary, as the EngineCore will do it.

Steps 1-3 are cheap once 1 has passed and run in-process too (`LLM`, and the server's thread
today). Step 4 is what a worker lane with a time and memory limit is for: its workers build the
vocabulary tables once, in an initializer (`init_worker(vocabulary_json)`), and `validate` is
given the id of those tables (`vocab_id(vocabulary_json)`), not the tables themselves.
The only state is that initializer-built cache.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from pagellm.structured_output.backend import XgrammarBackend, parse
from pagellm.structured_output.grammar_check import check_grammar
from pagellm.structured_output.limits import NAMES, check_limits

if TYPE_CHECKING:
    from pagellm.config import StructuredOutputsConfig

_backends: dict[str, XgrammarBackend] = {}  # vocab_id -> compiler, built by init_worker


def validate(
    key: tuple[str, str], limits: StructuredOutputsConfig, vocab: str | None = None
) -> None:
    """ValueError naming what is wrong with a constraint (StructuredOutputsParams.key()) or
    the limit it is over; None if the EngineCore will compile it. `vocab`: the id of
    vocabulary tables `init_worker` loaded in this process (step 4), or None."""
    grammar = checked_grammar(key, limits)
    if vocab is not None:
        backend = _backends.get(vocab)
        if backend is None:
            raise RuntimeError(f"no vocabulary {vocab!r} in this process: run init_worker first")
        backend.compile(key, grammar)


def checked_grammar(key: tuple[str, str], limits: StructuredOutputsConfig) -> Any:
    """Steps 1-3: the parsed xgrammar Grammar of a constraint that passed them."""
    check_limits(key, limits)
    grammar = parse(key)
    kind = key[0].split(":")[0]
    check_grammar(grammar.serialize_json(), kind, NAMES[kind], limits)
    return grammar


def init_worker(vocabulary_json: str) -> None:
    """A worker process's initializer: xgrammar's vocabulary tables from their JSON
    (`vocabulary_json()`), kept for `validate(..., vocab=vocab_id(vocabulary_json))`."""
    import xgrammar as xgr

    key = vocab_id(vocabulary_json)
    if key not in _backends:
        _backends[key] = XgrammarBackend(xgr.TokenizerInfo.deserialize_json(vocabulary_json))


def vocab_id(vocabulary_json: str) -> str:
    """A short name for vocabulary tables, to pass to `validate` instead of the tables."""
    return hashlib.sha256(vocabulary_json.encode()).hexdigest()[:16]


def vocabulary_json(tokenizer: Any, model_config: Any) -> str:
    """The tables the EngineCore compiles against (the model's vocabulary size, its EOS ids
    as stop tokens), as JSON for `init_worker`."""
    from pagellm.structured_output.backend import tokenizer_info
    from pagellm.structured_output.manager import stop_token_ids

    stop_ids = stop_token_ids(model_config, tokenizer.eos_token_id)
    return tokenizer_info(tokenizer, model_config.vocab_size, stop_ids).serialize_json()
