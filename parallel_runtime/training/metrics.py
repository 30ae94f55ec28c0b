"""Per-step metrics: predicted vs measured per-rank time, skew, bubble; ``OUT/metrics.jsonl``.

* **predicted ms** of a rank: its contract-2 busy time in the step, the sum of
  ``group_ms / pp`` over the groups its lane is in (the cost model's view of its compute).
* **measured ms**: the rank's compute time in the step's forward and backward
  (:class:`parallel_runtime.engines.pipeline.Clock`: thread CPU time on CPU, so waiting for peers and
  sharing cores with other ranks cost nothing; synchronized wall time on CUDA).
* **skew**: max / mean over ranks (1.0 is perfect balance).
* **bubble**: the idle share of the step, ``1 - mean busy / step time``; ``bubble`` uses the cost
  model (busy = predicted ms, step = the plan's contract-2 step time, fill and drain included),
  ``measured_bubble`` the measurements (busy = compute ms, step = the slowest rank's
  forward/backward wall time).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from balanced_loader.cost import CostModel
from balanced_loader.plan import StepPlan
from balanced_loader.simulate import simulate_step


def predicted_rank_ms(plan: StepPlan, cost: CostModel) -> np.ndarray:
    """``[world_size]`` contract-2 busy ms of every rank in a step (:func:`balanced_loader.simulate.simulate_step`)."""
    return simulate_step(plan, cost).rank_busy_ms


def skew(values: Sequence[float] | np.ndarray) -> float:
    """max / mean (1.0 for an empty or all-zero list)."""
    v = np.asarray(values, dtype=np.float64)
    m = float(v.mean()) if v.size else 0.0
    return float(v.max() / m) if m > 0 else 1.0


def bubble(busy: Sequence[float] | np.ndarray, step_ms: float) -> float:
    """Idle share of a step: ``1 - mean(busy) / step_ms``."""
    b = np.asarray(busy, dtype=np.float64)
    return float(1.0 - b.mean() / step_ms) if step_ms > 0 and b.size else 0.0


def plan_shape(plan: StepPlan) -> dict[str, Any]:
    """The step's pools ``[tp, pp, lanes, microbatches]`` and its CP groups (count, largest degree)."""
    degrees = [g.degree for p in plan.pools for mb in p.microbatches for g in mb]
    return {"pools": [[p.tp, p.pp, p.num_lanes, len(p.microbatches)] for p in plan.pools],
            "cp_groups": sum(d > 1 for d in degrees), "max_degree": max(degrees, default=0)}


def balance(plan: StepPlan, cost: CostModel, compute_ms: Sequence[float], wall_ms: Sequence[float]) -> dict[str, Any]:
    """Predicted and measured balance of one executed plan (keys as in ``metrics.jsonl``)."""
    sim = simulate_step(plan, cost)
    pred, step_ms = sim.rank_busy_ms, sim.step_ms
    return {
        "compute_ms": [round(float(x), 3) for x in compute_ms],
        "predicted_ms": [round(float(x), 3) for x in pred],
        "predicted_step_ms": round(step_ms, 3),
        "skew": round(skew(compute_ms), 4),
        "predicted_skew": round(skew(pred), 4),
        "bubble": round(bubble(pred, step_ms), 4),
        "measured_bubble": round(bubble(compute_ms, max(wall_ms, default=0.0)), 4),
    }


class MetricsLog:
    """``metrics.jsonl`` (one JSON object per step), appended across resumed runs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def truncate_from(self, step: int) -> None:
        """Drop lines of steps ``>= step`` (written after the checkpoint a run resumes from), and a
        partial last line (a run stopped while writing it), with a note naming the file."""
        if not os.path.exists(self.path):
            return
        records, partial = _read(self.path)
        if partial:
            print(f"metrics: dropped a partial last line of {self.path} (a run stopped while writing it)",
                  flush=True)
        keep = [line for line in records if line["step"] < step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for line in keep:
                f.write(json.dumps(line) + "\n")
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The complete records of ``path``; a partial last line (a run stopped while writing it) is left out."""
    return _read(path)[0]


def _read(path: str) -> tuple[list[dict[str, Any]], bool]:
    """``(records, whether a partial last line was left out)``; a bad line elsewhere is a ValueError."""
    with open(path) as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    out = []
    for k, (i, line) in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if k == len(lines) - 1 and not line.endswith("\n"):  # only the last write can be cut short
                return out, True
            raise ValueError(f"{path}: line {i} is not a JSON record; repair or remove the file") from None
    return out, False


def format_step(m: dict[str, Any]) -> str:
    """One log line per step."""
    line = (f"step {m['step']:4d}  loss {m['loss']:.5f}  tokens {m['tokens']:6d}  "
            f"skew {m['skew']:.3f} (predicted {m['predicted_skew']:.3f})  "
            f"step {m['step_ms'] / 1e3:.2f} s  plan wait {m['planner_wait_ms']:.0f} ms")
    for name, c in m.get("compare", {}).items():
        line += f"  | {name}: skew {c['skew']:.3f} (predicted {c['predicted_skew']:.3f})"
    return line


def balance_report(records: Sequence[dict[str, Any]]) -> str:
    """Per-rank predicted vs measured ms summed over steps, and median skews, for each executed policy."""
    if not records:
        return "no steps"
    lines = []
    runs = [(records[0].get("policy", "plan"), records)]
    for name in records[0].get("compare", {}):
        runs.append((name, [r["compare"][name] for r in records if name in r.get("compare", {})]))
    for name, recs in runs:
        meas = np.sum([r["compute_ms"] for r in recs], axis=0)
        pred = np.sum([r["predicted_ms"] for r in recs], axis=0)
        lines.append(f"{name}: {len(recs)} steps; per-rank compute summed over steps")
        lines.append("  rank   predicted ms   measured ms   measured/predicted")
        for r, (p, m) in enumerate(zip(pred, meas)):
            lines.append(f"  {r:4d}   {p:12.1f}   {m:11.1f}   {m / p if p else float('nan'):18.3f}")
        sk = [r["skew"] for r in recs]
        ps = [r["predicted_skew"] for r in recs]
        lines.append(f"  skew max/mean per step: median {np.median(sk):.3f} (predicted {np.median(ps):.3f}), "
                     f"worst {max(sk):.3f}; bubble median {np.median([r['measured_bubble'] for r in recs]):.3f}")
    return "\n".join(lines)
