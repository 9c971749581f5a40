"""Embedding throughput: pagellm `LLM.embed` vs sentence-transformers `encode`, interleaved.

Workload: `--num-passages` (1,000) passages of `--min-tokens`..`--max-tokens` (64-512) tokens,
random text over a fixed list of English words (seeded), lengths measured with the model's
tokenizer ([CLS] and [SEP] included). Model: a BertModel at MiniLM-L6's shape (`--shape
minilm`: 6 layers, hidden 384, 12 heads, 1536 FFN, 30,522-row vocab; `bge-small`: 12 layers)
with random weights and a WordPiece tokenizer over the word list, saved with
sentence-transformers' mean pooling and Normalize: the same folder for both sides, float32.

The peer's batch size is its best of `--batch-sizes` (16/32/64/128) on the first
`--tune-passages` passages, found first. Then rounds alternate A B A B (this machine's speed
swings): passages/s each, with the 1-minute load average beside each figure; the ratio of
the medians, each adjacent pair's ratio, and the ratio of the best rounds (the least
disturbed by other tenants of a shared machine). The embeddings of both are compared (max-abs
difference). `--device cuda` runs both in bf16; without sentence-transformers the peer is HF
AutoModel in length-sorted batches (mean pooling, normalize).

    python benchmarks/pooling.py                               # CPU, 1,000 passages
    python benchmarks/pooling.py --num-passages 200 --rounds 2 # quicker
    python benchmarks/pooling.py --device cuda --num-passages 10000

On a shared machine, `--threads 1` keeps other tenants' load from stalling the threads of
one parallel region on another's (pagellm's smaller steps run more regions than ST's batches
and suffered more from it here: 2-5x swings with 2 threads, steady with 1).

The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# run as a script, this folder leads sys.path: a script named like a package would shadow it
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

WORDS = """the of and to in is that for it as was with be by on not he this are or his from
at which but have an they you were her she there had been one all we their has would when
if so no will more can who out up about what some into them time only could new these two
may first then do any like my now over such our man me even most made after also did many
before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long get here
between both life being under never day same another know while last might us great old
year off come since against go came right used take three states himself few house use
during without again place american around however home small found thought went say part
once general high upon school every keep does got united left number course war until always
away something fact though water less public put think almost hand enough far took head yet
government system better set told nothing night end why called eyes find going look
asked later knew point next program city business give group toward young days let room
president side social given present several order national possible rather second face per
among form important often things looked early white case john become large big need four
within felt along children saw best church ever least power development light thing family
interest want members mind country area others done turned although open god service
certain kind problem began different door thus help sense means whole matter perhaps itself
york times law human line above name example action company hands local show whether five
history gave today either act feet across taken past quite anything seen having death
week experience body word half really field car words already themselves information tell
together college shall money period held keep sure free seems real behind cannot miss
political air question making office brought whose special heard major problems ago became
federal moment study available known result street economic boy position reason change
south board individual job areas society west close turn love community true court force
full seemed""".split()
SHAPES = {  # BertConfig kwargs: MiniLM-L6-v2's, bge-small-en-v1.5's and bge-large's shapes
    "minilm": dict(num_hidden_layers=6, hidden_size=384, num_attention_heads=12,
                   intermediate_size=1536, vocab_size=30522),
    "bge-small": dict(num_hidden_layers=12, hidden_size=384, num_attention_heads=12,
                      intermediate_size=1536, vocab_size=30522),
    "bge-large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                      intermediate_size=4096, vocab_size=30522),
    "tiny": dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                 intermediate_size=128, vocab_size=512),
}  # fmt: skip


def save_model(folder: Path, shape: str) -> str:
    """A random BertModel at `shape`, a WordPiece tokenizer over WORDS, ST's pipeline files
    (mean pooling, Normalize): what sentence-transformers saves for MiniLM."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(str(vocab), model_max_length=512).save_pretrained(str(folder))
    config = BertConfig(max_position_embeddings=512, **SHAPES[shape])
    torch.manual_seed(0)
    BertModel(config).save_pretrained(str(folder))
    hidden = config.hidden_size
    kinds = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    modules = [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{k}"}
               for i, (k, p) in enumerate(kinds)]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    return str(folder)


