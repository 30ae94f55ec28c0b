"""A regime sweep of the planners: every policy on the same batches over corpora x cost models x worlds x contexts.

A **cell** is (corpus, cost model, world, context). Its batches are the loader's
(:func:`~balanced_loader.batches.stream.global_batches`, shuffled, seeded) with
``max_seq_len = min(context, the longest segment the default policy holds on that world)``
and a token budget of ``lanes x max_tokens_per_lane x passes`` (one pool, ``tp = pp = 1``). A cell is kept
only where it differs from the smaller context before it: the corpus has a doc longer than that context and
the world holds a longer segment (else it repeats that cell). Each policy plans every batch
(:func:`~balanced_loader.planning.make_plan`); the cell's figure of a policy is its summed contract-2 step time,
compared with the best other policy and with two summed lower bounds
(:func:`~balanced_loader.planning.solvers.bound.step_lower_bound` over the shapes ``(tp, 1)`` of the cost file,
``tp = 1, 2, 4, ..``: the default policy plans one pool of one of them): ``bound_ms``, below every plan on
those shapes (groups of any lanes, as contract 1 allows), and ``bound_pow2_ms``, the least over those shapes of
the bound of one pool of that shape whose groups have power-of-two degrees, the only plans the default policy
makes (aligned blocks; ``tests/balanced_loader/planning/test_bound.py`` checks every policy against it).
``tools/sweep_planner.py`` runs the grid and draws the heat map.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from balanced_loader.batches.stream import global_batches
from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems
from balanced_loader.planning import longest_segment, make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.solvers.bound import step_lower_bound

DEFAULT_POLICY = PlanConfig.__dataclass_fields__["policy"].default
POLICIES = ("hydra", "maxlen", "static-sp", "token-kk", "mcore-dcp", "batch-ada", "greedy", "flexsp", "hydraulis")


@dataclass(frozen=True, kw_only=True, slots=True)
class Cell:
    corpus: str
    cost: str
    world: int
    context: int  # the context asked for
    max_seq_len: int  # the sequences' limit: the context, or the longest segment the world holds

    @property
    def key(self) -> str:
        return f"{self.corpus}/{self.cost}/{self.world}/{self.context // 1024}K"


@dataclass(kw_only=True, slots=True)
class CellResult:
    cell: Cell
    batches: list[int]  # [batches] sequences per batch
    bound_ms: float  # summed over the batches: below every plan
    bound_pow2_ms: float = 0.0  # summed: below every plan of power-of-two groups (every policy's)
    ms: dict[str, float | None] = field(default_factory=dict)  # policy -> summed step ms (None: cannot plan)
    plan_s: dict[str, float] = field(default_factory=dict)  # policy -> summed planning seconds
    notes: dict[str, list[str]] = field(default_factory=dict)  # policy -> notes of its plans
    errors: dict[str, str] = field(default_factory=dict)  # policy -> why it could not plan
    stats: dict[str, float] = field(default_factory=dict)

    def best_other(self, policy: str = DEFAULT_POLICY) -> tuple[str, float] | None:
        others = [(v, k) for k, v in self.ms.items() if k != policy and v is not None]
        if not others:
            return None
        v, k = min(others)
        return k, v

    def to_json(self) -> dict:
        c = self.cell
        return {"corpus": c.corpus, "cost": c.cost, "world": c.world, "context": c.context,
                "max_seq_len": c.max_seq_len, "batches": self.batches, "bound_ms": self.bound_ms,
                "bound_pow2_ms": self.bound_pow2_ms, "ms": self.ms,
                "plan_s": self.plan_s, "notes": self.notes, "errors": self.errors, "stats": self.stats}

    @staticmethod
    def from_json(d: dict) -> CellResult:
        cell = Cell(corpus=d["corpus"], cost=d["cost"], world=d["world"], context=d["context"],
                    max_seq_len=d["max_seq_len"])
        return CellResult(cell=cell, batches=d["batches"], bound_ms=d["bound_ms"],
                          bound_pow2_ms=d.get("bound_pow2_ms", 0.0), ms=d["ms"], plan_s=d["plan_s"],
                          notes=d.get("notes", {}), errors=d.get("errors", {}), stats=d.get("stats", {}))


def cells(corpus: str, lengths: np.ndarray, cost_name: str, cost: CostModel, worlds: Sequence[int],
          contexts: Sequence[int]) -> list[Cell]:
    """The distinct cells of one corpus and cost model (see the module docstring)."""
    longest = int(lengths.max())
    out = []
    for w in worlds:
        holds = longest_segment(cost, PlanConfig(policy=DEFAULT_POLICY, world_size=w))
        if holds <= 0:  # the pool's shape is unusable on this world (e.g. the model does not fit)
            continue
        prev_ctx, prev_len = 0, 0
        for ctx in sorted(contexts):
            m = min(ctx, holds)
            if prev_ctx and (longest <= prev_ctx or m == prev_len):
                continue  # the same sequences as the smaller context's cell
            out.append(Cell(corpus=corpus, cost=cost_name, world=w, context=ctx, max_seq_len=m))
            prev_ctx, prev_len = ctx, m
    return out


def batch_stats(batches: Sequence[np.ndarray], cost: CostModel, lanes: int) -> dict[str, float]:
    """What describes a cell's regime: sequences per lane, the share of work in sequences above the lane cap,
    the fixed cost per pass against the work of a full lane pass."""
    sc = cost.shape(1, 1)
    s = np.concatenate(batches).astype(np.float64)
    work = np.asarray(sc.compute_ms(s))
    full = float(sc.compute_ms(float(sc.max_tokens_per_lane)))
    return {"seq_per_lane": len(s) / len(batches) / lanes,
            "wide_work": float(work[s > sc.max_tokens_per_lane].sum() / max(work.sum(), 1e-12)),
            "beta_share": float(sc.microbatch_ms / (sc.microbatch_ms + full)),
            "quad_share": float(sc.quadratic_ms * sc.max_tokens_per_lane ** 2 / max(full, 1e-12))}


def cell_batches(cell: Cell, lengths: np.ndarray, cost: CostModel, *, count: int = 2, passes: int = 4,
                 seed: int = 0) -> list[np.ndarray]:
    """The cell's batches: sequences of at most ``max_seq_len``, ``lanes x max_tokens_per_lane x passes`` tokens."""
    budget = cell.world * cost.shape(1, 1).max_tokens_per_lane * passes
    batches, _ = global_batches(lengths, max_seq_len=cell.max_seq_len, global_batch_tokens=budget, shuffle=True,
                                seed=seed, max_steps=count)
    return [b.lengths for b in batches]


