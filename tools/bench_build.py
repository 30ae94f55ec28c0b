"""build-shards throughput: docs/s and MB/s with 1 and 2 workers, against the tokenizer's raw speed.

All in one run, alternating, ``--repeats`` times; medians are reported, and ratios to the raw
tokenizer (the machine may be shared, so compare ratios, not absolute speed):

* **tokenizer only**: ``encode_batch`` of the same texts, in the same chunks, already in memory
  (no reading, no JSON parsing, no writing), with the HF tokenizer's own thread pool (as a
  one-worker build uses it), and on **1 thread** (as each worker of a multi-worker build);
* **build, W workers**: ``build_from_files(..., workers=W)`` into a fresh folder, whole wall time
  (reading, JSON parsing, tokenizing, writing shards, checksums and the length index; with W > 1
  the worker start-up too, also timed alone: a pool running one empty task per worker).

MB/s are input bytes (the ``.jsonl`` file) per second for every row, so the rows compare.

    python tools/bench_build.py                       # stdlib .py files as one .jsonl, a BPE trained here
    python tools/bench_build.py --tokenizer bytes --files 1500 --repeats 5
    python tools/bench_build.py --tokenizer path/to/tokenizer.json --out bench_build.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from balanced_loader.build.builder import CHUNK_DOCS, build_from_files, ordered_map
from balanced_loader.build.corpus import stdlib_py_files
from balanced_loader.data.tokenizers import encode_many, get_tokenizer
from balanced_loader.outputs.files import atomic_write


def make_corpus(folder: str, files: int) -> tuple[str, list[str]]:
    """The first ``files`` stdlib ``.py`` files as one ``.jsonl`` (one doc per file); returns its path and texts."""
    texts = []
    for path in stdlib_py_files(files):
        with open(path, "rb") as f:
            texts.append(f.read().decode("utf-8", errors="replace"))
    out = os.path.join(folder, "corpus.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return out, texts


def train_tokenizer(folder: str, texts: list[str], vocab: int) -> str:
    """A byte-level BPE trained on the corpus (local, nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


def raw_tokenize(tok, texts: list[str], threads: str | None = None) -> float:
    """Seconds to encode every text in CHUNK_DOCS batches; ``threads="1"``: the HF tokenizer on one thread
    (``TOKENIZERS_PARALLELISM=false``, as in each build worker), else its default thread pool."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    if threads == "1":
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        t0 = time.perf_counter()
        for i in range(0, len(texts), CHUNK_DOCS):
            encode_many(tok, texts[i:i + CHUNK_DOCS])
        return time.perf_counter() - t0
    finally:
        if threads == "1":
            if old is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = old


def build(corpus: str, folder: str, tokenizer: str, workers: int) -> float:
    out = os.path.join(folder, f"shards-w{workers}")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    build_from_files([corpus], out, tokenizer=tokenizer, workers=workers)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=800, help="stdlib .py files in the corpus (default 800)")
    ap.add_argument("--tokenizer", default="train",
                    help="'train' (default: a byte-level BPE trained on the corpus), 'bytes', or a tokenizer.json")
    ap.add_argument("--vocab", type=int, default=8192, help="vocab of the trained BPE (default 8192)")
    ap.add_argument("--workers", default="1,2", help="worker counts to build with (default 1,2)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repeats; medians reported (default 3)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_build_") as tmp:
        corpus, texts = make_corpus(tmp, args.files)
        spec = train_tokenizer(tmp, texts, args.vocab) if args.tokenizer == "train" else args.tokenizer
        tok = get_tokenizer(spec)
        nbytes = os.path.getsize(corpus)
        docs = len(texts)
        times: dict[str, list[float]] = {"tokenizer only": [], "tokenizer, 1 thread": []}
        times.update({f"build, {w} worker{'s' if w > 1 else ''}": [] for w in workers})
        build(corpus, tmp, spec, 1)  # warm the page cache and imports once, untimed
        for r in range(args.repeats):
            times["tokenizer only"].append(raw_tokenize(tok, texts))
            times["tokenizer, 1 thread"].append(raw_tokenize(tok, texts, threads="1"))
            for w in workers:
                times[f"build, {w} worker{'s' if w > 1 else ''}"].append(build(corpus, tmp, spec, w))
            for w in workers[1:] if len(workers) > 1 else []:
                t0 = time.perf_counter()
                list(ordered_map(len, iter([b""] * w), w))  # start the pool, one empty task per worker
                times.setdefault(f"start-up of {w} workers", []).append(time.perf_counter() - t0)
            print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["tokenizer only"]
    rows = {k: {"seconds": t, "docs_per_s": docs / t, "mb_per_s": nbytes / 2**20 / t, "vs_tokenizer": base / t}
            for k, t in med.items() if not k.startswith("start-up")}
    tok_name = tok.identity()["name"] + (f" (BPE, vocab {tok.vocab_size})" if args.tokenizer == "train" else "")
    print(f"corpus: {docs} docs, {nbytes / 2**20:.1f} MB of .jsonl; tokenizer {tok_name}; "
          f"{args.repeats} repeats, medians; {os.cpu_count()} CPUs")
    print(f"{'':22s} {'seconds':>8s} {'docs/s':>9s} {'MB/s':>7s} {'speed vs tokenizer only':>24s}")
    for k, v in rows.items():
        print(f"{k:22s} {v['seconds']:8.3f} {v['docs_per_s']:9.0f} {v['mb_per_s']:7.2f} {v['vs_tokenizer']:24.2f}")
    for k, t in med.items():
        if k.startswith("start-up"):
            print(f"{k}: {t:.2f} s (part of each build with them; a one-off cost per build)")
    if len(workers) > 1:
        w0, w1 = (f"build, {w} worker{'s' if w > 1 else ''}" for w in workers[:2])
        print(f"speed-up of {workers[1]} workers over {workers[0]}: {med[w0] / med[w1]:.2f}x")
    if args.out:
        with atomic_write(args.out, "w") as f:
            json.dump({"docs": docs, "input_bytes": nbytes, "tokenizer": tok.identity(), "repeats": args.repeats,
                       "cpus": os.cpu_count(), "times": times, "medians": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
