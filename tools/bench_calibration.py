"""Calibration benchmark: how fast the closed loop learns a cost file that is 3x off, and what it costs.

Writes ``recipes/cost-cpu-tiny.yaml`` with every time coefficient multiplied by ``--scale`` (3) to a
temporary file, trains ``recipes/cpu-dcp.yaml`` on 2 ranks (``accelerate launch``) with
``train.calibrate=true``, and reports per step the median per-rank error of predicted vs measured
compute (``model_error`` in ``metrics.jsonl``: the contract-2 prediction of the cost model that planned
the step against each rank's thread CPU time), the fits (error before and after each), and the share of
the step spent in the closed loop (``closed_loop_ms`` / ``step_ms``).

    python tools/bench_calibration.py                    # 12 steps, scale 3
    python tools/bench_calibration.py --scale 1 --steps 12   # a cost file that is already right
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=3.0, help="multiply every time coefficient by this (default 3)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--from-step", type=int, default=5, help="report the median error from this step on (5)")
    ap.add_argument("--out", help="keep the run here (default: a temporary folder)")
    args = ap.parse_args(argv)
    os.chdir(REPO)
    work = args.out or tempfile.mkdtemp(prefix="bench-calibration-")
    os.makedirs(work, exist_ok=True)
    cost = yaml.safe_load((REPO / "recipes" / "cost-cpu-tiny.yaml").read_text())
    for d in [cost, *cost.get("strategies", [])]:
        for k in ("quadratic_ms", "linear_ms", "microbatch_ms"):
            if k in d:
                d[k] *= args.scale
    path = os.path.join(work, "cost-off.yaml")
    Path(path).write_text(yaml.safe_dump(cost, sort_keys=False))
    run = os.path.join(work, "run")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "parallel_runtime",
           "--recipe", str(REPO / "recipes" / "cpu-dcp.yaml"), "--out", run, "--steps", str(args.steps)]
    for s in ("world.size=2", "data.max_seq_len=2048", "policy.compare=[]", "train.calibrate=true",
              f"cost.file={path}", "train.checkpoint_every=0"):
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(run, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    print(f"cost file x{args.scale:g}; 2 ranks; per step: model error (median per rank), fits\n")
    print("| step | model error | wall error | speeds | fit: error before -> after | closed loop / step |")
    print("|---|---|---|---|---|---|")
    for r in recs:
        fit = r.get("calibration")
        f = f"{fit['error_before']:.3f} -> {fit['error_after']:.3f} (from step {fit['from_step']})" if fit else ""
        print(f"| {r['step']} | {r['model_error']:.3f} | {r['wall_error']:.3f} | {r.get('speeds', '')} | {f} | "
              f"{r.get('closed_loop_ms', 0) / r['step_ms']:.4f} |")
    late = [r["model_error"] for r in recs if r["step"] >= args.from_step]
    share = statistics.fmean(r.get("closed_loop_ms", 0) / r["step_ms"] for r in recs)
    print(f"\nmedian model error from step {args.from_step}: **{statistics.median(late):.3f}**; "
          f"closed loop {share:.2%} of the step time (mean)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
