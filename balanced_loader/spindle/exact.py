"""Exact whole-layer waves over a set of configurations: a MILP solved by HiGHS (not in Spindle).

The column-generation LP (:mod:`.columns`) picks how long each configuration (a device count
per MetaOp, or 0) runs, with fractional layers; rounding its layers loses a few percent when
MetaOps have few, long layers. Here the layers are integers and the rounding is exact:

    min  sum_w tau_w
    s.t. l_iw * t_i(n_iw) <= tau_w            for every MetaOp i in configuration w,
         sum_w l_iw = L_i                     for every MetaOp i,
         l_iw in {0, .., L_i},  tau_w >= 0,

one wave per configuration (two waves of the same configuration never beat one holding both:
a max of sums is at most the sum of maxes). The optimum over the given configurations is found
when HiGHS finishes inside its node limit; otherwise its best plan so far (or None). The planner
then re-chooses each wave's counts with :func:`.refine.refine`, which can only shorten it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from balanced_loader.spindle.columns import Config
from balanced_loader.spindle.graph import MetaOp
from balanced_loader.spindle.waves import Run

ENUMERATION_LIMIT = 200_000  # assignments (allowed counts or 0 per MetaOp) walked at most


def ilp_waves(ops: Sequence[MetaOp], frontier: Sequence[int], columns: Sequence[Config], *,
              node_limit: int = 5000, time_limit: float = 30.0) -> tuple[list[list[Run]] | None, bool]:
    """Whole-layer waves of ``frontier`` over ``columns`` (each a device count per frontier
    MetaOp, 0: absent; together they must cover every MetaOp), None if HiGHS found none, and
    whether HiGHS proved them optimal over ``columns``. The search stops after ``node_limit``
    branch-and-bound nodes (deterministic: the same plan on any machine) or, as a safety net on
    a stalled machine, ``time_limit`` seconds; its best plan so far is returned then."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # scipy is loaded once per plan

    k, nw = len(frontier), len(columns)
    pairs = [(i, w) for w in range(nw) for i in range(k) if columns[w][i]]  # one layer variable each
    nv = nw + len(pairs)  # variables: tau_w, then l_iw
    c = np.zeros(nv)  # [variables]
    c[:nw] = 1.0
    cap = np.zeros((len(pairs), nv))  # [pairs][variables] l_iw * t_iw - tau_w <= 0
    cover = np.zeros((k, nv))  # [frontier][variables] sum_w l_iw = L_i
    upper = np.full(nv, np.inf)  # [variables]
    for p, (i, w) in enumerate(pairs):
        op = ops[frontier[i]]
        cap[p, nw + p] = op.layer_ms(columns[w][i])
        cap[p, w] = -1.0
        cover[i, nw + p] = 1.0
        upper[nw + p] = op.layers
    layers = np.array([ops[g].layers for g in frontier], dtype=np.float64)  # [frontier]
    integrality = np.zeros(nv)
    integrality[nw:] = 1
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(nv), upper),
               constraints=[LinearConstraint(cap, -np.inf, 0.0), LinearConstraint(cover, layers, layers)],
               options={"time_limit": time_limit, "node_limit": node_limit, "mip_rel_gap": 1e-6, "disp": False})
    if res.x is None:
        return None, False
    got = np.rint(res.x[nw:]).astype(np.int64)  # [pairs] whole layers
    waves: list[list[Run]] = [[] for _ in range(nw)]
    for (i, w), m in zip(pairs, got):
        if m > 0:
            waves[w].append(Run(op=frontier[i], n=columns[w][i], layers=int(m)))
    out = [w for w in waves if w]
    done = {g: 0 for g in frontier}
    for w in out:
        for r in w:
            done[r.op] += r.layers
    assert all(done[g] == ops[g].layers for g in frontier), "the MILP covers every layer once"
    return out, res.status == 0


def all_configurations(ops: Sequence[MetaOp], frontier: Sequence[int], gpus: int, *,
                       limit: int = 4000) -> list[Config] | None:
    """Every *maximal* configuration of ``frontier`` on ``gpus`` devices (no MetaOp can move up to a
    larger allowed count with the idle devices: more devices never slow a MetaOp down), or None
    when there are more than ``limit``. Counts only of each MetaOp's strictly faster steps."""
    steps: list[list[int]] = []
    for g in frontier:
        cs: list[int] = []
        for c in ops[g].counts:
            if not cs or ops[g].layer_ms(c) < ops[g].layer_ms(cs[-1]):
                cs.append(c)
        steps.append(cs)
    k = len(frontier)
    if math.prod(len(cs) + 1 for cs in steps) > ENUMERATION_LIMIT:
        return None  # the walk below visits every (also non-maximal) assignment
    out: list[Config] = []
    cur = [0] * k

    def go(i: int, left: int) -> bool:
        if i == k:
            if not any(cur):
                return True
            for j in range(k):  # maximal: no MetaOp's next step fits in the idle devices
                nxt = next((c for c in steps[j] if c > cur[j]), None)
                if nxt is not None and nxt - cur[j] <= left:
                    return True
            out.append(tuple(cur))
            return len(out) <= limit
        for c in [0, *steps[i]]:
            if c > left:
                break
            cur[i] = c
            if not go(i + 1, left - c):
                return False
        cur[i] = 0
        return True

    return out if go(0, gpus) else None
