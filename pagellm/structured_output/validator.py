"""The whole check of an output constraint, as one pure function a killable worker process
can run: `validate(key, limits, vocab)` returns None or raises ValueError (the 400's message).

    1. limits on the text (limits.py): size, JSON nesting, counted repetitions, $refs;
    2. xgrammar's parse (no vocabulary);
    3. the parsed grammar (grammar_check.py): alternatives, nested repetitions, emptiness;
    4. with `vocab`, the compile against the model's vocabulary, as the EngineCore does it,
       then a probe of the matcher: PROBE_TOKENS tokens, each the longest one the grammar
       allows, none of them allowed to cost more than `max_matcher_ms` of CPU (an ambiguous
       grammar, `root ::= root root | "a"`, compiles at once and then costs more with every
       token: the EngineCore would fail it mid-reply; here it is a 400).

Steps 1-3 are cheap once 1 has passed; `LLM` runs them in-process (`check_structured_outputs`),
and the EngineCore before each compile (`checked_grammar`). Step 4 is for a sandbox lane with a
time and memory limit (`pagellm/sandbox.py`): its workers load the vocabulary tables once, in
the lane's initializer (`init_worker(path)`, the file `write_vocabulary` made), and each call
names them by that path. Arguments are plain data, as a lane passes them: the key as a list
or tuple, the limits as a StructuredOutputsConfig or its fields. The only state is the
initializer-built table of compilers.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from pagellm.config import StructuredOutputsConfig
from pagellm.structured_output.backend import XgrammarBackend, parse
from pagellm.structured_output.grammar_check import check_grammar
from pagellm.structured_output.limits import NAMES, check_limits, limit_message

_backends: dict[str, XgrammarBackend] = {}  # vocabulary file -> its compiler (init_worker)
_token_bytes: dict[str, np.ndarray] = {}  # vocabulary file -> each token's length in bytes
PROBE_TOKENS = 128


def validate(
    key: tuple[str, str] | list[str],
    limits: StructuredOutputsConfig | dict[str, Any],
    vocab: str | None = None,
) -> None:
    """ValueError naming what is wrong with a constraint (StructuredOutputsParams.key()) or
    the limit it is over; None if the EngineCore will compile it. `vocab`: the vocabulary
    file `init_worker` loaded in this process (step 4: the compile), or None."""
    key = (key[0], key[1])
    limits = StructuredOutputsConfig.of(limits)
    grammar = checked_grammar(key, limits)
    if vocab is not None:
        backend = _backends.get(vocab)
        if backend is None:
            raise RuntimeError(f"no vocabulary {vocab!r} in this process: run init_worker first")
        probe_matcher(backend, backend.compile(key, grammar), _token_bytes[vocab], limits)


def checked_grammar(key: tuple[str, str], limits: StructuredOutputsConfig) -> Any:
    """Steps 1-3: the parsed xgrammar Grammar of a constraint that passed them."""
    check_limits(key, limits)
    grammar = parse(key)
    kind = key[0].split(":")[0]
    check_grammar(grammar.serialize_json(), kind, NAMES[kind], limits)
    return grammar


def init_worker(vocabulary_file: str) -> None:
    """A worker process's initializer: xgrammar's vocabulary tables from the file
    `write_vocabulary` made, for `validate(..., vocab=vocabulary_file)`."""
    import xgrammar as xgr

    if vocabulary_file not in _backends:
        with open(vocabulary_file, encoding="utf-8") as f:
            info = xgr.TokenizerInfo.deserialize_json(f.read())
        _backends[vocabulary_file] = XgrammarBackend(info)
        lengths = np.zeros(info.vocab_size, np.int64)
        decoded = info.decoded_vocab
        lengths[: len(decoded)] = [len(token) for token in decoded]
        lengths[list(info.stop_token_ids)] = 0  # the probe follows the grammar, not its end
        _token_bytes[vocabulary_file] = lengths


def probe_matcher(
    backend: XgrammarBackend,
    compiled: Any,
    token_bytes: np.ndarray,
    limits: StructuredOutputsConfig,
) -> None:
    """ValueError if following the grammar costs more than `max_matcher_ms` of CPU for one
    of PROBE_TOKENS tokens, each the longest that it allows (the likeliest to grow an
    ambiguous parse), until it can only end."""
    matcher = backend.matcher(compiled)
    bitmask = backend.allocate_bitmask(1)
    budget = limits.max_matcher_ms / 1e3
    bits = np.arange(32, dtype=np.uint32)
    for _ in range(PROBE_TOKENS):
        start = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask, 0)
        spent = time.thread_time() - start
        words = bitmask[0].numpy().view(np.uint32)
        allowed = ((words[:, None] >> bits) & 1).astype(bool).ravel()[: len(token_bytes)]
        lengths = np.where(allowed, token_bytes, 0)
        token = int(lengths.argmax())
        if lengths[token] == 0:  # only stop tokens (or none): the grammar can only end
            return
        start = time.thread_time()
        matcher.accept_token(token)
        spent += time.thread_time() - start
        if spent > budget:
            raise ValueError(
                limit_message(
                    f"following its grammar took {1e3 * spent:.0f} ms of CPU for one token "
                    "(an ambiguous grammar costs more with every token)",
                    "max_matcher_ms",
                    limits,
                )
            )
        if matcher.is_terminated():  # it took a stop token
            return


def write_vocabulary(tokenizer: Any, model_config: Any, path: str) -> None:
    """The tables the EngineCore compiles against (the model's vocabulary size, its EOS ids as
    stop tokens) as JSON in `path`, for `init_worker` (a file: a megabyte or more, too much
    for a worker's command line)."""
    from pagellm.structured_output.backend import stop_token_ids, tokenizer_info

    stop_ids = stop_token_ids(model_config, tokenizer.eos_token_id)
    text = tokenizer_info(tokenizer, model_config.vocab_size, stop_ids).serialize_json()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
