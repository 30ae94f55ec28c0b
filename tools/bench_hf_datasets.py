"""open_source(datasets.Dataset): first open (lengths computed and cached) vs cached open, and RSS on open.

Builds a synthetic tokenized dataset with pyarrow (record batches of 1,000 rows, as ``datasets``
writes them), saves it with ``save_to_disk`` and, for each repeat, reloads it with
``load_from_disk`` (memory-mapped) and times ``open_source(ds)`` alone: "first" with the length
cache removed, "cached" with it present. Medians over ``--repeats``; the RSS growth of one open
(plus a read of one doc) is measured in a fresh child process per mode, against the token
column's size.

    python tools/bench_hf_datasets.py --docs 1000000 --mean-tokens 256 --dtype uint16
    python tools/bench_hf_datasets.py --docs 1000000 --mean-tokens 256 --dtype int32
    python tools/bench_hf_datasets.py --docs 1000000 --mean-tokens 256 --dtype int32 --vocab-size 50000
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def build(folder: str, docs: int, mean: int, dtype: str) -> int:
    import datasets
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 2 * mean, size=docs)
    batches = []
    for a in range(0, docs, 1000):
        n = lengths[a:a + 1000]
        offsets = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        values = rng.integers(0, 50_000, size=int(offsets[-1])).astype(dtype)
        batches.append(pa.record_batch([pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))],
                                       names=["input_ids"]))
    datasets.disable_progress_bars()
    datasets.Dataset(pa.Table.from_batches(batches)).save_to_disk(folder, max_shard_size="100GB")
    return int(lengths.sum()) * np.dtype(dtype).itemsize


def child(folder: str, vocab_size: int | None) -> None:
    """One open in this fresh process: prints its time and RSS growth as JSON."""
    import datasets

    from balanced_loader.data.hf_datasets import HFDatasetSource

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    ds = datasets.load_from_disk(folder)
    before = rss()
    t0 = time.perf_counter()
    src = HFDatasetSource(ds, vocab_size=vocab_size)  # what open_source(ds) does, plus vocab_size
    t = time.perf_counter() - t0
    src.read(len(src.lengths) // 2, 0, int(src.lengths[len(src.lengths) // 2]))
    print(json.dumps({"open_s": t, "rss_grow": rss() - before, "computed": src.lengths_computed}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--mean-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="uint16", choices=["uint16", "int32", "int64"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab-size", type=int, help="HFDatasetSource(vocab_size=): no min/max pass over signed ids")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.vocab_size)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "ds")
        t0 = time.perf_counter()
        col_bytes = build(folder, args.docs, args.mean_tokens, args.dtype)
        print(f"built {args.docs:,} docs, {col_bytes / 2**20:.0f} MiB of {args.dtype} tokens "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)

        def run() -> dict:
            extra = ["--vocab-size", str(args.vocab_size)] if args.vocab_size else []
            out = subprocess.run([sys.executable, __file__, "--child", folder, *extra], check=True,
                                 capture_output=True, text=True).stdout
            return json.loads(out.strip().splitlines()[-1])

        first, cached = [], []
        for _ in range(args.repeats):  # alternating: first open (cache removed), then the cached open
            for f in glob.glob(os.path.join(folder, "balanced-loader-lengths-*")):
                os.remove(f)
            r = run()
            assert r["computed"]
            first.append(r)
            r = run()
            assert not r["computed"]
            cached.append(r)
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        f_s, c_s = med(first, "open_s"), med(cached, "open_s")
        print(f"open_source, first (lengths computed + cached): {f_s * 1e3:.1f} ms  "
              f"RSS +{med(first, 'rss_grow') / 2**20:.1f} MiB")
        print(f"open_source, cached (memory-mapped lengths):    {c_s * 1e3:.1f} ms  "
              f"RSS +{med(cached, 'rss_grow') / 2**20:.1f} MiB")
        print(f"first / cached: {f_s / c_s:.1f}x; token column {col_bytes / 2**20:.0f} MiB "
              f"(median of {args.repeats}, one fresh process per open)")


if __name__ == "__main__":
    main()
