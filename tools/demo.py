"""``make demo``: train the tiny model on a real long-tailed corpus, 4 CPU ranks, two pools of different shape.

1. Builds byte-level webdataset shards of the CPython standard library's ``.py`` files into
   ``.demo/stdlib-shards`` once (reused later).
2. Trains ``recipes/cpu-hetero.yaml`` through the real launcher, ``accelerate launch --multi_gpu
   --num_processes 4 -m parallel_runtime`` (without a GPU the 4 processes join a gloo world): every
   step one pipeline of 2 stages (ranks 0-1) beside a pool of 2 lanes (ranks 2-3) whose long docs
   run as a CP group, optimizer shards fixed over all 4 ranks.
3. Checks the first steps against ``--reference`` (the same docs in one process, no parallelism).
4. Prints the loss curve and the per-rank balance report (cost-model prediction vs measured compute
   time) and writes ``.demo/training.png``.

    python tools/demo.py                    # about 2 minutes on 2 cores
    python tools/demo.py --steps 10         # shorter
    python tools/demo.py --loader-only      # the loader alone on a simulated cluster (no training)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np

from balanced_loader.build.corpus import stdlib_shards
from balanced_loader.simulate import lane_finish_ms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RECIPE = os.path.join(REPO, "recipes", "cpu-hetero.yaml")
DEMO = os.path.join(REPO, ".demo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], *, processes: int, log_prefix: str = "  ") -> int:
    """``accelerate launch --multi_gpu --num_processes N -m parallel_runtime ARGS``, output streamed."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), "-m", "parallel_runtime", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    print(f"$ accelerate launch --multi_gpu --num_processes {processes} -m parallel_runtime {' '.join(args)}",
          flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith(("step ", "resumed", "parallel_runtime", "epoch ")) or "Error" in line:
            print(log_prefix + line.rstrip(), flush=True)
    return proc.wait()


def reference(steps: int, out: str) -> int:
    cmd = [sys.executable, "-m", "parallel_runtime", "--recipe", RECIPE, "--reference", "--steps", str(steps),
           "--out", out]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode:
        print(r.stderr[-2000:])
    return r.returncode


def loss_curve(records: list[dict], width: int = 40, rows: int = 16) -> str:
    """One bar per step (at most ``rows`` steps, evenly spaced, the last included)."""
    losses = np.array([r["loss"] for r in records])
    lo, hi = float(losses.min()), float(losses.max())
    pick = sorted(set(np.linspace(0, len(records) - 1, min(rows, len(records))).round().astype(int).tolist()))
    lines = []
    for r in (records[i] for i in pick):
        n = int(round((r["loss"] - lo) / (hi - lo) * width)) if hi > lo else 0
        lines.append(f"  step {r['step']:3d}  loss {r['loss']:.4f}  {'#' * (n + 1)}")
    return "\n".join(lines)


