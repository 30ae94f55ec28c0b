"""``bl.balance`` planning time and memory at the scales of issue 38: 10^7 rollouts on 64 ranks, 10^5 ranks,
10^6 ranks (each case in a fresh process: its own peak RSS; the compiled kernels loaded before the clock).

Lengths: seeded lognormal(log 2048, 1.2) tokens, rounded, clipped to [1, 32768] (as ``bench_rl_balance.py``);
the cap 32,768 tokens. Reported per case: wall and CPU seconds of ``bl.balance`` (CPU time is what a shared
machine's other jobs do not inflate), microbatches per rank, the heaviest rank's work over the mean, peak RSS.

    python tools/bench_rl_scaling.py                              # the issue's cases, a markdown table
    python tools/bench_rl_scaling.py --cases 1000000x64 --json out.json
    python tools/bench_rl_scaling.py --repo /tmp/base38 --cases 1000000x64   # another checkout's code
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = ["10000000x64", "1000000x64", "100000x100000", "1000000x100000", "1000x1000000"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, resource, sys, time
import numpy as np
import balanced_loader as bl
from balanced_loader.planning.rl import rollout_work
n, k = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
lengths = np.clip(np.round(rng.lognormal(np.log(2048), 1.2, n)), 1, 32768).astype(np.int64)
bl.balance(lengths[:256], world_size=4, max_tokens_per_microbatch=32768)  # kernels compiled / loaded
c0, t0 = time.process_time(), time.perf_counter()
out = bl.balance(lengths, world_size=k, max_tokens_per_microbatch=32768)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
work = rollout_work(lengths)
rank = np.empty(n, dtype=np.int64)
for r, mbs in enumerate(out):
    for mb in mbs:
        rank[mb] = r
loads = np.bincount(rank, weights=work, minlength=k)
print(json.dumps({"rollouts": n, "ranks": k, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                  "microbatches_per_rank": len(out[0]), "max_over_mean": round(float(loads.max() / loads.mean()), 5),
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
"""


def run_case(spec: str, repo: str, timeout: float) -> dict:
    n, k = spec.split("x")
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, n, k], capture_output=True, text=True, env=env, cwd=repo,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rollouts": int(n), "ranks": int(k), "error": f"over {timeout:.0f} s"}
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"rollouts": int(n), "ranks": int(k), "error": last[:120]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=CASES, metavar="NxK", help="rollouts x ranks")
    ap.add_argument("--repo", default=REPO, help="the checkout whose balanced_loader is timed")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a case may take")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    rows = [run_case(c, a.repo, a.timeout) for c in a.cases]
    print("| rollouts | ranks | wall s | CPU s | microbatches/rank | max/mean | peak RSS MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['rollouts']:,} | {r['ranks']:,} | {r['error']} | | | | |")
        else:
            print(f"| {r['rollouts']:,} | {r['ranks']:,} | {r['wall_s']} | {r['cpu_s']} | {r['microbatches_per_rank']} "
                  f"| {r['max_over_mean']} | {r['peak_rss_mb']:,} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"repo": a.repo, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
