r"""``hydra``: one global load target per step, load-driven CP degrees, lazy-heap placement.

Notation (one pool of ``L`` lanes, the cost file's shape): a doc of ``s`` tokens has work
``f(s) = q s^2 + l s``; on an aligned block of ``d = 2^v`` lanes its group time is
``g(s, d) = beta + f(s)/d + kappa(s, d)`` with ``kappa(s, d) = B s / (d bw(d))`` (contract 2;
``beta = microbatch_ms``, ``B = comm_bytes_per_token``, ``kappa = 0`` for ``d = 1``) and it
uses ``d g(s, d)`` lane-milliseconds: ``f(s) + B s / bw(d) + beta d``. The memory-fit degree
``c_mem(s)`` is the smallest allowed ``d`` with ``s <= d cap``; allowed degrees are the powers
of two up to ``L`` (aligned blocks, so blocks of up to a node's lanes stay inside a node).

**Load target (closed form).** Every lane should finish at one time ``T``. Give each doc
the smallest allowed degree whose group fits in the target,
``c(s, T) = min{d >= c_mem(s): g(s, d) <= T}``. Docs left at degree 1 share passes of ``cap``
tokens, ``beta`` each; wider docs run alone in their group. Lane time is conserved, so
``T`` is feasible only if

    T >= F(T) = ( sum_i f(s_i) + sum_{c_i > 1} (B s_i / bw(c_i) + beta c_i)
                  + beta ceil(short tokens / cap) ) / L                       (area)
    T >= T_min = min_d g(s_max, d)                                          (critical path)

``F`` is a non-increasing step function of ``T``: raising ``T`` only lowers degrees, and a
lower degree uses no more lane time (``bw`` does not grow with ``d`` in the cost files; the
sweep below is exact in any case). Between two consecutive breakpoints (the values
``g(s_i, d)`` where some doc may drop to degree ``d``) ``F`` is a constant ``F_j``, so the
target is in closed form on that interval, ``T* = max(b_j, F_j)`` if that is below ``b_{j+1}``.
Scanning the breakpoints upward from ``T_lo = max(T_min, F(inf))`` (every doc at ``c_mem``)
finds the smallest feasible ``T*``; only docs with ``g(s, c_mem) > T_lo`` have breakpoints
(the few longest), so this costs ``O(n + E log E)`` for ``E`` such (doc, degree) pairs.

How this improves on the reconstruction in papers/hydra_dcp.md section 1.3: that version
assumes a constant per-rank overhead ``kappa_i`` and continuous degrees ``c = f/L``, which
gives the quadratic root ``L* = (W + sqrt(W^2 + 4RMK)) / 2RM``. In the Ulysses cost of
contract 2 the per-lane communication shrinks as ``1/d`` and its lane-time ``B s / bw(d)``
depends on ``d`` only through the bandwidth table, so a step function replaces the
quadratic; we solve it exactly on the discrete allowed degrees instead of rounding a
continuous ``c``, count ``microbatch_ms`` per pass, and add the critical-path term.

**Placement.** Docs of degree > 1, widest then longest first, go to the aligned block of
their degree that starts first (one lazy versioned min-heap of blocks per size,
:func:`balanced_loader.planning.packing.block_place`); if that would end after ``T*``, the allowed
larger degree that finishes first is used instead (degrees beyond memory needs where they
lower the step time). Widest first keeps every block's lanes level, so groups never wait.
The degree-1 docs, longest first, then fill the deficits: each goes to the lane that is
least loaded counting ``beta`` when it must open a new pass, best fit among that lane's
passes (:func:`balanced_loader.planning.packing.fill_passes`), so lanes run few passes.

**Portfolio.** Where this placement is out of its regime (docs few per lane, a fixed cost per pass worth
thousands of tokens of work, the placement far above ``T*``), the plans of
:mod:`balanced_loader.planning.policies.portfolio` compete with it (co-packed wide groups, wide docs packed
together, single-degree plans, placements without escalation, the simpler policies' plans, FlexSP's blaster):
each is timed by the contract-2 model before any contract-1 object is built, the fastest is kept and the
plan's ``notes`` record the choice. The gates are properties of the batch and the cost file, never the clock.
``PlanConfig.extra["portfolio"] = False`` keeps the load-target placement alone.

**Bound.** ``T*`` is hydra's own target, not a lower bound on other plans (it fixes aligned
power-of-two degrees and charges ``beta`` per ``cap`` tokens rounded up). Plans are measured
against :func:`balanced_loader.planning.solvers.bound.step_lower_bound`, the one home of step
bounds: valid for every plan, or with ``degrees=`` the powers of two, for every plan that (like
hydra's) uses only those degrees.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from balanced_loader.cost import CostModel, ShapeCost, floor_level
from balanced_loader.plan import BatchItems, StepPlan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.packing import block_place, fill_passes
from balanced_loader.planning.policies import portfolio
from balanced_loader.planning.policies.common import (
    assemble,
    empty_plan,
    max_cp_degree,
    memory_fit_levels,
    one_pool_plan,
    pool_setup,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadTarget:
    """The step's load target and the degree (as a level, ``d = 2**level``) of every item."""

    target_ms: float  # T*: the time every lane should finish at
    t_min_ms: float  # the longest doc's best group time over allowed degrees
    area_ms: float  # F(T*): lane time per lane at the chosen degrees
    levels: np.ndarray  # [n] chosen level per item
    memory_levels: np.ndarray  # [n] memory-fit level per item
    cand: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [c] items whose level depends on T
    cand_times: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [c, levels] group ms (inf: not allowed)

    def levels_at(self, t: float) -> np.ndarray:
        """``[n]`` levels for another target ``t >= target_ms``: smallest allowed with group time <= t."""
        levels = self.levels.copy()
        if len(self.cand):
            fits = self.cand_times <= t
            levels[self.cand] = np.where(fits.any(axis=1), np.argmax(fits, axis=1), levels[self.cand])
        return levels

    def breakpoints(self, k: int) -> list[float]:
        """The next ``k`` targets above ``target_ms`` where some item's level drops."""
        g = self.cand_times[np.isfinite(self.cand_times)]
        return np.unique(g[g > self.target_ms])[:k].tolist()


