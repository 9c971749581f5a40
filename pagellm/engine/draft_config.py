"""The config of a proposer's own model (`speculative_config` methods draft_model, eagle3,
mtp), checked against its target before any process starts: a draft's tokenizer and length
(`check_draft_model`), an EAGLE-3 head's architecture and hidden size (`eagle3_head_config`),
and the MTP head a checkpoint carries (`mtp_head_config`)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from pagellm.config import ModelConfig

EAGLE3_HEAD = "LlamaForCausalLMEagle3"  # the architecture of EAGLE-3 heads' checkpoints
MTP_HEAD = "MiMoMTPModel"  # the architecture an MTP head is built as (pagellm/models/mimo.py)
# targets whose checkpoints carry MTP layers that `method: "mtp"` serves -> their family
MTP_FAMILIES = {"MiMoForCausalLM": "Xiaomi MiMo"}


def num_mtp_layers(hf_config: Any) -> int:
    """The checkpoint's multi-token-prediction layers (`num_nextn_predict_layers`)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def mtp_head_config(target: ModelConfig, checkpoint: ModelConfig | None = None) -> ModelConfig:
    """The MTP head of `checkpoint` (by default the target's own folder) as a model of its
    own: the checkpoint's config under the head's architecture, one layer (each draft
    iterates its first MTP layer); a target outside the served families, or a checkpoint
    without MTP layers, is a ValueError naming the families served."""
    checkpoint = checkpoint or target
    families = ", ".join(f"{arch} ({name})" for arch, name in MTP_FAMILIES.items())
    for config in (target, checkpoint):
        if config.architecture not in MTP_FAMILIES:
            raise ValueError(
                "speculative_config method 'mtp' drafts with a checkpoint's own "
                f"multi-token-prediction layers; served for {families}: {config.model!r} is "
                f"{config.architecture} (another method: ngram, suffix, draft_model, eagle3)"
            )
    if num_mtp_layers(checkpoint.hf_config) < 1:
        raise ValueError(
            f"speculative_config method 'mtp': {checkpoint.model!r} carries no "
            "multi-token-prediction layers (num_nextn_predict_layers is 0 or missing)"
        )
    hidden = checkpoint.hf_config.hidden_size
    if hidden != target.hf_config.hidden_size:
        raise ValueError(
            f"speculative_config: the MTP layers of {checkpoint.model!r} read hidden states of "
            f"size {hidden}, {target.model!r} has {target.hf_config.hidden_size}"
        )
    hf_config = copy.copy(checkpoint.hf_config)
    hf_config.architectures = [MTP_HEAD]
    hf_config.num_hidden_layers = 1
    return dataclasses.replace(checkpoint, hf_config=hf_config)


def eagle3_head_config(target: ModelConfig, head: ModelConfig) -> ModelConfig:
    """An EAGLE-3 head's config for `target`: its architecture and the target's hidden size
    checked; its rotary table stretched to the target's max_model_len (heads are trained on
    short sequences; their config's length caps nothing)."""
    if head.architecture != EAGLE3_HEAD:
        raise ValueError(
            f"speculative_config method 'eagle3' needs an EAGLE-3 head (architecture "
            f"LlamaForCausalLMEagle3); {head.model!r} is {head.architecture}"
        )
    hidden = getattr(head.hf_config, "target_hidden_size", None) or head.hf_config.hidden_size
    if hidden != target.hf_config.hidden_size:
        raise ValueError(
            f"speculative_config: the EAGLE-3 head {head.model!r} reads hidden states of size "
            f"{hidden}, {target.model!r} has {target.hf_config.hidden_size}"
        )
    hf_config = copy.copy(head.hf_config)
    hf_config.max_position_embeddings = max(head.max_model_len, target.max_model_len)
    return dataclasses.replace(head, hf_config=hf_config, max_model_len=target.max_model_len)


def check_draft_model(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft the target cannot verify is a start-up error: another vocabulary (the
    tokenizers' token -> id maps where both have one, else the configs' vocabulary sizes:
    equal tokenizers may pad their embeddings apart, drafts then stay in the shared ids), or
    fewer positions than max_model_len (lower max_model_len to use it)."""
    from pagellm import loader

    name, draft_name = repr(target.model), repr(draft.model)
    if draft.max_model_len < target.max_model_len:
        raise ValueError(
            f"speculative_config: the draft model {draft_name} holds {draft.max_model_len} "
            f"positions, fewer than max_model_len={target.max_model_len} of {name}; pass "
            f"max_model_len={draft.max_model_len} (or less) to use it"
        )
    ours, theirs = loader.load_tokenizer(target.source), loader.load_tokenizer(draft.source)
    if ours is not None and theirs is not None:
        mine, its = ours.get_vocab(), theirs.get_vocab()
        if mine != its:
            token = min(t for t in mine.keys() | its.keys() if mine.get(t) != its.get(t))
            raise ValueError(
                f"speculative_config: the draft model {draft_name}'s tokenizer differs from "
                f"{name}'s ({len(its)} vs {len(mine)} tokens; {token!r} is id "
                f"{its.get(token)} vs {mine.get(token)}): a draft must share the target's "
                "tokenizer"
            )
    elif draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {draft_name} has a vocabulary of "
            f"{draft.vocab_size} tokens, {name} of {target.vocab_size}: a draft must share "
            "the target's tokenizer"
        )
