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
* **memory**: each rank's peak (`training/peaks.py`) and its parts, saved activations counted by
  :class:`SavedActivations` (keys in docs/runtime.md, "Memory report").
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from balanced_loader.cost import CostModel
from balanced_loader.outputs.files import write_text
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


def plan_row(plan: StepPlan) -> dict[str, Any]:
    """A step record's keys of its plan: tokens, docs, fingerprint and :func:`plan_shape`."""
    shape = plan_shape(plan)
    return {"tokens": plan.tokens, "docs": int(len(plan.doc_ids())), "fingerprint": plan.fingerprint(), **shape}


def median_error(pred: Sequence[float] | np.ndarray, meas: Sequence[float] | np.ndarray) -> float:
    """Median over ranks that measured something of ``|predicted - measured| / measured`` (totals when the
    two differ in length: a one-process reference run measures the whole plan at once)."""
    p, m = np.asarray(pred, dtype=np.float64), np.asarray(meas, dtype=np.float64)
    if p.shape != m.shape:
        p, m = p.sum(keepdims=True), m.sum(keepdims=True)
    ok = m > 0
    return float(np.median(np.abs(p[ok] - m[ok]) / m[ok])) if ok.any() else 0.0


def step_balance(plan: StepPlan, cost: CostModel, compute_ms: Sequence[float], wall_ms: Sequence[float],
            busy_wall_ms: Sequence[float]) -> dict[str, Any]:
    """Predicted and measured balance of one executed plan with the cost model that planned it (keys as in
    ``metrics.jsonl``, docs/runtime.md): the contention-free part (the cost file's coefficients against
    compute time) and the part with lane speeds (against the wall time of the same compute)."""
    sim = simulate_step(plan, cost)
    pred, step_ms = sim.rank_busy_ms, sim.step_ms
    device = pred if not cost.lane_speed else simulate_step(plan, cost.replace(lane_speed=())).rank_busy_ms
    comp, busy, wall = (np.asarray(x, dtype=np.float64) for x in (compute_ms, busy_wall_ms, wall_ms))
    out = {
        "compute_ms": [round(float(x), 3) for x in comp],
        "busy_wall_ms": [round(float(x), 3) for x in busy],
        "predicted_ms": [round(float(x), 3) for x in pred],
        "predicted_step_ms": round(step_ms, 3),
        "skew": round(skew(comp), 4),
        "wall_skew": round(skew(busy), 4),
        "predicted_skew": round(skew(pred), 4),
        "bubble": round(bubble(pred, step_ms), 4),
        # idle that means what it says: the share of the step ranks spent outside their compute blocks
        # (waiting for peers, pipeline neighbours, barriers); time-slicing of shared cores is 'contention'
        "measured_bubble": round(bubble(busy, float(wall.max(initial=0.0))), 4),
        "contention": round(1.0 - float(comp.sum()) / float(busy.sum()), 4) if busy.sum() > 0 else 0.0,
        "model_error": round(median_error(device, comp), 4),
        "wall_error": round(median_error(pred, busy), 4),
    }
    if cost.lane_speed:
        out["speeds"] = [round(float(v), 4) for v in cost.rank_speeds(plan.world_size)]
    return out


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
        write_text(self.path, "".join(json.dumps(line) + "\n" for line in records if line["step"] < step))

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
                     f"worst {max(sk):.3f}; waiting for peers median "
                     f"{np.median([r['measured_bubble'] for r in recs]):.3f}, core sharing median "
                     f"{np.median([r.get('contention', 0.0) for r in recs]):.3f}")
    return "\n".join(lines)


# ---- memory ----------------------------------------------------------------------------------


class SavedActivations:
    """Peak bytes of tensors autograd keeps for backward while active (``torch.autograd.graph.saved_tensors_hooks``).

    Counted once per storage (views of one tensor share it); parameters' storages are left out.
    Under ``train.recompute`` the blocks' insides are saved by the checkpoint's own hooks and not
    seen here: what counts is what stays between forward and backward (block inputs, embedding, head).
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.current = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.exclude or st.nbytes() == 0 or t.device.type == "meta":
            return t
        ref = self.live.get(key)
        if ref is None:
            self.live[key] = [1, st.nbytes()]
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            ref[0] += 1
        return _Held(t, key, self)

    def release(self, key: int) -> None:
        ref = self.live[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.current -= ref[1]
            del self.live[key]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)


class _Held:
    """A saved tensor and its count: released when autograd drops it (after backward, or with the graph)."""

    __slots__ = ("t", "key", "owner")

    def __init__(self, t: torch.Tensor, key: int, owner: SavedActivations) -> None:
        self.t, self.key, self.owner = t, key, owner

    def __del__(self) -> None:
        self.owner.release(self.key)


def _unpack(x: Any) -> torch.Tensor:
    return x.t if isinstance(x, _Held) else x


def gather_rows(values: Sequence[float], comm_device: torch.device) -> np.ndarray:
    """``[world, len(values)]`` float64: every rank's ``values`` (collective: one all-gather)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=comm_device)
    every = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return torch.stack(every).cpu().numpy()


def gather_values(mine: dict[str, int], comm_device: torch.device | None) -> dict[str, list[int]]:
    """Every rank's integer figures by key (``[world]`` lists; collective unless ``comm_device`` is None)."""
    names = list(mine)
    if comm_device is None:
        return {n: [int(mine[n])] for n in names}
    rows = gather_rows([mine[n] for n in names], comm_device)  # [world, keys]
    return {n: [int(v) for v in rows[:, i]] for i, n in enumerate(names)}


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def peak_rss_mb() -> float:
    """Peak resident set of this process so far, MiB (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
