"""Opening a Megatron ``.idx`` of 100M sequences: ``open_source(PREFIX)`` plus ``lengths.sum()``, time and memory.

Writes ``PREFIX.idx`` (``--sequences``, default 100M, lengths drawn from the Wikipedia lengths with a fixed
seed; 2.2 GB) and a sparse ``PREFIX.bin`` of the matching size (no disk blocks: opening checks only its
size) under ``--dir`` (default /tmp), then times, in fresh processes, the open and the sum: once with the
``.idx`` in the page cache (warm) and once after ``posix_fadvise(DONTNEED)`` dropped this file's cached pages
(cold; other files' caches untouched). Memory is the resident set (``VmRSS``) and its peak (``VmHWM``,
reset through ``/proc/self/clear_refs`` after the imports) above the interpreter with numpy and
balanced_loader imported. The files are deleted at the end (``--keep`` keeps them).

    PYTHONPATH=. python tools/bench_megatron_idx.py [--sequences 100000000] [--dir /tmp] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

from balanced_loader.data.megatron import CODES, MAGIC, VERSION

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIKI = os.path.join(REPO, "data", "wikipedia_lengths.txt.gz")
CHUNK = 1 << 22

MEASURE = r"""
import json, os, sys, time
import numpy as np
import balanced_loader
from balanced_loader import open_source

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident set (VmHWM) to the current one
rss0 = status("VmRSS")
t0 = time.perf_counter()
src = open_source(sys.argv[1])
t_open = time.perf_counter() - t0
total = int(src.lengths.sum())
t = time.perf_counter() - t0
print(json.dumps({"seconds": t, "open_seconds": t_open, "total": total, "docs": src.num_docs,
                  "rss_above_mb": (status("VmRSS") - rss0) / 2**20, "peak_above_mb": (status("VmHWM") - rss0) / 2**20,
                  "baseline_rss_mb": rss0 / 2**20}))
"""


def write(prefix: str, n: int, seed: int = 0) -> int:
    """``PREFIX.idx`` of ``n`` uint16 sequences (one document each) and a sparse ``PREFIX.bin``; the total tokens."""
    with gzip.open(WIKI) as f:
        pool = np.loadtxt(f, dtype=np.int64)
    rng = np.random.default_rng(seed)
    total = 0
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODES[np.dtype(np.uint16)], n, n + 1))
        for a in range(0, n, CHUNK):  # lengths
            ln = rng.choice(pool, size=min(CHUNK, n - a)).astype("<i4")
            f.write(ln.tobytes())
        rng = np.random.default_rng(seed)
        for a in range(0, n, CHUNK):  # pointers: the same lengths again, summed
            ln = rng.choice(pool, size=min(CHUNK, n - a)).astype(np.int64)
            ptr = total * 2 + np.concatenate([[0], np.cumsum(ln[:-1] * 2)])
            f.write(ptr.astype("<i8").tobytes())
            total += int(ln.sum())
        for a in range(0, n + 1, CHUNK):  # document indices 0..n
            f.write(np.arange(a, min(a + CHUNK, n + 1), dtype="<i8").tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(total * 2)  # sparse: no blocks written
    return total


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(prefix: str) -> dict:
    r = subprocess.run([sys.executable, "-c", MEASURE, prefix], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": REPO})
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=100_000_000)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    prefix = os.path.join(args.dir, f"bench_idx_{args.sequences}")
    t0 = time.perf_counter()
    total = write(prefix, args.sequences)
    print(f"wrote {prefix}.idx ({os.path.getsize(prefix + '.idx') / 1e9:.2f} GB, {args.sequences:,} sequences, "
          f"{total:,} tokens) and a sparse .bin in {time.perf_counter() - t0:.0f} s")
    try:
        rows = {"warm": [], "cold": []}
        for _ in range(args.repeats):
            for kind in ("cold", "warm"):
                if kind == "cold":
                    drop_cache(prefix + ".idx")
                m = measure(prefix)
                assert m["total"] == total and m["docs"] == args.sequences, m
                rows[kind].append(m)
        print("| cache | open + lengths.sum() s (median) | open s | resident above the interpreter MB | "
              "peak above MB | interpreter + imports MB |")
        print("|---|---|---|---|---|---|")
        for kind, ms in rows.items():
            print(f"| {kind} | {statistics.median(m['seconds'] for m in ms):.2f} | "
                  f"{statistics.median(m['open_seconds'] for m in ms):.4f} | "
                  f"{max(m['rss_above_mb'] for m in ms):.1f} | {max(m['peak_above_mb'] for m in ms):.1f} | "
                  f"{statistics.median(m['baseline_rss_mb'] for m in ms):.0f} |")
        print(f"(max over {args.repeats} runs for memory; total {total:,} tokens checked in every run)")
    finally:
        if not args.keep:
            for ext in (".idx", ".bin"):
                if os.path.exists(prefix + ext):
                    os.remove(prefix + ext)


if __name__ == "__main__":
    main()
