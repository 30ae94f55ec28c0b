"""Straggler benchmark: closed-loop planning (``train.calibrate``) against a rank at about half speed.

Two ranks are started by hand, torchrun style (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``),
each pinned to one core with ``taskset``; a CPU-bound competitor is pinned on core 1, so rank 1 gets
about half of its core. Each round runs, per policy, the recipe without and with ``train.calibrate=true``
(in alternating order), and the figure is the mean step time over steps 6..19 (``step_ms`` of
``metrics.jsonl``): calibrated / uncalibrated, median over rounds. The losses of every run are checked
against ``--reference`` (one process, the same batches) within 1e-5.

    python tools/bench_straggler.py --rounds 3            # token-kk and hydra with policy.cp=1
    python tools/bench_straggler.py --rounds 1 --no-competitor   # the uncontended cost of calibration

Needs Linux with ``taskset`` and at least 2 cores. Timing is the machine's: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "cpu-dcp.yaml")
BASE = ["world.size=2", "data.max_seq_len=2048", "policy.compare=[]", "steps=20", "train.checkpoint_every=0"]
POLICIES = {"token-kk": ["policy.name=token-kk"], "hydra": ["policy.name=hydra", "policy.cp=1"]}
FIRST, LAST = 6, 19  # the steps averaged


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sets_args(sets: list[str]) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def run_world(sets: list[str], out: str, *, pin: bool, timeout_s: float) -> None:
    """Two ranks of ``python -m parallel_runtime``, rank r pinned to core r."""
    port = free_port()
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "parallel_runtime", "--recipe", RECIPE, "--out", out, *sets_args(sets)]
        if pin:
            cmd = ["taskset", "-c", str(r), *cmd]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    t0 = time.monotonic()
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"bench_straggler: a run of {sets} timed out after {timeout_s:.0f} s") from None
        if p.returncode:
            raise SystemExit(f"bench_straggler: a rank failed ({sets}): {err.strip().splitlines()[-1:]}")


def reference(sets: list[str], out: str) -> list[float]:
    subprocess.run([sys.executable, "-m", "parallel_runtime", "--recipe", RECIPE, "--reference", "--out", out,
                    *sets_args(sets)], check=True, stdout=subprocess.DEVNULL)
    return [m["loss"] for m in records(out)]


def records(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def mean_step_ms(recs: list[dict]) -> float:
    return statistics.fmean(r["step_ms"] for r in recs if FIRST <= r["step"] <= LAST)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--policies", default="token-kk,hydra", help="comma-separated: token-kk, hydra (default both)")
    ap.add_argument("--no-competitor", action="store_true", help="no competitor on core 1 (the uncontended case)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run (default 1800)")
    ap.add_argument("--keep", help="keep the runs' folders here")
    args = ap.parse_args(argv)
    os.chdir(REPO)  # the recipe's corpus folder (.demo/stdlib-shards) is relative to the working directory
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        raise SystemExit("bench_straggler: needs taskset and at least 2 cores")
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"bench_straggler: unknown policy {p!r}; choose among {', '.join(POLICIES)}")
    work = args.keep or tempfile.mkdtemp(prefix="bench-straggler-")
    os.makedirs(work, exist_ok=True)
    # the corpus is built once, before any timed run (the recipe's data.shards_dir)
    subprocess.run([sys.executable, "-c", "from balanced_loader.build.corpus import stdlib_shards; "
                    "stdlib_shards('.demo/stdlib-shards')"], check=True, cwd=REPO)
    competitor = None
    if not args.no_competitor:
        competitor = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
    ratios: dict[str, list[float]] = {p: [] for p in policies}
    found: dict[str, list] = {p: [] for p in policies}
    worst: dict[str, float] = {p: 0.0 for p in policies}  # largest relative loss difference to --reference
    share: dict[str, list[float]] = {p: [] for p in policies}  # closed-loop time / step time, calibrated runs
    try:
        refs = {p: reference([*BASE, *POLICIES[p]], f"{work}/{p}-ref") for p in policies}
        for rnd in range(args.rounds):
            for p in policies:
                times = {}
                modes = ("off", "on") if rnd % 2 == 0 else ("on", "off")  # alternate which goes first
                for mode in modes:
                    out = f"{work}/{p}-{mode}-{rnd}"
                    sets = [*BASE, *POLICIES[p], f"train.calibrate={'true' if mode == 'on' else 'false'}"]
                    run_world(sets, out, pin=True, timeout_s=args.timeout)
                    recs = records(out)
                    err = max(abs(r["loss"] - x) / abs(x) for r, x in zip(recs, refs[p]))
                    if err > 1e-5:
                        raise SystemExit(f"bench_straggler: {p} calibrate={mode}: loss off the reference by {err:.2e}")
                    times[mode] = mean_step_ms(recs)
                    worst[p] = max(worst[p], err)
                    if mode == "on":
                        share[p].append(statistics.mean(r.get("closed_loop_ms", 0.0) / r["step_ms"]
                                                        for r in recs if FIRST <= r["step"] <= LAST))
                        found[p].append(next((r["speeds"] for r in reversed(recs) if "speeds" in r), None))
                ratios[p].append(times["on"] / times["off"])
                print(f"round {rnd} {p}: mean step {times['off']:.0f} ms -> {times['on']:.0f} ms with calibration "
                      f"({times['on'] / times['off']:.3f}x); speeds {found[p][-1]}", flush=True)
    finally:
        if competitor is not None:
            competitor.kill()
    print(f"\n| policy | competitor on core 1 | mean step 6-19, calibrated / not (median of {args.rounds}) | "
          f"per round | speeds found | closed loop / step | losses vs --reference (max rel.) |")
    print("|---|---|---|---|---|---|---|")
    for p in policies:
        print(f"| {p} | {'no' if args.no_competitor else 'yes'} | **{statistics.median(ratios[p]):.3f}x** | "
              f"{', '.join(f'{x:.3f}' for x in ratios[p])} | {found[p][-1]} | "
              f"{100 * statistics.mean(share[p]):.2f}% | {worst[p]:.1e} |")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