def make_passages(folder: str, n: int, lo: int, hi: int, seed: int) -> tuple[list[str], list]:
    """n passages of uniform lo..hi tokens (the tokenizer's count, specials included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = np.random.default_rng(seed)
    passages = [" ".join(rng.choice(WORDS, int(k) - 2)) for k in rng.integers(lo, hi + 1, n)]
    lengths = [len(ids) for ids in tokenizer(passages)["input_ids"]]
    return passages, lengths


class Peer:
    """sentence-transformers' `encode`, or (absent) HF AutoModel in length-sorted batches."""

    def __init__(self, folder: str, device: str, dtype: torch.dtype) -> None:
        self.device, self.dtype, self.batch_size = device, dtype, 32
        try:
            from sentence_transformers import SentenceTransformer

            self.st = SentenceTransformer(folder, device=device).to(dtype)
            self.name = "sentence-transformers"
        except ImportError:
            from transformers import AutoModel, AutoTokenizer

            self.st = None
            self.model = AutoModel.from_pretrained(folder, dtype=dtype).to(device).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self.name = "hf-automodel"

    def encode(self, passages: list[str]) -> np.ndarray:
        if self.st is not None:
            out = self.st.encode(passages, batch_size=self.batch_size, convert_to_numpy=False)
            return torch.stack(out).float().cpu().numpy()
        return self._hf_encode(passages)

    @torch.inference_mode()
    def _hf_encode(self, passages: list[str]) -> np.ndarray:
        order = sorted(range(len(passages)), key=lambda i: -len(passages[i]))
        out = np.zeros((len(passages), self.model.config.hidden_size), np.float32)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            enc = self.tokenizer([passages[i] for i in rows], padding=True, truncation=True,
                                 return_tensors="pt").to(self.device)  # fmt: skip
            states = self.model(**enc).last_hidden_state.float()
            mask = enc["attention_mask"][..., None].float()
            pooled = (states * mask).sum(1) / mask.sum(1)
            out[rows] = torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy()
        return out

    def tune(self, passages: list[str], sizes: list[int]) -> dict[int, float]:
        """passages/s at each batch size; keeps the best."""
        rates = {}
        self.encode(passages[:8])  # warm-up
        for size in sizes:
            self.batch_size = size
            rates[size] = len(passages) / timed(self.encode, passages)[1]
        self.batch_size = max(rates, key=rates.get)
        return rates


def timed(fn, *args):
    sync()
    start = time.perf_counter()
    out = fn(*args)
    sync()
    return out, time.perf_counter() - start


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def make_engine(folder: str, args):
    from pagellm import LLM

    return LLM(folder, dtype=args.dtype, device=args.device, max_model_len=512,
               max_num_batched_tokens=args.max_num_batched_tokens,
               max_num_seqs=args.max_num_seqs)  # fmt: skip


def pagellm_encode(llm, passages: list[str]) -> np.ndarray:
    outputs = llm.embed(passages, use_tqdm=False)
    return np.array([o.outputs.embedding for o in outputs], np.float32)


def run_rounds(llm, peer: Peer, passages: list[str], rounds: int) -> dict:
    """A B A B: passages/s of each, the 1-minute load average before each figure."""
    result: dict = {"pagellm_pps": [], "peer_pps": [], "load_pagellm": [], "load_peer": []}
    for _ in range(rounds):
        for name, fn in (("pagellm", lambda p: pagellm_encode(llm, p)), ("peer", peer.encode)):
            result[f"load_{name}"].append(round(os.getloadavg()[0], 2))
            vectors, seconds = timed(fn, passages)
            result[f"{name}_pps"].append(round(len(passages) / seconds, 2))
            result[f"{name}_vectors"] = vectors
            print(f"{name:8s} {len(passages) / seconds:9.2f} passages/s  "
                  f"(load {result[f'load_{name}'][-1]})", flush=True)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    torch_dtype = getattr(torch, args.dtype)
    if args.threads:  # both sides: this process (the peer) and the engine core's, spawned
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or save_model(Path(tmp) / args.shape, args.shape)
        passages, lengths = make_passages(
            folder, args.num_passages, args.min_tokens, args.max_tokens, args.seed
        )
        peer = Peer(folder, args.device, torch_dtype)
        tuning = peer.tune(passages[: args.tune_passages], args.batch_sizes)
        print(f"{peer.name} batch sizes (passages/s): {tuning} -> {peer.batch_size}")
        llm = make_engine(folder, args)
        try:
            pagellm_encode(llm, passages[: args.tune_passages])  # warm-up
            result = run_rounds(llm, peer, passages, args.rounds)
        finally:
            llm.shutdown()
    ours, theirs = result.pop("pagellm_vectors"), result.pop("peer_vectors")
    summary = {
        "device": args.device, "dtype": args.dtype, "shape": args.shape, "peer": peer.name,
        "passages": len(passages), "mean_tokens": round(float(np.mean(lengths)), 1),
        "min_tokens": min(lengths), "max_tokens": max(lengths),
        "peer_batch_size": peer.batch_size, "peer_batch_tuning_pps": tuning,
        "torch_threads": torch.get_num_threads(), **result,
        "ratio": round(statistics.median(result["pagellm_pps"])
                       / statistics.median(result["peer_pps"]), 3),
        "pair_ratios": [round(a / b, 3) for a, b in zip(result["pagellm_pps"], result["peer_pps"])],
        "ratio_of_best": round(max(result["pagellm_pps"]) / max(result["peer_pps"]), 3),
        "max_abs_diff": float(np.abs(ours - theirs).max()),
    }  # fmt: skip
    print(json.dumps(summary))
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--shape", default="minilm", choices=sorted(SHAPES))
    p.add_argument("--model", default=None, help="an existing ST folder instead of a random one")
    p.add_argument("--num-passages", type=int, default=1000)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--tune-passages", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="CPU threads of each side (0: all)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