def write_png(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = [r["step"] for r in records]
    ax[0].plot(steps, [r["loss"] for r in records], marker=".")
    ax[0].set(title="loss (cpu-hetero, 4 CPU ranks)", xlabel="step", ylabel="mean token loss")
    pred = np.sum([r["predicted_ms"] for r in records], axis=0) / 1e3
    meas = np.sum([r["compute_ms"] for r in records], axis=0) / 1e3
    x = np.arange(len(pred))
    ax[1].bar(x - 0.2, pred, 0.4, label="predicted (cost model)")
    ax[1].bar(x + 0.2, meas, 0.4, label="measured compute")
    pools = records[0]["pools"]
    names, r0 = [], 0
    for tp, pp, lanes, _ in pools:
        for s in range(pp):
            for lane in range(lanes):
                for t in range(tp):
                    names.append(f"r{r0} tp{tp}pp{pp}\nstage {s} lane {lane}" + (f" tp {t}" if tp > 1 else ""))
                    r0 += 1
    ax[1].set_xticks(x, names[:len(x)], fontsize=7)
    ax[1].set(title="per-rank busy time over the run", ylabel="seconds")
    ax[1].legend(fontsize=8)
    ax[2].plot(steps, [r.get("wall_skew", r["skew"]) for r in records], marker=".", label="measured (wall)")
    ax[2].plot(steps, [r["predicted_skew"] for r in records], marker=".", label="predicted (plan's cost model)")
    ax[2].plot(steps, [1 + r.get("model_error", 0.0) for r in records], ls="--", lw=1,
               label="1 + model error (compute)")
    for r in records:
        if "calibration" in r:
            ax[2].axvline(r["calibration"]["from_step"], color="grey", lw=0.6, ls=":")
    ax[2].set(title="per-step skew (max/mean rank time); dotted: a fit applies", xlabel="step")
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_demo(args: argparse.Namespace) -> int:
    from parallel_runtime.training.metrics import balance_report, read_metrics

    out = os.path.join(DEMO, "run-cpu-hetero")
    ref_out = os.path.join(DEMO, "run-cpu-hetero-reference")
    for d in (out, ref_out):
        shutil.rmtree(d, ignore_errors=True)  # a fresh run (an existing checkpoint would resume)
    t0 = time.perf_counter()
    steps = ["--steps", str(args.steps)] if args.steps else []
    print(f"\n== training {os.path.relpath(RECIPE, REPO)} on 4 CPU ranks", flush=True)
    rc = launch(["--recipe", RECIPE, "--out", out, *steps], processes=4)
    if rc:
        print(f"demo: error: training exited with code {rc}", file=sys.stderr)
        return 1
    train_s = time.perf_counter() - t0
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    print(f"\n== exactness: the first {args.check_steps} steps again in one process (--reference)", flush=True)
    if reference(args.check_steps, ref_out):
        return 1
    ref = read_metrics(os.path.join(ref_out, "metrics.jsonl"))
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(records, ref))
    for a, b in zip(records, ref):
        print(f"  step {a['step']}: 4 ranks {a['loss']:.7f}   reference {b['loss']:.7f}")
    print(f"  largest relative difference {worst:.1e} (fp32; the target is 1e-5)")
    print(f"\n== loss curve ({len(records)} steps, {train_s:.0f} s including start-up)")
    print(loss_curve(records))
    pools = ", ".join(f"pool {i}: tp={tp} pp={pp} lanes={lanes}" for i, (tp, pp, lanes, _) in
                      enumerate(records[0]["pools"]))
    cp = sum(r["cp_groups"] for r in records)
    print(f"\n== balance ({pools}; {cp} CP groups over the run)")
    print("   predicted = contract-2 busy time of the rank with the cost model that planned the step (the file")
    print("   at first, then the online fits and per-rank speeds: train.calibrate); measured = the rank's compute")
    print("   time (thread CPU time: waits and core sharing do not count) and the wall time of the same compute")
    print(balance_report(records))
    print(calibration_report(records))
    png = os.path.join(DEMO, "training.png")
    write_png(records, png)
    print(f"\nwrote {os.path.relpath(png, REPO)}; metrics in {os.path.relpath(out, REPO)}/metrics.jsonl; "
          f"total {time.perf_counter() - args.t_start:.0f} s")
    return 0 if worst <= 1e-5 else 1


def calibration_report(records: list[dict]) -> str:
    """The closed loop over the run: each fit, and predicted vs measured skew before and after the first."""
    fits = [r for r in records if "calibration" in r]
    if not fits:
        return "closed loop: off (train.calibrate: false)"
    lines = ["\n== closed loop (train.calibrate): the cost model learns this machine"]
    for r in fits:
        c = r["calibration"]
        lines.append(f"  fit after step {r['step']:3d}: compute error {c['error_before']:.3f} -> "
                     f"{c['error_after']:.3f}, speeds {[round(v, 2) for v in c['speeds']]}, "
                     f"plans from step {c['from_step']}")
    first = fits[0]["calibration"]["from_step"]
    for name, part in (("before", [r for r in records if r["step"] < first]),
                       ("after", [r for r in records if r["step"] >= first])):
        if part:
            med = {k: float(np.median([r.get(k, 0.0) for r in part])) for k in
                   ("model_error", "wall_error", "predicted_skew", "wall_skew", "measured_bubble", "contention")}
            lines.append(f"  {name:6s} the first fit ({len(part):3d} steps, medians): compute error "
                         f"{med['model_error']:.3f}, wall error {med['wall_error']:.3f}; skew predicted "
                         f"{med['predicted_skew']:.3f} vs measured {med['wall_skew']:.3f}; waiting for peers "
                         f"{med['measured_bubble']:.3f}, core sharing {med['contention']:.3f}")
    lines.append("  (waiting for peers: share of the step outside a rank's compute; core sharing: share of its")
    lines.append("   compute's wall time its thread was not running, 4 ranks sharing this machine's cores)")
    return "\n".join(lines)


# ---- the loader alone on a simulated cluster (no training) ------------------------------------


