"""FlexSP's planning core (papers/flexsp.md): the sequence blaster's microbatches, each balanced by groups of
power-of-two SP degrees (greedy, then the bucketed MILP where its bound leaves room), assembled for contract 2.

The policy :mod:`balanced_loader.planning.policies.flexsp` reads its options and calls
:func:`plan_microbatches`; hydra's portfolio calls it without MILPs (FlexSP's blaster as one more candidate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balanced_loader.cost import ShapeCost, allowed_degrees
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.solvers.blaster import chunk_cuts
from balanced_loader.planning.solvers.sp_groups import (
    GroupChoice,
    SpGroup,
    greedy_homogeneous,
    makespan_lower_bound,
    place_lanes,
    rebalance_single_lanes,
    segment_table,
)
from balanced_loader.planning.solvers.sp_milp import solve_microbatch
from balanced_loader.simulate import placed_pool_ms
from balanced_loader.strict import check_keys, check_number

_DEFAULTS = {"min_degree": 1, "num_m": 5, "node_limit": 50, "rel_gap": 0.002, "buckets": 16, "max_solves": 12,
             "exact_vars": 64, "bisect_steps": 6, "bisect_tol": 0.005}


@dataclass(frozen=True, kw_only=True, slots=True)
class FlexSPOptions:
    min_degree: int
    num_m: int
    node_limit: int
    rel_gap: float
    buckets: int
    max_solves: int
    exact_vars: int
    bisect_steps: int
    bisect_tol: float
    time_limit_s: float

    @staticmethod
    def from_config(config: PlanConfig) -> FlexSPOptions:
        check_keys(config.extra, (*_DEFAULTS, "length_histogram"), "policy 'flexsp'", word="option")
        kw = {k: config.extra.get(k, v) for k, v in _DEFAULTS.items()}
        for k, v in kw.items():
            low = 1 if k in ("min_degree", "num_m", "node_limit", "buckets") else 0
            kw[k] = check_number(v, f"policy 'flexsp': option '{k}'", integer=k not in ("rel_gap", "bisect_tol"),
                                 minimum=low)
        if kw["min_degree"] & (kw["min_degree"] - 1):
            raise ValueError(f"policy 'flexsp': min_degree must be a power of two, got {kw['min_degree']}")
        if config.time_limit_s <= 0:
            raise ValueError(f"policy 'flexsp': time_limit_s must be > 0, got {config.time_limit_s}")
        return FlexSPOptions(min_degree=int(kw["min_degree"]), num_m=int(kw["num_m"]),
                             node_limit=int(kw["node_limit"]), rel_gap=float(kw["rel_gap"]),
                             buckets=int(kw["buckets"]), max_solves=int(kw["max_solves"]),
                             exact_vars=int(kw["exact_vars"]), bisect_steps=int(kw["bisect_steps"]),
                             bisect_tol=float(kw["bisect_tol"]),
                             time_limit_s=float(config.time_limit_s))


@dataclass(kw_only=True, slots=True)
class _Chunk:
    docs: np.ndarray  # [k] item indices, longest first
    seg: np.ndarray  # [num_degrees, k] segment times
    choice: GroupChoice  # best by the microbatch's own makespan
    greedy: GroupChoice  # the homogeneous greedy plan
    lower: float  # makespan lower bound


def _chunk_capacity(longest: int, cap: int, num_lanes: int, degrees: list[int]) -> int:
    """Most tokens a homogeneous plan holds when a chunk's longest doc has ``longest`` tokens.

    ``num_lanes * cap`` for a power-of-two pool; less otherwise (``num_lanes // d`` groups of a
    degree ``d`` leave ``num_lanes % d`` lanes idle).
    """
    return max(((num_lanes // d) * d * cap for d in degrees if longest <= cap * d), default=0)


def _first_m(lengths_desc: np.ndarray, cap: int, num_lanes: int, degrees: list[int]) -> int:
    """Fewest contiguous chunks of the longest-first lengths whose token sums a homogeneous plan holds."""
    prefix = np.concatenate([[0], np.cumsum(lengths_desc)])  # [n + 1]
    m = max(1, -(-int(prefix[-1]) // (num_lanes * cap)))
    while m < len(lengths_desc):
        cuts = chunk_cuts(lengths_desc, m)
        sums = np.diff(prefix[cuts])  # [m] tokens per chunk
        if all(int(t) <= _chunk_capacity(int(lengths_desc[a]), cap, num_lanes, degrees)
               for t, a in zip(sums, cuts[:-1])):
            break
        m += 1
    return m


def _greedy_chunks(lengths: np.ndarray, order: np.ndarray, m: int, sc: ShapeCost, num_lanes: int,
                   degrees: list[int]) -> list[_Chunk] | None:
    """The ``m`` blaster chunks with their greedy plans and bounds; ``None`` when the greedy fill
    finds no homogeneous plan for some chunk."""
    cuts = chunk_cuts(lengths[order], m)
    chunks = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        docs = order[a:b]
        seg = segment_table(lengths[docs], sc, degrees)
        choice = greedy_homogeneous(lengths[docs], sc, num_lanes, degrees, seg)
        if choice is None:
            return None
        lower = makespan_lower_bound(lengths[docs], sc, num_lanes, degrees, seg)
        chunks.append(_Chunk(docs=docs, seg=seg, choice=choice, greedy=choice, lower=lower))
    return chunks


def pool_time(microbatches: list[tuple[SpGroup, ...]], lanes: list[list[tuple[int, ...]]],
              num_lanes: int, pp: int) -> float:
    """Contract-2 pool time of placed groups (:func:`balanced_loader.simulate.placed_pool_ms`)."""
    groups = [(g, ln) for gs, placed in zip(microbatches, lanes) for g, ln in zip(gs, placed)]  # execution order
    return placed_pool_ms([ln for _, ln in groups], [g.ms for g, _ in groups], pp, num_lanes)


def plan_microbatches(lengths: np.ndarray, sc: ShapeCost, num_lanes: int, opts: FlexSPOptions,
                      pp: int = 1, max_degree: int | None = None
                      ) -> tuple[list[tuple[SpGroup, ...]], list[list[tuple[int, ...]]], list[str]]:
    """The blaster and per-microbatch planning over item ``lengths`` ``[n]`` (SP degrees up to
    ``max_degree``, default ``num_lanes``).

    Returns the microbatches (groups with item indices), their lane blocks and notes.
    """
    degrees = [d for d in allowed_degrees(num_lanes, min_degree=opts.min_degree)
               if max_degree is None or d <= max_degree]
    cap = sc.max_tokens_per_lane
    n = len(lengths)
    order = np.lexsort((np.arange(n), -lengths)).astype(np.int64)  # [n] longest first
    ldesc = lengths[order]
    notes: list[str] = []
    plans: dict[int, list[_Chunk]] = {}
    # num_m values of M from the first whose chunks all have a greedy plan (M = n always does: every
    # doc fits the largest degree); an M whose greedy fill fails is skipped
    m, last = _first_m(ldesc, cap, num_lanes, degrees), n
    while m <= last:
        chunks = _greedy_chunks(lengths, order, m, sc, num_lanes, degrees)
        if chunks is not None:
            if not plans:
                last = min(n, m + opts.num_m - 1)
            plans[m] = chunks
        m += 1
    # MILPs where they can still matter: M by greedy total, skipped once its lower bound loses
    best_sum = min(sum(c.choice.makespan for c in ch) for ch in plans.values())
    budget = opts.max_solves
    for m in sorted(plans, key=lambda k: (sum(c.choice.makespan for c in plans[k]), k)):
        chunks = plans[m]
        if sum(c.lower for c in chunks) >= best_sum * (1 - opts.rel_gap):
            continue
        for k, ch in enumerate(chunks):
            if ch.lower >= ch.choice.makespan * (1 - opts.rel_gap) or len(ch.docs) < 2:
                continue
            if budget <= 0:
                notes.append(f"flexsp: budget of {opts.max_solves} MILP solves used up; "
                             f"M={m}, microbatch {k} keeps its greedy plan")
                break
            out = solve_microbatch(lengths[ch.docs], sc, num_lanes, degrees, ch.choice, ch.lower,
                                   time_limit_s=opts.time_limit_s, node_limit=opts.node_limit,
                                   rel_gap=opts.rel_gap, q0=opts.buckets, exact_vars=opts.exact_vars,
                                   bisect_steps=min(opts.bisect_steps, budget), bisect_tol=opts.bisect_tol,
                                   seg=ch.seg)
            budget -= out.solves
            if out.time_limit_hits:
                notes.append(f"flexsp: MILP time limit {opts.time_limit_s:g}s hit {out.time_limit_hits}x "
                             f"(M={m}, microbatch {k}); this plan depends on machine speed")
            for f in sorted(set(out.failures)):
                notes.append(f"flexsp: {f} (M={m}, microbatch {k}); greedy plan kept where it failed")
            ch.choice = out.choice
        best_sum = min(best_sum, sum(c.choice.makespan for c in chunks))
    # contract 2 lets lanes run ahead across microbatches, so the fastest plan by the microbatches' own
    # makespans is not always the fastest step: compare both chunk variants, both orders, with and
    # without re-dealing 1-lane groups by lane finish times
    best: tuple[float, list[tuple[SpGroup, ...]], list[list[tuple[int, ...]]]] | None = None
    for m in sorted(plans):
        variants = {id(c.choice) for c in plans[m]} != {id(c.greedy) for c in plans[m]}
        for use in ("choice", "greedy")[: 1 + variants]:
            base = [tuple(SpGroup(degree=g.degree, docs=tuple(int(c.docs[i]) for i in g.docs), ms=g.ms)
                          for g in getattr(c, use).groups) for c in plans[m]]
            for order_ in (base, base[::-1]):
                placed = place_lanes(order_, num_lanes, pp)
                for mbs, lanes in ((order_, placed),
                                   rebalance_single_lanes(order_, placed, lengths, sc, num_lanes, pp),
                                   rebalance_single_lanes(order_, placed, lengths, sc, num_lanes, pp, passes=2)):
                    t = pool_time(mbs, lanes, num_lanes, pp)
                    if best is None or t < best[0] - 1e-9:
                        best = (t, mbs, lanes)
    assert best is not None
    return best[1], best[2], notes