def _level_tables(sc: ShapeCost, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per level v: degree 2**v and communication ms per token per lane (0 at v = 0)."""
    deg = np.left_shift(1, np.arange(top + 1)).astype(np.float64)  # [levels]
    bw = np.asarray([sc.bandwidth(int(d)) if d > 1 else np.inf for d in deg])  # [levels] GB/s
    comm = np.where(deg > 1, sc.comm_bytes_per_token / deg / (bw * 1e6), 0.0)  # [levels] ms/token/lane
    return deg, comm


def group_times(sc: ShapeCost, lengths: np.ndarray, top: int) -> np.ndarray:
    """``[n, top + 1]`` contract-2 group time of each doc alone on 2**v lanes."""
    deg, comm = _level_tables(sc, top)
    s = np.asarray(lengths, dtype=np.float64)[:, None]
    return sc.microbatch_ms + sc.compute_ms(s) / deg[None, :] + comm[None, :] * s


def load_target(items: BatchItems, sc: ShapeCost, lanes: int, *, policy: str = "hydra", top: int | None = None
                ) -> LoadTarget:
    """The closed-form load target ``T*`` and the degrees it implies (module docstring); ``top``
    caps the level (``cp = 2**top``, default the largest aligned block)."""
    top = floor_level(lanes) if top is None else top
    cap = sc.max_tokens_per_lane
    beta = sc.microbatch_ms
    lv_mem = memory_fit_levels(items, cap, top, policy)
    n = len(items)
    if n == 0:
        return LoadTarget(target_ms=0.0, t_min_ms=0.0, area_ms=0.0, levels=lv_mem, memory_levels=lv_mem)
    s = items.lengths.astype(np.float64)
    deg, comm = _level_tables(sc, top)
    f = sc.compute_ms(s)  # [n]
    f_sum = float(f.sum())
    # lane time beyond f of a doc alone on 2**v lanes: B s / bw + beta d (v >= 1)
    extra_per_tok = comm * deg  # [levels] ms per token, all lanes together
    g_mem = beta + f / deg[lv_mem] + comm[lv_mem] * s  # [n]
    longest = int(np.argmax(items.lengths))
    g_top = group_times(sc, items.lengths[longest:longest + 1], top)[0]
    t_min = float(g_top[lv_mem[longest]:].min())

    def area(levels: np.ndarray) -> float:
        wide = levels > 0
        short_tok = int(items.lengths[~wide].sum())
        extra = float((extra_per_tok[levels[wide]] * s[wide]).sum() + beta * deg[levels[wide]].sum())
        return (f_sum + extra + beta * -(-short_tok // cap)) / lanes

    t_lo = max(t_min, area(lv_mem))
    cand = np.flatnonzero(g_mem > t_lo)  # the only docs whose degree depends on T
    levels = lv_mem.copy()
    if len(cand) == 0:
        return LoadTarget(target_ms=t_lo, t_min_ms=t_min, area_ms=area(levels), levels=levels,
                          memory_levels=lv_mem)
    g = group_times(sc, items.lengths[cand], top)  # [c, levels]
    allowed = np.arange(top + 1)[None, :] >= lv_mem[cand][:, None]
    g = np.where(allowed, g, np.inf)
    fits = g <= t_lo
    cur = np.where(fits.any(axis=1), np.argmax(fits, axis=1), top)  # [c] level at t_lo
    levels[cand] = cur
    # breakpoints above t_lo: (time, candidate, level) for levels below the current one
    ci, vi = np.nonzero((g > t_lo) & (np.arange(top + 1)[None, :] < cur[:, None]) & allowed)
    times = g[ci, vi]
    order = np.argsort(times, kind="stable")
    ci, vi, times = ci[order], vi[order], times[order]
    # incremental F: sums over wide docs, tokens of short docs
    wide = levels > 0
    extra = float((extra_per_tok[levels[wide]] * s[wide]).sum() + beta * deg[levels[wide]].sum())
    short_tok = int(items.lengths[~wide].sum())

    def f_of() -> float:
        return (f_sum + extra + beta * -(-short_tok // cap)) / lanes

    t_cur = t_lo
    fc = f_of()
    j = 0
    while j < len(times) and fc >= times[j]:
        t_cur = float(times[j])
        while j < len(times) and times[j] == t_cur:
            c, v = int(ci[j]), int(vi[j])
            i = int(cand[c])
            old = int(levels[i])
            if v < old:
                if old > 0:
                    extra -= extra_per_tok[old] * s[i] + beta * deg[old]
                else:
                    short_tok -= int(items.lengths[i])
                if v > 0:
                    extra += extra_per_tok[v] * s[i] + beta * deg[v]
                else:
                    short_tok += int(items.lengths[i])
                levels[i] = v
            j += 1
        fc = f_of()
    target = max(t_cur, fc)
    return LoadTarget(target_ms=target, t_min_ms=t_min, area_ms=fc, levels=levels, memory_levels=lv_mem,
                      cand=cand, cand_times=g)


ESCALATE = 2  # a wide doc may take a block up to 2**ESCALATE times its target degree
RETARGETS = 3  # further breakpoints tried when the placed step misses the target
RETARGET_SLACK = 0.01  # ... by more than this fraction


def _place(items: BatchItems, sc: ShapeCost, lanes: int, pp: int, levels: np.ndarray, target: float, top: int,
           desc: np.ndarray, work_all: np.ndarray, beat: float | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float] | None:
    """Wide items onto blocks, then one-lane items into passes: per-item (microbatch, first lane,
    degree) and the contract-2 step time of the result.

    ``desc`` ``[n]`` is every item longest first (stable) and ``work_all`` ``[n]`` its compute ms,
    shared by the tries of one step. ``beat``: None as soon as the result cannot come out below it
    (the pass filling only adds to the wide placement's lane loads and ``gmax``)."""
    n = len(items)
    mb = np.empty(n, dtype=np.int64)
    lane0 = np.empty(n, dtype=np.int64)
    deg = np.ones(n, dtype=np.int64)
    load = np.zeros(lanes)
    next_k = np.zeros(lanes, dtype=np.int64)
    gmax = 0.0
    wide = np.flatnonzero(levels > 0)
    if len(wide):
        g = group_times(sc, items.lengths[wide], top)  # [w, levels]
        lv_of = np.arange(top + 1)[None, :]
        g[(lv_of < levels[wide][:, None]) | (lv_of > levels[wide][:, None] + ESCALATE)] = np.inf
        own = g[np.arange(len(wide)), levels[wide]]
        order = np.lexsort((-own, -levels[wide]))  # widest first, then longest
        pl = block_place(g[order], levels[wide][order], lanes, load, next_k, target=target)
        assert (pl.level >= 0).all()
        idx = wide[order]
        mb[idx] = pl.microbatch
        lane0[idx] = pl.lane
        deg[idx] = np.left_shift(1, pl.level)
        load, next_k = pl.load, pl.next_microbatch
        gmax = float(g[order][np.arange(len(idx)), pl.level].max())  # pl.level is in placement order
    if beat is not None and not (float(load.max()) + (pp - 1) * gmax) / pp < beat:  # nan: never below
        return None
    idx = desc[levels[desc] == 0]  # the one-lane items, longest first (a stable order's subsequence)
    if len(idx):
        work = work_all[idx]
        fp = fill_passes(items.lengths[idx], work, load, sc.max_tokens_per_lane, sc.microbatch_ms)
        mb[idx] = next_k[fp.lane] + fp.pass_
        lane0[idx] = fp.lane
        load = fp.load
        if pp > 1:
            per_pass = np.bincount(fp.lane * (int(fp.passes.max()) + 1) + fp.pass_, weights=work)
            gmax = max(gmax, float(per_pass.max()) + sc.microbatch_ms)
    # lane loads are whole-model ms: contract 2's last finish plus fill and drain (simulate.makespan_ms)
    return mb, lane0, deg, (float(load.max()) + (pp - 1) * gmax) / pp


SHAPE_GAIN = 1e-3  # a tensor-parallel shape replaces one-rank lanes only when this much faster (no flapping)


def plan_step(items: BatchItems, cost: CostModel, config: PlanConfig, step: int) -> StepPlan:
    """hydra on lanes of the shape ``(config.tp or 1, config.pp or 1)``: load target, degrees, placement, and
    the portfolio where the placement misses."""
    from balanced_loader.planning.kernels import order_desc  # numba: loaded when a policy runs

    setup = pool_setup(items, cost, config, "hydra")
    top = floor_level(max_cp_degree(config, setup.lanes, "hydra"))  # cp caps the degree; cp=1: plain DP
    tgt = load_target(items, setup.shape, setup.lanes, top=top)
    if not len(items):
        return empty_plan(step, config, setup)
    # The target is a lane-time bound; with few docs per lane the granularity of groups and
    # passes can leave it far off. Then the next breakpoints (lower degrees) are tried too.
    desc = order_desc(np.ascontiguousarray(items.lengths, dtype=np.int64))  # [n] longest first, ties by index
    work_all = np.asarray(setup.shape.compute_ms(items.lengths.astype(np.float64)))  # [n] ms
    best = None
    for t in [tgt.target_ms, *tgt.breakpoints(RETARGETS)]:
        levels = tgt.levels if t == tgt.target_ms else tgt.levels_at(t)
        placed = _place(items, setup.shape, setup.lanes, setup.pp, levels, t, top, desc, work_all,
                        beat=None if best is None else best[3])
        if placed is not None and (best is None or placed[3] < best[3]):
            best = placed
        if best[3] <= tgt.target_ms * (1 + RETARGET_SLACK):
            break
    mb, lane0, deg, own_ms = best
    notes: tuple[str, ...] = ()
    use = config.extra.get("portfolio", True)
    if not isinstance(use, bool):
        raise ValueError(f"policy 'hydra': option 'portfolio' must be true or false, got {use!r}")
    if use and portfolio.wanted(len(items), setup.shape, setup.lanes, top, tgt.levels, tgt.target_ms, own_ms):
        (mb, lane0, deg), notes = _portfolio(items, setup, tgt, desc, top, (mb, lane0, deg), own_ms)
    micro = assemble(items, mb, lane0, deg)
    plan = one_pool_plan(step, config.world_size, setup.tp, setup.pp, micro)
    return plan.with_timing(notes=notes) if notes else plan


def try_shapes(items: BatchItems, cost: CostModel, config: PlanConfig, step: int, plan: StepPlan) -> StepPlan:
    """``plan`` (hydra's on one-rank lanes: :func:`plan_step`), or, where it needs CP, neither ``tp`` nor ``pp`` is
    fixed and the lanes are alike (``make_plan`` calls this only then), the plan on lanes of
    2, 4, .. tensor-parallel ranks (:func:`tp_lanes_plan`): a TP pair holds twice the tokens of a lane at less
    than twice its speed cost, so long docs need less CP (the sweep found ``hydraulis``' tp-2 pools 0.6-1.8%
    faster on the llama3 preset at 32K). ``extra["shapes"] = False`` keeps one-rank lanes."""
    tries = config.extra.get("shapes", True)
    if not isinstance(tries, bool):
        raise ValueError(f"policy 'hydra': option 'shapes' must be true or false, got {tries!r}")
    if not tries:
        return plan
    best, best_ms, lanes_ms = tp_lanes_plan(items, cost, config, step, plan)
    if best is plan:
        return plan
    note = f"hydra: lanes of tp {best.pools[0].tp} kept ({best_ms:.1f} ms; one-rank lanes {lanes_ms:.1f} ms)"
    return best.with_timing(notes=(*best.notes, note))


def tp_lanes_plan(items: BatchItems, cost: CostModel, config: PlanConfig, step: int, plan: StepPlan
                  ) -> tuple[StepPlan, float, float]:
    """``(best, its ms, plan's ms)``: hydra's plan on lanes of 2, 4, .. TP ranks (the cost file's ``(tp, 1)``
    shapes, each kept while it is :data:`SHAPE_GAIN` faster) against ``plan`` (any policy's, on one-rank lanes),
    where ``plan`` needs CP and neither ``tp`` nor ``pp`` is fixed; ``best is plan`` when none is faster."""
    from balanced_loader.simulate import step_ms  # contract 2 on the plans (imported where the shapes are compared)

    best, best_ms = plan, step_ms(plan, cost)
    lanes_ms = best_ms
    if config.tp is not None or config.pp is not None or not any(
            len(g.lanes) > 1 for mb in plan.pools[0].microbatches for g in mb):
        return best, best_ms, lanes_ms
    usable = {s.tp for s in cost.shapes() if s.pp == 1}
    tp = 2
    while tp in usable and config.world_size % tp == 0:
        try:
            cand = plan_step(items, cost, replace(config, policy="hydra", tp=tp), step)
        except ValueError:  # a doc no group of this shape holds
            break
        ms = step_ms(cand, cost)
        if ms >= best_ms * (1 - SHAPE_GAIN):
            break
        best, best_ms, tp = cand, ms, 2 * tp
    return best, best_ms, lanes_ms


def _portfolio(items: BatchItems, setup, tgt: LoadTarget, desc: np.ndarray, top: int, own: portfolio.Arrays,
               own_ms: float) -> tuple[portfolio.Arrays, tuple[str, ...]]:
    """The fastest of hydra's own placement and the portfolio's candidates, by contract 2 (ties: the earlier),
    and the note that records the choice."""
    ev = portfolio.Evaluator(items.lengths, setup.shape, setup.lanes, setup.pp)
    best, win, win_ms, tried = own, "load-target", ev.ms(own), 0
    enough = ev.floor_ms(top) * (1 + portfolio.STOP) if setup.pp == 1 else 0.0  # no candidate can do much better
    for name, build in portfolio.candidates(ev, tgt.levels, desc, top, int(tgt.memory_levels.max()), tgt.target_ms,
                                            own_ms):
        if win_ms <= enough:
            break
        cand = build()
        if cand is None:
            continue
        tried += 1
        t = ev.ms(cand)
        if t < win_ms * (1 - 1e-9):
            best, win, win_ms = cand, name, t
    if not tried:
        return own, ()
    for what, polish in (("tail", portfolio.polish), ("groups", portfolio.polish_groups)):
        polished = polish(ev, best)
        t = ev.ms(polished)
        if t < win_ms * (1 - 1e-9):
            best, win, win_ms = polished, f"{win}, {what} polished", t
    return best, (f"hydra: portfolio of {tried + 1} plans chose {win} ({win_ms:.1f} ms; load-target placement "
                  f"{own_ms:.1f} ms)",)
