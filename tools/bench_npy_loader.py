"""Peak RSS of a loader over a memory-mapped ``.npy`` length file: build it, take its first batch, save its state.

For each ``--docs`` count a seeded lognormal int64 length file is written (once, in chunks, under
``--dir``); then, per repeat, a fresh process runs ``BalancedLoader(path, policy="hydra",
cost="hydra-gpt7b-a100", world_size=512, rank=0, global_batch_tokens=4_000_000,
prefetch_steps=0)``, takes its first batch and calls ``state_dict()`` (the source's total tokens
and lengths fingerprint: streamed passes). Reported: the peak RSS after the first batch and after
``state_dict()``, and the times, medians over the repeats (sizes interleaved).
``--code DIR`` runs another checkout (e.g. ``git archive BASE balanced_loader | tar -x -C DIR``).

    python tools/bench_npy_loader.py --docs 1e6 5e7 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
from balanced_loader.loader import BalancedLoader
t0 = time.perf_counter()
ld = BalancedLoader(sys.argv[1], policy="hydra", cost="hydra-gpt7b-a100", world_size=512, rank=0,
                    global_batch_tokens=4_000_000, prefetch_steps=0)
next(ld)
t1 = time.perf_counter()
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ld.state_dict()
t2 = time.perf_counter()
print(json.dumps({"first_s": t1 - t0, "rss_first": rss1, "state_s": t2 - t1,
                  "rss_state": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def write_lengths(path: str, n: int, seed: int = 0) -> None:
    """A seeded lognormal ``[n]`` int64 ``.npy`` length file, written in chunks (complete or absent)."""
    import numpy as np

    out = np.lib.format.open_memmap(path + ".tmp.npy", mode="w+", dtype=np.int64, shape=(n,))
    rng = np.random.default_rng(seed)
    for a in range(0, n, 1 << 22):
        b = min(n, a + (1 << 22))
        out[a:b] = np.maximum(1, rng.lognormal(7.0, 1.2, b - a)).astype(np.int64)
    out.flush()
    del out
    os.replace(path + ".tmp.npy", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", nargs="+", default=["1e6", "5e7"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--code", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    type=os.path.abspath)
    args = ap.parse_args()
    paths = {}
    for d in args.docs:
        n = int(float(d))
        paths[n] = os.path.join(os.path.abspath(args.dir), f"lengths_{d}.npy")
        if not os.path.exists(paths[n]):
            write_lengths(paths[n], n)
    runs: dict[int, list[dict]] = {n: [] for n in paths}
    env = {**os.environ, "PYTHONPATH": args.code}
    for _ in range(args.repeats):
        for n, p in paths.items():
            # cwd: python -c imports from the working folder first, so it must be the code under test
            out = subprocess.run([sys.executable, "-c", CHILD, p], env=env, cwd=args.code, check=True,
                                 capture_output=True, text=True).stdout
            runs[n].append(json.loads(out.strip().splitlines()[-1]))
    print(f"code: {args.code}; medians of {args.repeats}")
    print("| docs | `.npy` size | peak RSS, first batch | time | peak RSS, + state_dict() | state_dict() time |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, rs in runs.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731, B023
        print(f"| {n:,} | {n * 8 / 1e6:,.0f} MB | {med('rss_first') / 1024:,.1f} MiB | {med('first_s'):.2f} s "
              f"| {med('rss_state') / 1024:,.1f} MiB | {med('state_s'):.2f} s |")


if __name__ == "__main__":
    main()
