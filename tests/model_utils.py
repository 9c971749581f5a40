"""Test helpers shared by the model, loader and engine tests.

- `make_tiny_hf_model(arch, tmp_path)`: a small random HF transformers model saved as
  safetensors (no tokenizer), with large weights so that logits are peaky and greedy argmax
  does not flip on float rounding.
- `load_our_model(folder)`: our model for an HF folder or GGUF file, float32 on the CPU.
- `PagedRunner` / `run_paged`: drive our model through the paged KV cache on the CPU as the
  model runner does (flat batches, random non-contiguous block ids, NaN-poisoned cache so any
  read of an unwritten slot shows up in the logits).
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from pagellm.attention.base import CommonAttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.kv_cache_size import latent_kv_dim
from pagellm.layers.rope import long_rope

TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
_CONFIG_CLASSES = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
    "phi3": Phi3Config,
    "olmo2": Olmo2Config,
}
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, pad_token_id=0, tie_word_embeddings=True)
_ARCH_DEFAULTS = {
    "qwen3": dict(head_dim=32),  # Qwen3: head_dim != hidden / heads
    "gemma2": _GEMMA,
    "gemma3": _GEMMA,
    "phi3": dict(pad_token_id=0),
}


def make_tiny_hf_model(
    arch: str, tmp_path: Path | str, *, seed: int = 0, std: float = 0.5, **overrides
) -> str:
    """Save a random HF model (a key of `_CONFIG_CLASSES`, or any HF model_type, e.g.
    "mixtral") under tmp_path; return the folder."""
    kwargs = {**TINY_CONFIG, **_ARCH_DEFAULTS.get(arch, {}), **overrides}
    config_cls = _CONFIG_CLASSES.get(arch)
    config = config_cls(**kwargs) if config_cls else AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, std, seed)
    folder = Path(tmp_path) / f"tiny-{arch}"
    model.save_pretrained(folder)
    return str(folder)


def make_tiny_chat_model(
    tmp_path: Path | str, added_tokens: tuple[str, ...] = (), chat_template: str | None = None
) -> str:
    """A tiny random Llama with the embedded model's tokenizer (vocabulary and all, plus
    `added_tokens`; `chat_template` in place of its own): an engine on it starts in seconds and
    its outputs detokenize to text."""
    from pagellm.loader import load_tokenizer, resolve_model_source

    tokenizer = load_tokenizer(resolve_model_source(None, "auto", None))
    tokenizer.add_tokens(list(added_tokens))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    folder = make_tiny_hf_model(
        "llama",
        tmp_path,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(folder)
    return folder


def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # RMSNorm weights around 1, not exactly 1
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def assert_fused_experts_load_alike(folder: str, hf, out: Path) -> dict[str, torch.Tensor]:
    """transformers 5's state dict of `hf` stacks a layer's experts (`experts.gate_up_proj`):
    saved under `out` with `folder`'s config, it must load to the parameters `folder`'s
    per-expert checkpoint loads to; those parameters, by name."""
    from safetensors.torch import save_file

    (out / "config.json").write_text(Path(folder, "config.json").read_text())
    state = {name: p.contiguous() for name, p in hf.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    save_file(state, str(out / "model.safetensors"))
    fused = dict(load_our_model(str(out)).named_parameters())
    for name, param in load_our_model(folder).named_parameters():
        assert torch.equal(fused[name], param), name
    return fused


def load_our_model(
    path: str,
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    device: str = "cpu",
    attn_backend_cls: type | None = None,
    quantization: str | None = None,
):
    """Our model for an HF folder, a .gguf file or a shipped config name (default: on the CPU,
    with the torch attention backend; `quantization` as for `LLM`)."""
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.loader import load_model

    dtype_name = str(dtype).split(".")[1]
    args = EngineArgs(
        model=path, load_format=load_format, dtype=dtype_name, quantization=quantization
    )
    model_config = args.create_model_config(torch.device(device))
    backend = attn_backend_cls or TorchAttentionBackend
    return load_model(model_config, torch.device(device), backend)


def hf_model(folder: str, dtype: torch.dtype = torch.float32, **kwargs):
    """HF's model of a folder, in eval mode; eager attention where the config soft-caps
    attention scores (Gemma 2): transformers 5.17 (the GPU machines') defaulted Gemma 2 to
    SDPA, which drops the soft-cap silently (5.25 picks eager itself)."""
    config = AutoConfig.from_pretrained(folder, **kwargs)
    text = getattr(config, "text_config", None) or config
    if getattr(text, "attn_logit_softcapping", None):
        kwargs["attn_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()


def hf_generate_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (EOS not special) of equally long prompts, one batch, as HF's
    `generate` makes them, in a loop of HF forwards with HF's cache, so that every
    transformers version gives the same reference: transformers 5.25's Phi-3 `generate`
    drops its cache and recomputes the sequence with its long rope factors at the step where
    it passes original_max_position_embeddings tokens, while 5.17's (the GPU machines') kept
    the short-rotated cache."""
    config = model.config
    switch = getattr(config, "original_max_position_embeddings", None)
    switch = switch if config.model_type == "phi3" else None
    cache_arg = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    cache = None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            if switch is not None and ids.shape[1] > switch and cache is not None:
                if cache.get_seq_length() <= switch:
                    cache = None  # recompute everything with the long factors
            feed = ids if cache is None else ids[:, -1:]
            out = model(input_ids=feed, use_cache=True, **{cache_arg: cache})
            cache = out.past_key_values
            ids = torch.cat([ids, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, len(prompts[0]) :].tolist()


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """HF's logits for every position of one sequence: [len, vocab] float32."""
    with torch.inference_mode():
        return hf_model(input_ids=torch.tensor([token_ids])).logits[0].float()


@dataclass
class _Seq:
    tokens: list[int]  # every token known so far (prompt, then generated)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    rope_offset: int = 0  # a longrope model's long-factor rows, for a sequence longer than k


class PagedRunner:
    """Runs flat batches through our model and a paged KV cache, like the model runner, on the
    model's device; logits come back on the CPU."""

    def __init__(self, model, *, block_size: int = 16, num_blocks: int = 256, seed: int = 0):
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        heads, parts = cfg.num_key_value_heads, 2
        if latent_kv_dim(cfg) is not None:  # latent attention: one row a token
            heads, head_dim, parts = 1, latent_kv_dim(cfg), 1
        shape = model.attn_backend_cls.kv_cache_shape(
            num_blocks, block_size, heads, head_dim, parts
        )
        param = next(model.parameters())
        self.device = param.device
        self.kv_caches = [
            torch.full(shape, float("nan"), dtype=param.dtype, device=self.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.model = model
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.seqs: dict[int, _Seq] = {}
        self.long_rope = long_rope(cfg)  # (k, rows) or None

    def add(self, seq_id: int, tokens: list[int], share_blocks_of: int | None = None) -> None:
        """A new sequence; `share_blocks_of` reuses another sequence's full blocks of the same
        leading tokens (a prefix-cache hit), so they count as already computed."""
        seq = _Seq(list(tokens))
        if self.long_rope is not None and len(tokens) > self.long_rope[0]:
            seq.rope_offset = self.long_rope[1]  # as HF's forward over a longer sequence
        if share_blocks_of is not None:
            seq.blocks = _shared_full_blocks(self.seqs[share_blocks_of], seq, self.block_size)
            seq.num_computed = len(seq.blocks) * self.block_size
        self.seqs[seq_id] = seq

    def step(self, schedule: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """Compute `n` more tokens for each (seq_id, n), in this flat-batch order; return each
        sequence's logits for those tokens: [n, vocab] float32."""
        for seq_id, n in schedule:
            self._allocate(self.seqs[seq_id], n)
        common, input_ids, positions = self._build_inputs(schedule)
        metadata = self.model.attn_backend_cls.build_metadata(common)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)
            logits = self.model.compute_logits(hidden).float().cpu()
        out, start = {}, 0
        for seq_id, n in schedule:
            out[seq_id] = logits[start : start + n]
            self.seqs[seq_id].num_computed += n
            start += n
        return out

    def _allocate(self, seq: _Seq, n: int) -> None:
        assert seq.num_computed + n <= len(seq.tokens), "schedule more tokens than known"
        while len(seq.blocks) * self.block_size < seq.num_computed + n:
            seq.blocks.append(self.free_blocks.pop())

    def _build_inputs(self, schedule):
        bs = self.block_size
        ids, pos, slots, query_lens, seq_lens = [], [], [], [], []
        for seq_id, n in schedule:
            seq = self.seqs[seq_id]
            span = range(seq.num_computed, seq.num_computed + n)
            ids += seq.tokens[span.start : span.stop]
            pos += [p + seq.rope_offset for p in span]
            slots += [seq.blocks[p // bs] * bs + p % bs for p in span]
            query_lens.append(n)
            seq_lens.append(span.stop)
        width = max(len(self.seqs[s].blocks) for s, _ in schedule) + 1
        table = torch.zeros(len(schedule), width, dtype=torch.int32)
        for row, (seq_id, _) in enumerate(schedule):
            blocks = self.seqs[seq_id].blocks
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        dev = self.device
        common = CommonAttentionMetadata(
            num_reqs=len(schedule),
            block_size=bs,
            num_actual_tokens=len(ids),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=np.array(seq_lens, dtype=np.int32),
        )
        ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        return common, ids, torch.tensor(pos, dtype=torch.int64, device=dev)


def _shared_full_blocks(src: _Seq, dst: _Seq, block_size: int) -> list[int]:
    shared = 0
    limit = min(src.num_computed, len(dst.tokens) - 1)  # leave at least one token to compute
    while (shared + 1) * block_size <= limit:
        span = slice(shared * block_size, (shared + 1) * block_size)
        if src.tokens[span] != dst.tokens[span]:
            break
        shared += 1
    return src.blocks[:shared]


def run_paged(
    model,
    prompts: list[list[int]],
    *,
    num_decode_steps: int = 3,
    block_size: int = 16,
    chunk_size: int | None = None,
    stagger: bool = False,
    shuffle: bool = False,
    seed: int = 0,
) -> list[tuple[list[int], torch.Tensor]]:
    """Prefill every prompt (in chunks of `chunk_size` tokens if given), then greedy-decode
    `num_decode_steps` tokens, all live sequences in one flat batch per step.

    `stagger`: sequence i joins at step i, so prefills mix with other sequences' decodes.
    `shuffle`: a random order within each batch (decodes are not first).
    Returns, per prompt, (the tokens fed, our logits for each of them [len, vocab]).
    """
    runner = PagedRunner(model, block_size=block_size, seed=seed)
    rng = random.Random(seed)
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    target = {i: len(p) + num_decode_steps for i, p in enumerate(prompts)}
    step = 0
    while any(sum(len(x) for x in logits[i]) < target[i] for i in logits):
        live = [i for i in logits if (not stagger or i <= step) and _remaining(runner, i, target)]
        for i in live:
            if i not in runner.seqs:
                runner.add(i, prompts[i])
        schedule = [(i, _next_chunk(runner.seqs[i], chunk_size)) for i in live]
        if shuffle:
            rng.shuffle(schedule)
        for i, out in runner.step(schedule).items():
            logits[i].append(out)
            seq = runner.seqs[i]
            if seq.num_computed == len(seq.tokens) and len(seq.tokens) < target[i]:
                seq.tokens.append(int(out[-1].argmax()))  # greedy: the next token to feed
        step += 1
    return [(runner.seqs[i].tokens, torch.cat(logits[i])) for i in range(len(prompts))]


def _remaining(runner: PagedRunner, i: int, target: dict[int, int]) -> bool:
    seq = runner.seqs.get(i)
    return seq is None or seq.num_computed < target[i]


def _next_chunk(seq: _Seq, chunk_size: int | None) -> int:
    todo = len(seq.tokens) - seq.num_computed
    return todo if chunk_size is None else min(todo, chunk_size)


# HF name suffix -> GGUF block tensor name (llama.cpp's naming)
_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row order: per head, HF's (half, index) rows become (index, half)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_folder: str, path: str, qtype: str = "F32", arch: str = "llama") -> str:
    """Write the safetensors weights of a tiny llama/qwen2/qwen3 HF folder as a GGUF file the
    way llama.cpp's converter would (Q/K rows permuted for llama). qtype: F32 | F16 | Q8_0 |
    Q4_0 | Q4_1 for the 2-D weights (the embedding and norms stay F32)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_folder)
    state = load_file(str(Path(hf_folder) / "model.safetensors"))
    writer = gguf.GGUFWriter(path, arch)
    _write_gguf_metadata(writer, cfg, arch)
    for name, tensor in state.items():
        gguf_name, weight = _to_gguf_tensor(name, tensor, cfg, arch)
        _add_gguf_tensor(writer, gguf_name, weight.float().numpy(), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_gguf_metadata(writer, cfg, arch: str) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])


def _to_gguf_tensor(name: str, tensor: torch.Tensor, cfg, arch: str):
    if name == "model.embed_tokens.weight":
        return "token_embd.weight", tensor
    if name == "model.norm.weight":
        return "output_norm.weight", tensor
    if name == "lm_head.weight":
        return "output.weight", tensor
    _, _, layer, rest = name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    if arch == "llama" and module == "self_attn.q_proj":
        tensor = llama_cpp_permute(tensor, cfg.num_attention_heads)
    elif arch == "llama" and module == "self_attn.k_proj":
        tensor = llama_cpp_permute(tensor, cfg.num_key_value_heads)
    return f"blk.{layer}.{_GGUF_BLOCK_NAMES[module]}.{kind}", tensor


def _add_gguf_tensor(writer, name: str, array: np.ndarray, qtype: str) -> None:
    import gguf

    if array.ndim == 1 or name == "token_embd.weight" or qtype == "F32":
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        kind = gguf.GGMLQuantizationType[qtype]
        data = gguf.quants.quantize(array.astype(np.float32), kind)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


def fake_hub_snapshot(
    cache: Path | str, repo_id: str, folder: str, revision: str = "main", commit: str = "a" * 40
) -> str:
    """Copy `folder` into a Hugging Face cache as `repo_id` at `revision` (the
    `models--org--name/{refs,snapshots}` layout huggingface_hub reads); return the snapshot."""
    import shutil

    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return str(snapshot)


# Gemma's chat template as its tokenizer_config.json has it: no system role, user/model turns
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def save_tiny_tokenizer(folder: Path | str, chat_template: str | None = None) -> str:
    """A word-level tokenizer (Gemma's special token ids: pad 0, eos 1, bos 2) saved into
    `folder`: every word of WORDS has an id below 64, others are <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def st_modules():
    """sentence-transformers' Transformer, Pooling and Normalize (6.x's module, or 5.x's)."""
    try:
        from sentence_transformers.sentence_transformer import modules
    except ImportError:
        from sentence_transformers import models as modules
    return modules


def make_st_embedding_model(path: Path | str) -> str:
    """A tiny random Qwen3Model (no LM head) + word-level tokenizer, saved by
    sentence-transformers with last-token pooling and Normalize (Qwen3-Embedding's layout)."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, Qwen3Config

    path = str(path)
    config = Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        architectures=["Qwen3Model"], pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(path)
    save_tiny_tokenizer(path)
    modules = st_modules()
    pipeline = [modules.Transformer(path), modules.Pooling(64, "lasttoken"), modules.Normalize()]
    SentenceTransformer(modules=pipeline).save(path)
    return path


def widen_weights(model, std: float = 0.15) -> None:
    """Every weight but the norms' drawn from N(0, std) (the torch seed set by the caller):
    HF's init (0.02) leaves a tiny encoder's attention almost uniform and its tokens alike,
    which a wrong mask or position would pass unnoticed."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and "norm" not in name.lower():
                param.normal_(0, std)


def make_bert_cross_encoder(path: Path | str, num_labels: int = 1) -> str:
    """A tiny random BertForSequenceClassification (a reranker's layout) with a WordPiece
    tokenizer; weights large enough that attention looks and token types matter."""
    from transformers import BertConfig, BertForSequenceClassification

    path = save_tiny_wordpiece(path)
    config = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=64, num_labels=num_labels)  # fmt: skip
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    widen_weights(model)
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight.normal_(0, 1)
    model.save_pretrained(path)
    return path


def close(ours, ref, atol: float = 2e-5) -> None:
    """Two embeddings agree: cosine >= 0.99999 and every value within `atol`."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    cosine = ours @ ref / np.linalg.norm(ours) / np.linalg.norm(ref)
    assert cosine >= 0.99999
    assert np.abs(ours - ref).max() <= atol


def save_tiny_wordpiece(folder: Path | str) -> str:
    """A BERT tokenizer (WordPiece; [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, then WORDS)
    saved into `folder`: pairs come as [CLS] a [SEP] b [SEP] with token types 0 / 1."""
    from transformers import BertTokenizerFast

    vocab = Path(folder) / "vocab.txt"
    vocab.parent.mkdir(parents=True, exist_ok=True)
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(str(vocab)).save_pretrained(str(folder))
    return str(folder)


WORDS = "user model hi hello the a cat sat on mat why is sky blue tell me story".split()
