"""The whole check of an output constraint, as one pure function a killable worker process
can run: `validate(key, limits, vocab)` returns None or raises ValueError (the 400's message).

    1. limits on the text (limits.py): size, JSON nesting, counted repetitions, $refs;
    2. xgrammar's parse (no vocabulary);
    3. the parsed grammar (grammar_check.py): alternatives, nested repetitions, emptiness;
    4. with `vocab`, the compile against the model's vocabulary, as the EngineCore does it.

Steps 1-3 are cheap once 1 has passed; `LLM` runs them in-process (`check_structured_outputs`),
and the EngineCore before each compile (`checked_grammar`). Step 4 is for a sandbox lane with a
time and memory limit (`pagellm/sandbox.py`): its workers load the vocabulary tables once, in
the lane's initializer (`init_worker(path)`, the file `write_vocabulary` made), and each call
names them by that path. Arguments are plain data, as a lane passes them: the key as a list
or tuple, the limits as a StructuredOutputsConfig or its fields. The only state is the
initializer-built table of compilers.
"""

from __future__ import annotations

from typing import Any

from pagellm.config import StructuredOutputsConfig
from pagellm.structured_output.backend import XgrammarBackend, parse
from pagellm.structured_output.grammar_check import check_grammar
from pagellm.structured_output.limits import NAMES, check_limits

_backends: dict[str, XgrammarBackend] = {}  # vocabulary file -> its compiler (init_worker)


def validate(
    key: tuple[str, str] | list[str],
    limits: StructuredOutputsConfig | dict[str, Any],
    vocab: str | None = None,
) -> None:
    """ValueError naming what is wrong with a constraint (StructuredOutputsParams.key()) or
    the limit it is over; None if the EngineCore will compile it. `vocab`: the vocabulary
    file `init_worker` loaded in this process (step 4: the compile), or None."""
    key = (key[0], key[1])
    grammar = checked_grammar(key, StructuredOutputsConfig.of(limits))
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


def init_worker(vocabulary_file: str) -> None:
    """A worker process's initializer: xgrammar's vocabulary tables from the file
    `write_vocabulary` made, for `validate(..., vocab=vocabulary_file)`."""
    import xgrammar as xgr

    if vocabulary_file not in _backends:
        with open(vocabulary_file, encoding="utf-8") as f:
            info = xgr.TokenizerInfo.deserialize_json(f.read())
        _backends[vocabulary_file] = XgrammarBackend(info)


def write_vocabulary(tokenizer: Any, model_config: Any, path: str) -> None:
    """The tables the EngineCore compiles against (the model's vocabulary size, its EOS ids as
    stop tokens) as JSON in `path`, for `init_worker` (a file: a megabyte or more, too much
    for a worker's command line)."""
    from pagellm.structured_output.backend import tokenizer_info
    from pagellm.structured_output.manager import stop_token_ids

    stop_ids = stop_token_ids(model_config, tokenizer.eos_token_id)
    text = tokenizer_info(tokenizer, model_config.vocab_size, stop_ids).serialize_json()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
