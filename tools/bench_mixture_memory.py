"""Peak RSS of planning a mixture of three 50M-doc length files against one 1M-doc file (issue 21).

Seeded lognormal int64 ``.npy`` length files are written once, in chunks, into a temporary folder
(``--dir``; never committed: 3 x 400 MB + 8 MB). Each repeat runs, in a fresh process, the same
``balanced-loader plan --world-size 512 --cost hydra-gpt7b-a100 --policy hydra
--global-batch-tokens 4000000 --steps 3`` once on ``--lengths one.npy`` and once on
``--mix a=A.npy:0.6 b=B.npy:0.3 c=C.npy:0.1``, and a loader over the same mixture
(``BalancedLoader(bl.mix(...), ..., world_size=512, rank=0)``, whose length files are checked in a
streamed pass on open) for 3 steps, alternating, and records each process's peak RSS (``VmHWM``).
Reported: medians over the repeats and the difference (target: within 150 MB).

    python tools/bench_mixture_memory.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_npy_loader import write_lengths  # a sibling script: python puts the script's folder first

# the peak is the process's own VmHWM: ru_maxrss would keep the parent's high-water mark across fork + exec
CHILD = r"""
import json, sys, time
from balanced_loader.cli import main
t0 = time.perf_counter()
rc = main(sys.argv[1:])
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))
print(json.dumps({"rc": rc, "s": time.perf_counter() - t0, "rss_kb": hwm}))
"""
LOADER = r"""
import json, sys, time
import balanced_loader as bl
t0 = time.perf_counter()
src = bl.mix({n: p for n, p in zip("abc", sys.argv[1:4])}, weights={"a": 0.6, "b": 0.3, "c": 0.1})
ld = bl.BalancedLoader(src, policy="hydra", cost="hydra-gpt7b-a100", world_size=512, rank=0,
                       global_batch_tokens=4_000_000, prefetch_steps=0, epochs=None)
steps = [b.plan.tokens for _, b in zip(range(3), ld)]
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))
print(json.dumps({"rc": 0, "s": time.perf_counter() - t0, "rss_kb": hwm, "tokens": steps}))
"""
PLAN = ["plan", "--world-size", "512", "--cost", "hydra-gpt7b-a100", "--policy", "hydra",
        "--global-batch-tokens", "4000000", "--steps", "3"]


def run(argv: list[str], out: str) -> dict:
    if argv[0] == "loader":
        p = subprocess.run([sys.executable, "-c", LOADER, *argv[1:]], capture_output=True, text=True)
    else:
        p = subprocess.run([sys.executable, "-c", CHILD, *argv, "--out", out], capture_output=True, text=True)
    res = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"rc": p.returncode}
    if res["rc"]:
        raise SystemExit(f"failed: {' '.join(argv)}\n{p.stderr}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder for the length files (default: a temporary folder)")
    ap.add_argument("--docs", type=float, default=5e7, help="docs in each mixture source (default 5e7)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        one = os.path.join(tmp, "one.npy")
        write_lengths(one, 1_000_000, 0)
        parts = {}
        for k, (name, w) in enumerate((("a", 0.6), ("b", 0.3), ("c", 0.1))):
            parts[name] = (os.path.join(tmp, f"{name}.npy"), w)
            write_lengths(parts[name][0], int(args.docs), k + 1)
        n = f"{int(args.docs):,}"
        cases = {"`plan`, one 1M-doc file": PLAN + ["--lengths", one],
                 f"`plan --mix`, 3 x {n} docs": PLAN + ["--mix", *(f"{k}={p}:{w}" for k, (p, w) in parts.items())],
                 f"`BalancedLoader(bl.mix(...))`, 3 x {n} docs, 3 steps": ["loader", *(p for p, _ in parts.values())]}
        runs: dict[str, list[dict]] = {k: [] for k in cases}
        for _ in range(args.repeats):
            for name, argv in cases.items():
                runs[name].append(run(argv, os.path.join(tmp, "plan.json")))
    med = {k: statistics.median(r["rss_kb"] for r in v) / 1024 for k, v in runs.items()}
    print(f"medians of {args.repeats} (fresh process each, alternating)")
    print("| input | peak RSS | time |")
    print("|---|---:|---:|")
    for k, v in runs.items():
        print(f"| {k} | {med[k]:,.1f} MiB | {statistics.median(r['s'] for r in v):.1f} s |")
    base, *rest = med.values()
    print("over the 1M-doc file: " + ", ".join(f"{v - base:+,.1f} MiB" for v in rest) + " (target: within 150 MB)")


if __name__ == "__main__":
    main()
