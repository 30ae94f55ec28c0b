"""What the checks of issue 24 cost, side by side (ratios of medians over alternating repeats).

* ``part-hash``: ``build-shards --part 0/2`` of the stdlib corpus with the content hash of every input
  byte (what a part records) against the same build with the hash switched off (a baseline only this
  benchmark makes);
* ``cursor``: ``load_state_dict`` of a mid-epoch state on a 1M-doc length source, which re-cuts the
  epoch up to the cursor to check it sits on a step boundary, against making the loader.

    python tools/bench_reliability2.py --repeats 9 [--tokenizer tokenizer.json --files 700]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np

from balanced_loader.build import builder as build
from balanced_loader.build.corpus import stdlib_py_files
from balanced_loader.loader import BalancedLoader


class _NoHash:
    """The baseline: a part build that records no content hash."""

    def __init__(self, files: list[str]) -> None:
        pass

    def result(self) -> str:
        return "off"

    def stop(self) -> None:
        pass


def part_hash(repeats: int, tokenizer: str | None, limit: int | None) -> None:
    files = stdlib_py_files(limit)
    mb = sum(build.file_sizes(files)) / 2**20
    real = build.ContentHash
    times: dict[str, list[float]] = {"hash": [], "no hash": []}
    ratios = []  # per repeat: with / without, the two runs side by side (their order alternates)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            pair = {}
            for mode in (("hash", "no hash") if r % 2 == 0 else ("no hash", "hash")):
                build.ContentHash = real if mode == "hash" else _NoHash
                out = f"{tmp}/part-{mode.replace(' ', '')}-{r}"
                t0 = time.perf_counter()
                build.build_from_files(files, out, part=(0, 2), max_shard_bytes=4 << 20, tokenizer=tokenizer,
                                       decode_errors="replace")
                pair[mode] = time.perf_counter() - t0
                times[mode].append(pair[mode])
                shutil.rmtree(out)
            ratios.append(pair["hash"] / pair["no hash"])
    build.ContentHash = real
    a, b = statistics.median(times["hash"]), statistics.median(times["no hash"])
    print(f"part-hash: --part 0/2 of {len(files)} stdlib files ({mb:.1f} MB of input, tokenizer "
          f"{tokenizer or 'bytes'}): with the input hash {a:.2f} s, without {b:.2f} s (medians of {repeats}); "
          f"median per-repeat ratio {statistics.median(ratios):.3f} (range {min(ratios):.2f}-{max(ratios):.2f})")


def cursor(repeats: int) -> None:
    lengths = np.random.default_rng(0).integers(1, 4000, size=1_000_000)  # [docs]
    kw = dict(policy="greedy", cost="analytic:tiny@cpu", world_size=8, rank=0, global_batch_tokens=1 << 20,
              max_seq_len=4096, prefetch_steps=0)
    fresh = BalancedLoader(lengths, **kw)
    steps = fresh.steps_in_epoch(0)
    # a state saved where step steps // 2 begins (the loader's cursor moved there without planning)
    at = BalancedLoader(lengths, **kw)
    at.load_state_dict(fresh.state_dict())
    for _ in range(steps // 2):
        at.epoch, at.step_in_epoch = at._cursor_after(at.epoch, at.step_in_epoch)
        at.step += 1
    state = at.state_dict()
    make, load = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ld = BalancedLoader(lengths, **kw)
        make.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ld.load_state_dict(state)
        load.append(time.perf_counter() - t0)
    a, b = statistics.median(load), statistics.median(make)
    print(f"cursor: 1M docs, {steps} steps per epoch, a state at step {state['step_in_epoch']}: load_state_dict "
          f"{a:.3f} s vs making the loader {b:.3f} s (medians of {repeats}); ratio {a / b:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=("part-hash", "cursor"))
    ap.add_argument("--tokenizer", help="part-hash: a local tokenizer.json (default: bytes)")
    ap.add_argument("--files", type=int, help="part-hash: only the first N stdlib files")
    args = ap.parse_args()
    if args.only in (None, "cursor"):
        cursor(args.repeats)
    if args.only in (None, "part-hash"):
        part_hash(args.repeats, args.tokenizer, args.files)


if __name__ == "__main__":
    main()