def cell_bounds(batches: Sequence[np.ndarray], cost: CostModel, lanes: int) -> tuple[float, float]:
    """``(bound_ms, bound_pow2_ms)`` summed over the batches (module docstring); ``lanes`` is the world."""
    tps = sorted({sc.tp for sc in cost.shapes() if sc.pp == 1 and lanes % sc.tp == 0})
    shapes = [(tp, 1) for tp in tps]

    def pow2(b: np.ndarray) -> float:  # one pool of one shape, power-of-two groups: the least over the shapes
        return min(step_lower_bound(b, cost, lanes, [s], degrees=[1 << v for v in range((lanes // s[0]).bit_length())]
                                    ).bound_ms for s in shapes)

    return (sum(step_lower_bound(b, cost, lanes, shapes).bound_ms for b in batches), sum(pow2(b) for b in batches))


def run_cell(cell: Cell, lengths: np.ndarray, cost: CostModel, policies: Sequence[str], *, count: int = 2,
             passes: int = 4, seed: int = 0, skip: Sequence[str] = ()) -> CellResult:
    """Every policy of ``policies`` (less ``skip``) on the cell's ``count`` batches."""
    lanes = cell.world
    batches = cell_batches(cell, lengths, cost, count=count, passes=passes, seed=seed)
    bound, bound_pow2 = cell_bounds(batches, cost, lanes)
    res = CellResult(cell=cell, batches=[len(b) for b in batches], bound_ms=bound, bound_pow2_ms=bound_pow2,
                     stats=batch_stats(batches, cost, lanes))
    for pol in policies:
        if pol in skip:
            continue
        cfg = PlanConfig(policy=pol, world_size=cell.world)
        total, secs, notes = 0.0, 0.0, []
        try:
            for k, b in enumerate(batches):
                t0 = time.perf_counter()
                plan = make_plan(BatchItems.from_lengths(b), cost, cfg, k)
                secs += time.perf_counter() - t0
                total += plan.predicted_ms
                notes.extend(plan.notes)
        except ValueError as e:
            res.ms[pol] = None
            res.errors[pol] = str(e)
            continue
        res.ms[pol] = total
        res.plan_s[pol] = secs
        if notes:
            res.notes[pol] = sorted(set(notes))
    return res


def summary(results: Sequence[CellResult], policy: str = DEFAULT_POLICY, *, slack: float = 1.005,
            bound_slack: float = 1.03, pow2: bool = True) -> dict[str, object]:
    """The acceptance figures of a grid: cells where ``policy`` is behind the best other by more than ``slack``,
    and the share of cells within ``bound_slack`` of the bound (``pow2``: the bound of power-of-two groups),
    with the worst of each."""
    rows = [r for r in results if r.ms.get(policy) is not None]
    behind, vs_bound = [], []
    for r in rows:
        mine = r.ms[policy]
        other = r.best_other(policy)
        if other is not None:
            behind.append((mine / other[1], r.cell.key, other[0]))
        bound = r.bound_pow2_ms if pow2 else r.bound_ms
        if bound > 0:
            vs_bound.append((mine / bound, r.cell.key))
    losing = sorted(x for x in behind if x[0] > slack)
    within = sum(1 for x in vs_bound if x[0] <= bound_slack)
    return {"cells": len(rows), "behind": len(losing), "worst_vs_best_other": max(behind, default=None),
            "losing": losing[::-1], "within_bound": within, "share_within_bound": within / max(len(vs_bound), 1),
            "worst_vs_bound": max(vs_bound, default=None)}
