"""Plan the same global batches with several policies and compare them under one cost model.

Batching follows contract 3 and the loader: docs in file order (or shuffled by seed for
epoch 0), empty docs skipped, docs longer than ``max_seq_len`` handled by ``long_docs``,
global batches of sequences, at most ``global_batch_tokens`` tokens each (the whole file is
one batch without a budget). Every policy plans exactly the same batches; every plan is
validated against the batch before it is simulated (:mod:`balanced_loader.simulate`).

The speedup of a policy is ``total modeled time of the first policy / its total modeled time``
over the compared steps. ``vs_bound`` is its total modeled time over the summed lower bounds of
the steps (:mod:`balanced_loader.planning.solvers.bound`, over every usable shape of the cost model).
Barrier waits (contract 1 ``barriers``, e.g. mcore-dcp's rounds) are part of every time and bubble.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from balanced_loader.cli.options import si_units
from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems
from balanced_loader.planning import get_policy, make_plan, warm_up
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.solvers.bound import StepBound, step_lower_bound
from balanced_loader.simulate import StepMetrics, simulate_step, summarize

if TYPE_CHECKING:
    from balanced_loader.plan import StepPlan
    from balanced_loader.presets import Hardware, ModelShape

COMPARE_FORMAT = "balanced-loader/compare"


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyRun:
    policy: str
    config: PlanConfig
    metrics: tuple[StepMetrics, ...]
    summary: dict[str, float]
    speedup: float  # over the first policy

    def to_json(self, *, per_rank_step: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"policy": self.policy, "speedup": self.speedup, "summary": self.summary,
                             "steps": [m.to_json() for m in self.metrics]}
        if per_rank_step is not None and per_rank_step < len(self.metrics):
            d["rank_busy_ms"] = {"step": per_rank_step,
                                 "ms": [round(float(x), 3) for x in self.metrics[per_rank_step].rank_busy_ms]}
        return d


def check_policies(names: Sequence[str]) -> list[str]:
    """The policy names, each available (one ValueError line otherwise)."""
    out = [n.strip() for n in names if n.strip()]
    if not out:
        raise ValueError("--policies needs at least one policy name, e.g. --policies maxlen,hydra")
    dup = sorted({n for n in out if out.count(n) > 1})
    if dup:
        raise ValueError(f"policy listed twice: {', '.join(dup)}")
    for n in out:
        get_policy(n)
    return out


def compare_policies(batches: Sequence[BatchItems], cost: CostModel,
                     configs: Sequence[PlanConfig], *, model: ModelShape | None = None,
                     hardware: Hardware | None = None, validate: bool = True,
                     progress: Callable[[int], None] | None = None,
                     keep_plans: bool = False, bound: bool = True
                     ) -> tuple[list[PolicyRun], dict[str, list[StepPlan]]]:
    """Plan every batch with every config, validate, simulate; with ``bound``, each run's summary
    also holds ``bound_ms`` (mean lower bound per step) and ``vs_bound`` (total time / total bound).

    Validation checks that each plan tiles exactly its batch's sequences.
    """
    warm_up(batches, cost, configs)
    per: dict[str, list[StepMetrics]] = {c.policy: [] for c in configs}
    plans: dict[str, list[StepPlan]] = {c.policy: [] for c in configs}
    bounds: list[StepBound] = []
    for step, items in enumerate(batches):
        if bound and cost.uniform:  # the bound knows alike lanes only (no device classes or lane speeds)
            bounds.append(step_lower_bound(items.lengths, cost, configs[0].world_size if configs else 1))
        for c in configs:
            try:
                plan = make_plan(items, cost, c, step)
                if validate:
                    plan.validate(items, cost)
            except ValueError as e:
                raise ValueError(f"policy '{c.policy}', step {step}: {e}") from None
            per[c.policy].append(simulate_step(plan, cost, model=model, hardware=hardware))
            if keep_plans:
                plans[c.policy].append(plan)
        if progress is not None:
            progress(1)
    runs = []
    base_total = None
    for c in configs:
        s = summarize(per[c.policy])
        if bounds:
            total_bound = sum(b.bound_ms for b in bounds)
            s["bound_ms"] = total_bound / len(bounds)
            s["vs_bound"] = s["total_ms"] / total_bound if total_bound > 0 else float("nan")
        if base_total is None:
            base_total = s["total_ms"]
        speedup = base_total / s["total_ms"] if s["total_ms"] > 0 else float("nan")
        runs.append(PolicyRun(policy=c.policy, config=c, metrics=tuple(per[c.policy]), summary=s, speedup=speedup))
    return runs, plans


def format_table(runs: Sequence[PolicyRun]) -> str:
    has_mfu = any("mfu" in r.summary for r in runs)
    has_bound = any("vs_bound" in r.summary for r in runs)
    has_barrier = any(r.summary.get("barrier_idle", 0.0) > 0 for r in runs)
    w = max([len(r.policy) for r in runs] + [6])
    head = (f"{'policy':<{w}} {'step_ms':>11} {'speedup':>8} {'skew':>6} {'pp_bubble':>9} {'dp_bubble':>9} "
            f"{'idle':>7} {'tokens/s':>9} {'plan_ms':>9}")
    head += f" {'barrier':>7}" if has_barrier else ""
    head += f" {'/bound':>7}" if has_bound else ""
    head += f" {'MFU':>6}" if has_mfu else ""
    lines = [head]
    first = runs[0].policy if runs else ""
    for r in runs:
        s = r.summary
        row = (f"{r.policy:<{w}} {s['mean_step_ms']:>11.1f} {r.speedup:>7.2f}x {s['skew']:>6.2f} "
               f"{s['pp_bubble']:>9.1%} {s['dp_bubble']:>9.1%} {s['idle']:>7.1%} {si_units(s['tokens_per_s']):>9} "
               f"{s['mean_plan_ms']:>9.1f}")
        if has_barrier:
            row += f" {s.get('barrier_idle', 0.0):>7.1%}"
        if has_bound:
            row += f" {s['vs_bound']:>6.3f}x" if "vs_bound" in s else f" {'-':>7}"
        if has_mfu:
            row += f" {s['mfu']:>6.1%}" if "mfu" in s else f" {'-':>6}"
        lines.append(row)
        if "classes" in s:  # a cluster cost model: how busy each device class's ranks were
            lines.append(f"{'':<{w}}   " + "; ".join(f"class {n}: busy {c['busy_share']:.1%}, skew {c['skew']:.2f}"
                                                    for n, c in s["classes"].items()))
    lines.append(f"means over steps; speedup = total modeled time of '{first}' / the policy's; skew = max/mean "
                 "rank busy time; plan_ms = planning time per step"
                 + ("; barrier = rank time waiting at the plan's barriers (part of idle)" if has_barrier else "")
                 + ("; /bound = total time / total step-time lower bound" if has_bound else ""))
    return "\n".join(lines)
