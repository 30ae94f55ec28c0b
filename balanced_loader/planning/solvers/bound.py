"""A lower bound on the contract-2 step time of every plan of a batch (``compare`` reports plans
against it).

All terms hold for any plan that keeps each item one segment (every policy does):

* **area**: rank-time. A group of degree ``d`` on shape ``(tp, pp)`` holds ``d * tp * pp`` ranks
  for ``t(g) / pp``. Each doc costs at least ``tp * (d * seg(s, d) + beta * s / cap)`` rank-ms at
  its cheapest shape and degree that holds it (``s <= d * cap``, ``d <=`` lanes): a lane-slot of
  a group holds at most ``cap`` tokens, so each ``beta`` covers at most ``d * cap`` tokens.
  Divided by ``W`` ranks (pipeline fill is not counted).
* **longest**: a pool's time is at least any of its groups' whole time, so at least the doc
  whose cheapest group alone (``beta + seg(s, d)``) takes longest.
* **passes** (one shape only, an LP relaxation): a lane running ``g`` groups holds at most
  ``g * cap`` tokens and has ``pp * T - g * beta`` ms left for work. Lanes are split into classes
  ``g = 0, 1, ..`` (fractional counts ``x_g``, summing to the lanes) and docs (fractionally) into
  classes, each class within its token and time capacity; the least ``T`` for which this LP is
  feasible (bisection, HiGHS) is a bound. Unlike the area term it charges the ``beta`` of a
  second pass to the lanes that need one. Docs are merged into at most ``BUCKETS`` density
  buckets, each at its lowest work per token, and the lanes with ``g >= CLASSES`` groups into one
  class without a token limit (further relaxations, so still a bound).
* **widths** (dual feasible functions, :func:`widths_bound`): groups that are wide leave lanes no
  other group can use (two docs that each need 6 of 8 lanes never run side by side), which the area
  term does not see. A function ``u`` on ``[0, 1]`` with ``sum u(x_i) <= 1`` whenever ``sum x_i <= 1``
  (a *dual feasible function*, Fekete and Schepers) turns the widths ``x = ranks / W`` of the groups
  running at any instant into weights summing to at most 1, so ``sum_g u(x_g) t(g) / pp`` is at most
  the last lane's finish. Each doc adds at least ``min_d u(x_d) (seg(s, d) + beta s / (d cap)) / pp``
  over the shapes and degrees that hold it (any number of lanes: contract 1 allows any group). With
  ``u = (1 - lam) x + lam u_k(x)``, ``u_k(x) = floor((k + 1) x) / k`` (``x`` where ``(k + 1) x`` is an
  integer), the largest over ``k`` and ``lam`` is a bound; ``u(x) = x`` is the area term again.
* **anchors** (one shape only, :func:`anchors_bound`): the area term charges ``beta`` per ``cap`` tokens, as
  if every group were full. Within a group the docs' fractions of its tokens pass through a dual feasible
  function, so a doc more than half its group runs alone (two of a third share one, ...): ``beta`` times the
  groups' lanes is at least the docs' weighted degrees, which is more than ``tokens / cap`` where equal long docs
  leave every group part empty (32K docs on lanes of 5,950 tokens: a group of 8 lanes each). Joined with each
  doc's least lane-ms over the degrees by a multiplier (weak duality: every multiplier gives a bound). The
  function may differ per degree (each group's docs pass through its own degree's), so a long doc runs alone
  in its wide group while the short docs of one-lane passes still pay ``beta`` per ``cap`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost

BUCKETS = 128  # density buckets of the passes LP
CLASSES = 6  # lane classes g = 1 .. CLASSES - 1 exactly; the last one stands for every g >= CLASSES
REL_TOL = 1e-3  # bisection stops when the bracket is this tight (the lower end is returned)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBound:
    area_ms: float
    longest_ms: float
    passes_ms: float = 0.0  # 0 when not computed (several shapes, or no fixed cost)
    widths_ms: float = 0.0  # the dual-feasible-function term (0 when no doc needs several lanes)
    anchors_ms: float = 0.0  # the groups-of-their-own term (0 when not computed: several shapes)

    @property
    def bound_ms(self) -> float:
        return max(self.area_ms, self.longest_ms, self.passes_ms, self.widths_ms, self.anchors_ms)

    def to_json(self) -> dict[str, float]:
        return {"bound_ms": self.bound_ms, "area_ms": self.area_ms, "longest_ms": self.longest_ms,
                "passes_ms": self.passes_ms, "widths_ms": self.widths_ms, "anchors_ms": self.anchors_ms}


def cheapest(sc: ShapeCost, s: np.ndarray, lanes: int, degrees: Sequence[int] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """``([n] lane-ms, [n] ms)``: each doc's least ``d * seg(s, d)`` and least ``seg(s, d)`` over the
    degrees ``d <= lanes`` that hold it (``s <= d * cap``; ``inf`` where none does), ``d`` in
    ``degrees`` when given (then every one of them is tried).

    ``bw(d)`` is constant between bandwidth keys, where ``d * seg`` is constant (least at the lowest
    feasible ``d``) and ``seg`` falls (least at the interval's top): so the keys, the keys minus one,
    1, 2 and ``lanes``, each as is and raised to the memory-fit degree, hold both minima.
    """
    cap = sc.max_tokens_per_lane
    dmin = np.maximum(1, -(-s.astype(np.int64) // cap))  # [n] memory-fit degree
    keys = [k for k, _ in sc.bandwidth_gbs]
    cands = sorted({1, 2, lanes, *keys, *(k - 1 for k in keys)}) if degrees is None else sorted(set(degrees))
    lane_ms = np.full(len(s), np.inf)  # [n]
    group_ms = np.full(len(s), np.inf)  # [n]
    for c in cands:
        # a given degree set is tried as is: a memory-fit degree raised to c may not be in it
        raised = (np.maximum(dmin, c),) if degrees is None else ()
        for d in (np.full(len(s), c, dtype=np.int64), *raised):
            ok = (d <= lanes) & (d >= dmin)
            if not ok.any():
                continue
            dd = d[ok].astype(np.float64)
            seg = np.asarray(sc.segment_ms(s[ok], dd), dtype=np.float64)
            lane_ms[ok] = np.minimum(lane_ms[ok], dd * seg)
            group_ms[ok] = np.minimum(group_ms[ok], seg)
    return lane_ms, group_ms


def _passes_feasible(work: np.ndarray, tokens: np.ndarray, u: float, beta: float, cap: float,
                     lanes: int) -> bool:
    """Is there a fractional split of the buckets (``[k]`` work ms, ``[k]`` tokens) over lane classes
    ``g = 0 .. floor(u / beta)`` (``g`` groups: ``g * cap`` tokens, ``u - g * beta`` ms each)?"""
    from scipy.optimize import linprog  # scipy: loaded only when the bound is asked for

    most = int(u // beta)
    if most < 1:
        return False
    top = min(most, CLASSES)  # class ``top`` < most: every g >= top, no token limit (a relaxation)
    k = len(work)
    nv = k * top + top  # y[b, g-1] then x[g-1] (class 0 is the slack of the lane count)
    a_eq = np.zeros((k, nv))
    for b in range(k):
        a_eq[b, b * top:(b + 1) * top] = 1.0
    rows = []
    for g in range(1, top + 1):
        t = np.zeros(nv)
        t[np.arange(k) * top + g - 1] = work
        t[k * top + g - 1] = -(u - g * beta)
        rows.append(t)
        if g < top or top == most:
            m = np.zeros(nv)
            m[np.arange(k) * top + g - 1] = tokens
            m[k * top + g - 1] = -g * cap
            rows.append(m)
    count = np.zeros(nv)
    count[k * top:] = 1.0
    a_ub = np.vstack([*rows, count])
    b_ub = np.concatenate([np.zeros(len(rows)), [lanes]])
    res = linprog(np.zeros(nv), A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(k), bounds=(0, None),
                  method="highs")
    return res.status == 0


def passes_bound(lane_ms: np.ndarray, s: np.ndarray, sc: ShapeCost, lanes: int, lo: float) -> float:
    """The passes LP's least whole-model lane time ``u`` (ms; at least ``lo``), by bisection."""
    beta, cap = float(sc.microbatch_ms), float(sc.max_tokens_per_lane)
    if beta <= 0 or len(s) == 0:
        return 0.0
    # buckets of similar work per token, each at its least density (less work: still a relaxation)
    order = np.argsort(lane_ms / s)
    parts = np.array_split(order, min(BUCKETS, len(order)))
    tokens = np.asarray([s[p].sum() for p in parts])  # [k]
    work = np.asarray([(lane_ms[p] / s[p]).min() * s[p].sum() for p in parts])  # [k]
    hi = max(lo, beta) * 2
    while not _passes_feasible(work, tokens, hi, beta, cap, lanes):
        lo, hi = hi, hi * 2
    while hi - lo > REL_TOL * hi:
        mid = 0.5 * (lo + hi)
        if _passes_feasible(work, tokens, mid, beta, cap, lanes):
            hi = mid
        else:
            lo = mid
    return lo


KMAX = 64  # the largest k of u_k tried
LAMBDAS = np.linspace(0.0, 1.0, 11)  # [m] mixtures of u_k with the identity


def dff(k: int, d: np.ndarray, lanes: int) -> np.ndarray:
    """Fekete-Schepers ``u_k(d / lanes)`` (``[...]`` float64): ``floor((k + 1) x) / k``, or ``x`` itself where
    ``(k + 1) x`` is an integer; exact integer arithmetic on the degrees ``d`` (any int array)."""
    num = (k + 1) * np.asarray(d, dtype=np.int64)
    return np.where(num % lanes == 0, d / lanes, (num // lanes) / k)


def _width_degrees(c: np.ndarray, lanes: int, ks: Sequence[int], keys: Sequence[int],
                   degrees: Sequence[int] | None) -> np.ndarray:
    """``[n, m]`` the degrees where ``u(d / lanes) * seg`` can be least for each doc (memory-fit degree ``c``
    ``[n]``; entries above ``lanes`` mean none). Between two steps of every ``u_k`` and two bandwidth keys,
    ``u(x) / x`` falls and ``d * seg`` is constant, so the product is least at such a run's last degree: the
    step points and one below, the keys minus one, 1 and ``lanes``, each raised to ``c``. A given degree set is
    taken as is."""
    if degrees is not None:
        cand = np.asarray(sorted({int(d) for d in degrees if 1 <= d <= lanes}), dtype=np.int64)
        return np.where(cand[None, :] >= c[:, None], cand[None, :], lanes + 1)
    pts = {1, lanes, *(k - 1 for k in keys), *keys}
    for k in ks:
        for j in range(1, k + 2):
            q = -(-j * lanes // (k + 1))  # the first degree at or above the j-th step
            pts.update((q - 1, q))
    cand = np.asarray(sorted(p for p in pts if 1 <= p <= lanes), dtype=np.int64)  # [m]
    return np.maximum(cand[None, :], c[:, None])


def widths_bound(s: np.ndarray, scs: Sequence[ShapeCost], world_size: int, rank_ms: np.ndarray,
                 degrees: Sequence[int] | None = None) -> float:
    """The widths term (module docstring): the largest over ``k`` and ``lam`` of the summed least weighted
    group time of every doc ``s`` ``[n]``, over the shapes ``scs``; ``rank_ms`` ``[n]`` is each doc's least
    rank-time (the area term's), which bounds the identity part of any doc (``u_k >= 0``)."""
    big = np.zeros(len(s), dtype=bool)  # [n] docs that need several lanes on some shape
    for sc in scs:
        big |= s > sc.max_tokens_per_lane
    if not big.any():
        return 0.0
    sb = s[big]
    base = rank_ms / world_size  # [n] identity part: x * t at the cheapest shape and degree
    small_area = float(base[~big].sum())
    ks: set[int] = set(range(1, 9))
    for sc in scs:
        lanes = world_size // sc.gpus
        c = np.maximum(1, -(-sb.astype(np.int64) // sc.max_tokens_per_lane))
        ks.update(int(lanes // x) for x in np.unique(c) if 1 <= lanes // x <= KMAX)
    best = 0.0
    for k in sorted(ks):
        # [n_big, lambdas] least weighted time of each big doc over shapes and degrees
        least = np.full((len(sb), len(LAMBDAS)), np.inf)
        for sc in scs:
            lanes = world_size // sc.gpus
            cap = sc.max_tokens_per_lane
            c = np.maximum(1, -(-sb.astype(np.int64) // cap))  # [n_big] memory-fit degree
            d = _width_degrees(c, lanes, [k], [key for key, _ in sc.bandwidth_gbs], degrees)  # [n_big, m]
            ok = d <= lanes
            dd = np.where(ok, d, 1).astype(np.float64)
            y = (np.asarray(sc.segment_ms(sb[:, None], dd)) + sc.microbatch_ms * sb[:, None] / (dd * cap)) / sc.pp
            x = dd / lanes
            u = dff(k, np.where(ok, d, 1), lanes)  # [n_big, m]
            w = ((1 - LAMBDAS)[None, None, :] * x[..., None] + LAMBDAS[None, None, :] * u[..., None]) * y[..., None]
            w = np.where(ok[..., None], w, np.inf)  # [n_big, m, lambdas]
            least = np.minimum(least, w.min(axis=1))
        total = least.sum(axis=0) + (1 - LAMBDAS) * small_area  # [lambdas]
        best = max(best, float(total.max()))
    return best


ANCHOR_KS = (1, 2, 3, 4, 6)  # the u_k of the anchors term
ANCHOR_MUS = np.linspace(0.0, 1.0, 17)  # [m] multipliers (times beta) tried: each gives a bound
ANCHOR_MAX_DEGREES = 64  # the anchors term over every degree only up to this many lanes (else: a degree set)
ANCHOR_ROUNDS = 3  # rounds of the per-degree ascent (each degree's function in turn, the others kept)
ANCHOR_ASCENT_CELLS = 1 << 26  # the ascent only where degrees^2 x docs is at most this (O(m^2 n) per round)


def anchors_bound(s: np.ndarray, sc: ShapeCost, lanes: int, degrees: Sequence[int] | None = None) -> float:
    """The anchors term (module docstring), lane-ms over the ``lanes`` lanes of one shape, for docs ``s`` ``[n]``.

    Every plan pays ``beta`` on each lane of each group: ``beta * sum_g d_g``. Within a group of degree ``d`` the
    docs' fractions ``x = s / (d cap)`` sum to at most 1, so for a dual feasible function ``u`` their ``u(x)`` do
    too, and ``beta d_g >= beta d_g sum_{i in g} u(x_i)``. The function may be chosen per degree ``d`` (a group's
    docs all pass through its own degree's ``u_d``): summed over the groups, the plan's lane-ms is at least
    ``sum_i c_i(d_i) + beta d_i u_{d_i}(x_i)`` with ``c_i(d) = d seg(s_i, d)``, so at least ``sum_i min_d (c_i(d) +
    beta d u_d(s_i / (d cap)))`` for any choice of the ``u_d``. Each ``u_d`` is a mixture ``(1 - lam) x + lam
    u_k(x)`` (``u_k(x) = floor((k + 1) x) / k``, ``x`` where ``(k + 1) x`` is an integer; ``lam = 0``: ``beta`` per
    ``cap`` tokens); one mixture for every degree is weak duality with a multiplier ``lam beta`` on ``sum_g d_g >=
    tokens / cap``; from the best of those, each degree's mixture is changed in turn where the sum grows
    (:data:`ANCHOR_ROUNDS` rounds): every choice is a bound, so the search only needs to be deterministic.
    Docs more than half a group (``k = 1``) run alone; two of a third (``k = 2``) share one. ``0.0`` without a
    fixed cost, or over more than :data:`ANCHOR_MAX_DEGREES` lanes without ``degrees``."""
    cap, beta = sc.max_tokens_per_lane, float(sc.microbatch_ms)
    if degrees is None:
        if lanes > ANCHOR_MAX_DEGREES:
            return 0.0
        allowed = np.arange(1, lanes + 1, dtype=np.int64)
    else:
        allowed = np.asarray(sorted({int(d) for d in degrees if 1 <= d <= lanes}), dtype=np.int64)  # [m]
    if beta <= 0 or len(s) == 0 or len(allowed) == 0:
        return 0.0
    si = s.astype(np.int64)
    dd = allowed.astype(np.float64)
    c = np.asarray(sc.segment_ms(s[:, None], dd[None, :]), dtype=np.float64) * dd[None, :]  # [n, m] lane-ms
    c = np.where(si[:, None] <= allowed[None, :] * cap, c, np.inf)  # memory: s <= d * cap
    if not np.isfinite(c.min(axis=1)).all():
        return float("inf")

    def charges(j: int) -> np.ndarray:
        """``[options, n]`` lane-ms of each doc at degree ``allowed[j]`` under each mixture (k-major, then lam)."""
        den = int(allowed[j]) * cap
        x = si / den  # [n]
        num = (np.asarray(ANCHOR_KS)[:, None] + 1) * si[None, :]  # [ks, n]
        u = np.where(num % den == 0, x[None, :], (num // den) / np.asarray(ANCHOR_KS, np.float64)[:, None])
        lam = ANCHOR_MUS[None, :, None]
        mix = (1 - lam) * x[None, None, :] + lam * u[:, None, :]  # [ks, mus, n]
        return c[:, j][None, :] + beta * dd[j] * mix.reshape(-1, len(si))

    least = charges(0)  # [options, n] least over the degrees, one mixture for every degree
    for j in range(1, len(allowed)):
        np.minimum(least, charges(j), out=least)
    uniform = least.sum(axis=1)  # [options]
    o = int(np.argmax(uniform))
    best = float(uniform[o])
    if len(allowed) < 2 or len(allowed) ** 2 * len(si) > ANCHOR_ASCENT_CELLS:
        return best / lanes
    pick = np.full(len(allowed), o)  # [m] each degree's mixture
    cur = np.stack([charges(j)[o] for j in range(len(allowed))])  # [m, n] each doc at each degree's mixture
    for _ in range(ANCHOR_ROUNDS):
        grew = False
        for j in range(len(allowed)):
            rest = np.delete(cur, j, axis=0).min(axis=0)  # [n] least over the other degrees
            table = charges(j)
            got = np.minimum(rest[None, :], table).sum(axis=1)  # [options]
            o = int(np.argmax(got))
            if got[o] > best * (1 + 1e-12):
                best, pick[j], grew = float(got[o]), o, True
                cur[j] = table[o]
        if not grew:
            break
    return best / lanes


def step_lower_bound(lengths: np.ndarray, cost: CostModel, world_size: int,
                     shapes: Sequence[tuple[int, int]] | None = None, *, passes: bool = True,
                     degrees: Sequence[int] | None = None) -> StepBound:
    """:class:`StepBound` of a batch ``lengths`` ``[n]`` on ``world_size`` ranks over ``shapes``
    (default: every usable shape of the cost model whose ``tp * pp`` divides the world).

    ``degrees`` (e.g. the powers of two hydra and mcore-dcp use) restricts the bound to plans whose
    groups all have one of these degrees: every term then takes its minima over those degrees only,
    so it holds for exactly those plans (a tighter figure for them, not a bound on every plan)."""
    s = np.asarray(lengths, dtype=np.float64)  # [n]
    if s.size == 0:
        return StepBound(area_ms=0.0, longest_ms=0.0)
    scs = ([cost.shape(tp, pp) for tp, pp in shapes] if shapes is not None
           else [sc for sc in cost.shapes() if world_size % sc.gpus == 0])
    scs = [sc for sc in scs if sc.usable and world_size // sc.gpus >= 1]
    if not scs:
        raise ValueError(f"no usable shape of the cost model fits {world_size} ranks")
    rank_ms = np.full(len(s), np.inf)  # [n] least rank-ms of each doc
    longest = np.full(len(s), np.inf)  # [n] least whole-group time of each doc
    tables = []
    for sc in scs:
        lanes = world_size // sc.gpus
        lane_ms, group_ms = cheapest(sc, s, lanes, degrees)
        tables.append(lane_ms)
        # the fixed cost: a lane-slot of a group holds at most cap tokens, so beta per cap tokens
        rank_ms = np.minimum(rank_ms, sc.tp * (lane_ms + sc.microbatch_ms * s / sc.max_tokens_per_lane))
        longest = np.minimum(longest, sc.microbatch_ms + group_ms)
    area = float(rank_ms.sum()) / world_size
    if not np.isfinite(area):
        raise ValueError("a doc fits no shape of the cost model at any degree"
                         + ("" if degrees is None else f" in {sorted(set(degrees))}"))
    widths = widths_bound(s, scs, world_size, rank_ms, degrees)
    if widths and len(scs) == 1:  # one pool: its pipeline fill and drain come on top of the last finish
        widths += (scs[0].pp - 1) / scs[0].pp * float(longest.max())
    out = StepBound(area_ms=area, longest_ms=float(longest.max()), widths_ms=widths)
    if len(scs) == 1:
        sc = scs[0]
        anchors = anchors_bound(s, sc, world_size // sc.gpus, degrees) / sc.pp
        u = passes_bound(tables[0], s, sc, world_size // sc.gpus, area * sc.pp) / sc.pp if passes else 0.0
        out = StepBound(area_ms=out.area_ms, longest_ms=out.longest_ms, passes_ms=u, widths_ms=widths,
                        anchors_ms=anchors)
    return out