def rank_times(plan, cost, world: int) -> np.ndarray:
    """Predicted busy time of every rank ([world] ms): its lane's finish in its pool (+ pipeline fill)."""
    out = np.zeros(world)
    for pool in plan.pools:
        if not pool.microbatches:
            continue
        finish, gmax = lane_finish_ms(pool, cost)
        extra = (pool.pp - 1) * gmax / pool.pp
        for stage in pool.ranks:
            for idx, r in enumerate(stage):
                out[r] = finish[idx // pool.tp] + extra
    return out


def round_robin_skew(plan, cost, world: int) -> float:
    """Skew if the step's segments (by doc_id) were dealt round-robin, one sequence per rank, tp = pp = d = 1."""
    segments = sorted(s for p in plan.pools for mb in p.microbatches for g in mb for s in g.segments)
    lengths = [s[2] for s in segments]
    sc = cost.shape(1, 1)
    per_rank = [lengths[r::world] for r in range(world)]
    t = np.array([sc.group_ms(x, 1) if x else 0.0 for x in per_rank])
    return float(t.max() / t.mean()) if t.mean() > 0 else 1.0


def loader_demo(args: argparse.Namespace, src) -> int:
    from balanced_loader.loader import BalancedLoader
    from balanced_loader.materialize import needed_token_count, rank_place
    from balanced_loader.presets import resolve_cost

    cost = resolve_cost(args.cost, args.world)
    if args.lane_cap:
        cost = cost.with_base(max_tokens_per_lane=args.lane_cap)
    print(f"cluster: {args.world} simulated ranks, policy {args.policy}, cost {args.cost}, "
          f"{args.global_batch_tokens} tokens/step, max_seq_len {args.max_seq_len}")
    loaders = [BalancedLoader(src, policy=args.policy, cost=cost, world_size=args.world, rank=r,
                              global_batch_tokens=args.global_batch_tokens, seed=args.seed,
                              max_seq_len=args.max_seq_len, epochs=None) for r in range(args.world)]
    skews = []
    for _ in range(args.steps):
        batches = [next(ld) for ld in loaders]
        plan = batches[0].plan
        assert all(b.plan.fingerprint() == plan.fingerprint() for b in batches), "ranks disagree on the plan"
        t = rank_times(plan, cost, args.world)
        skew = float(t.max() / t.mean()) if t.mean() > 0 else 1.0
        rr = round_robin_skew(plan, cost, args.world)
        skews.append((skew, rr))
        b0 = batches[0]
        print(f"\nstep {b0.step}: {len(plan.doc_ids())} docs, {plan.tokens} tokens, planned in "
              f"{plan.plan_seconds * 1e3:.1f} ms (rank 0 waited {b0.planner_wait_s * 1e3:.1f} ms), "
              f"predicted step {plan.predicted_ms / 1e3:.2f} s, {b0.num_valid_tokens} label tokens")
        print("  rank  stage lane  microbatches  tokens  CP groups  predicted s")
        for r, b in enumerate(batches):
            place = rank_place(plan, r)
            cp = sum(m.degree > 1 for m in b.microbatches)
            print(f"  {r:4d}  {place.stage:5d} {place.lane:4d}  {len(b.microbatches):12d}  "
                  f"{needed_token_count(list(b.microbatches)):6d}  {cp:9d}  {t[r] / 1e3:11.2f}")
        print(f"  skew max/mean {skew:.3f}   (same docs dealt round-robin: {rr:.3f})")
    for ld in loaders:
        ld.close()
    mean = np.mean(skews, axis=0)
    print(f"\nmean skew over {args.steps} steps: {args.policy} {mean[0]:.3f}, round-robin {mean[1]:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's; loader-only: 4)")
    p.add_argument("--check-steps", type=int, default=6,
                   help="steps compared with --reference (6: two of them planned by the first online fit)")
    p.add_argument("--loader-only", action="store_true", help="the loader on a simulated cluster, no training")
    p.add_argument("--policy", default="greedy", help="loader-only: planning policy")
    p.add_argument("--world", type=int, default=8, help="loader-only: simulated ranks")
    p.add_argument("--cost", default="analytic:tiny@cpu", help="loader-only: cost preset or cost file")
    p.add_argument("--global-batch-tokens", type=int, default=524288, help="loader-only")
    p.add_argument("--max-seq-len", type=int, default=16384, help="loader-only: context limit")
    p.add_argument("--lane-cap", type=int, default=0, help="loader-only: override max_tokens_per_lane")
    p.add_argument("--seed", type=int, default=0, help="loader-only")
    args = p.parse_args(argv)
    args.t_start = time.perf_counter()
    logging.basicConfig(level=logging.WARNING, format="  %(message)s")
    shards = os.path.join(DEMO, "stdlib-shards")
    t0 = time.perf_counter()
    src = stdlib_shards(shards, progress=sys.stderr.isatty())
    print(f"corpus: CPython standard library .py files -> {os.path.relpath(shards, REPO)}: {src.num_docs} docs, "
          f"{src.num_tokens / 1e6:.1f}M byte-level tokens, {len(src.shard_names)} shards "
          f"(ready in {time.perf_counter() - t0:.1f} s); lengths p50 {int(np.median(src.lengths))}, "
          f"p99 {int(np.percentile(src.lengths, 99))}, max {int(src.lengths.max())}")
    if args.loader_only:
        args.steps = args.steps or 4
        return loader_demo(args, src)
    if args.steps is not None and args.check_steps > args.steps:
        args.check_steps = args.steps
    return train_demo(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        sys.exit(2)
