"""FlexSP: blaster DPs, microbatch MILPs against brute force, and the ``flexsp`` policy."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.cost import CostModel, allowed_degrees
from balanced_loader.plan import BatchItems
from balanced_loader.planning import make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.flexsp import pool_time
from balanced_loader.planning.solvers import blaster
from balanced_loader.planning.solvers.sp_groups import (
    SpGroup,
    fill_kernel,
    fill_reference,
    greedy_homogeneous,
    makespan_lower_bound,
    place_lanes,
    polish_kernel,
    polish_reference,
    rebalance_single_lanes,
    segment_table,
)
from balanced_loader.planning.solvers.sp_milp import Buckets, slot_milp, solve_microbatch
from balanced_loader.presets import cost_preset

FLEX = cost_preset("flexsp-gpt7b-a100")


def tiny_cost(cap: int = 1000) -> CostModel:
    """FlexSP-like coefficients at a scale where a few docs need several lanes."""
    return CostModel(quadratic_ms=2e-4, linear_ms=0.5, microbatch_ms=40.0, comm_bytes_per_token=4e6,
                     bandwidth_gbs=((2, 100.0), (4, 20.0), (8, 5.0)), max_tokens_per_lane=cap)


# ---------------------------------------------------------------------------------------------
# blaster DPs
# ---------------------------------------------------------------------------------------------


def chunk_max(lengths: np.ndarray, cuts: np.ndarray) -> int:
    return max(int(lengths[a:b].sum()) for a, b in zip(cuts[:-1], cuts[1:]))


@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_chunk_dp_kernel_equals_reference_and_brute_force(lengths, m):
    ln = np.asarray(sorted(lengths, reverse=True), dtype=np.int64)
    m = min(m, len(ln))
    cuts = blaster.chunk_cuts(ln, m)
    assert np.array_equal(cuts, blaster.chunk_cuts_reference(ln, m))
    assert cuts[0] == 0 and cuts[-1] == len(ln) and (np.diff(cuts) > 0).all()
    best = min(chunk_max(ln, np.asarray((0, *c, len(ln))))
               for c in itertools.combinations(range(1, len(ln)), m - 1))
    assert chunk_max(ln, cuts) == best


def padding(values, counts, ends):
    return blaster.padding_error(np.asarray(values), np.asarray(counts), np.asarray(ends))


@given(st.lists(st.integers(1, 400), min_size=1, max_size=8, unique=True), st.integers(1, 6), st.data())
def test_bucket_dp_kernel_equals_reference_and_brute_force(values, q, data):
    vals = np.asarray(sorted(values), dtype=np.int64)
    cnts = np.asarray(data.draw(st.lists(st.integers(1, 5), min_size=len(vals), max_size=len(vals))), dtype=np.int64)
    ends = blaster.bucket_ends(vals, cnts, q)
    assert np.array_equal(ends, blaster.bucket_ends_reference(vals, cnts, q))
    qq = min(q, len(vals))
    assert len(ends) == qq and ends[-1] == len(vals)
    best = min(padding(vals, cnts, (*c, len(vals))) for c in itertools.combinations(range(1, len(vals)), qq - 1))
    assert padding(vals, cnts, ends) == best


def test_buckets_grow_until_rounded_tokens_fit():
    rng = np.random.default_rng(3)
    ln = rng.integers(1, 6000, 400)
    cap = int(ln.sum() * 1.02)  # tight: needs more than 16 buckets
    label, bound = blaster.buckets_for(ln, cap, q0=16)
    assert len(bound) > 16
    assert (ln <= bound[label]).all()
    assert int(bound[label].sum()) <= (ln.sum() + cap) / 2
    label16, bound16 = blaster.buckets_for(ln, 10 * cap, q0=16)
    assert len(bound16) == 16


# ---------------------------------------------------------------------------------------------
# microbatch planning kernels
# ---------------------------------------------------------------------------------------------


@given(st.lists(st.integers(1, 3000), min_size=1, max_size=30), st.integers(1, 6), st.integers(1000, 9000))
def test_fill_kernel_equals_reference(lengths, groups, cap):
    ln = np.asarray(lengths, dtype=np.int64)
    times = ln * 0.3 + ln.astype(np.float64) ** 2 * 1e-4
    order = np.lexsort((np.arange(len(ln)), -ln)).astype(np.int64)
    assert np.array_equal(fill_kernel(ln, times, order, groups, cap), fill_reference(ln, times, order, groups, cap))


@given(st.lists(st.integers(1, 2000), min_size=2, max_size=16), st.data())
def test_polish_kernel_equals_reference_and_never_worse(lengths, data):
    ln = np.asarray(lengths, dtype=np.int64)
    sc = tiny_cost(4000).base
    degrees = [1, 2, 4]
    seg = segment_table(ln, sc, degrees)
    ng = data.draw(st.integers(1, min(4, len(ln))))
    gdeg = np.asarray(data.draw(st.lists(st.integers(0, 2), min_size=ng, max_size=ng)), dtype=np.int64)
    gcap = np.asarray([4000 * degrees[j] * 4 for j in gdeg], dtype=np.int64)
    assign = np.asarray([i % ng for i in range(len(ln))], dtype=np.int64)
    out = polish_kernel(ln, seg, gdeg, gcap, assign, sc.microbatch_ms, 50)
    assert np.array_equal(out, polish_reference(ln, seg, gdeg, gcap, assign, sc.microbatch_ms, 50))

    def span(a):
        return max(sc.microbatch_ms + seg[gdeg[g], a == g].sum() for g in range(ng) if (a == g).any())

    assert span(out) <= span(assign) + 1e-9
    assert all(ln[out == g].sum() <= gcap[g] for g in range(ng))


def test_lane_placement_and_rebalancing_use_lane_finish_times():
    sc = tiny_cost(1000).base
    ln = np.array([1800, 450, 450, 450, 100, 100, 450, 100], dtype=np.int64)

    def grp(d, docs):
        return SpGroup(degree=d, docs=tuple(docs), ms=sc.group_ms(ln[list(docs)], d))

    mbs = [(grp(2, [0]), grp(1, [4]), grp(1, [5])), (grp(1, [1]), grp(1, [2]), grp(1, [3]), grp(1, [6, 7]))]
    # lanes 0-1 are busy until 850 ms, lanes 2-3 until 92 ms
    lanes = place_lanes(mbs, 4)
    assert lanes[0][0] in ((0, 1), (2, 3)) and all(len(set(x for ln_ in mb for x in ln_)) == 4 for mb in lanes)
    # re-dealing microbatch 1 puts two 450-token docs on each early lane instead of one per lane
    t0 = pool_time(mbs, lanes, 4, 1)
    mbs2, lanes2 = rebalance_single_lanes(mbs, lanes, ln, sc, 4)
    assert pool_time(mbs2, lanes2, 4, 1) < t0
    assert sorted(i for mb in mbs2 for g in mb for i in g.docs) == list(range(8))
    assert all(ln[list(g.docs)].sum() <= 1000 * g.degree for mb in mbs2 for g in mb)


def test_rebalancing_keeps_the_groups_when_the_greedy_deal_finds_no_room():
    sc = CostModel(quadratic_ms=0.0, linear_ms=1.0, microbatch_ms=0.0, comm_bytes_per_token=0.0,
                   bandwidth_gbs=((2, 1.0),), max_tokens_per_lane=10).base
    ln = np.array([5, 5, 5, 5, 4, 3, 3, 20], dtype=np.int64)

    def grp(d, docs):
        return SpGroup(degree=d, docs=tuple(docs), ms=sc.group_ms(ln[list(docs)], d))

    # lanes 0-1 are busy with doc 7; earliest-finish-first fills lane 2 with 5+5, then 5, 5, 4, 3 leave
    # no lane with room for the last 3 although the original groups fit
    mbs = [(grp(2, [7]),), (grp(1, [0, 1]), grp(1, [2, 3]), grp(1, [4, 5, 6]))]
    lanes = [[(0, 1)], [(0,), (1,), (2,)]]
    mbs2, lanes2 = rebalance_single_lanes(mbs, lanes, ln, sc, 3)
    assert mbs2 == [tuple(mbs[0]), tuple(mbs[1])] and lanes2 == lanes


def test_flexsp_non_power_of_two_lanes():
    # 6 lanes: the 350-token doc needs a 4-lane group, so a chunk of 590 tokens has no homogeneous plan
    # although it is under 6 lanes x 100 tokens; the blaster must cut smaller chunks
    cost = tiny_cost(100)
    p = plan([350, 60, 60, 60, 60], cost, world=6)
    assert max(len(g.lanes) for mb in p.pools[0].microbatches for g in mb) == 4


# ---------------------------------------------------------------------------------------------
# the MILPs against brute force
# ---------------------------------------------------------------------------------------------


def degree_multisets(num_lanes: int, degrees: list[int], max_groups: int):
    def rec(left, top):
        if left == 0:
            yield ()
            return
        for d in (x for x in degrees if x <= min(left, top)):
            for rest in rec(left - d, d):
                yield (d, *rest)

    return [m for m in rec(num_lanes, num_lanes) if len(m) <= max_groups]


def brute_force(lengths: np.ndarray, sc, num_lanes: int, degrees: list[int]) -> float:
    """Slowest group of the best plan: degrees summing to the lanes, non-empty groups, token caps."""
    best = np.inf
    for ms in degree_multisets(num_lanes, degrees, len(lengths)):
        for assign in itertools.product(range(len(ms)), repeat=len(lengths)):
            a = np.asarray(assign)
            if len(set(assign)) < len(ms):
                continue
            span = 0.0
            for g, d in enumerate(ms):
                s = lengths[a == g]
                if s.sum() > sc.max_tokens_per_lane * d:
                    span = np.inf
                    break
                span = max(span, sc.group_ms(s, d))
            best = min(best, span)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_slot_milp_equals_brute_force_on_tiny_instances(seed):
    rng = np.random.default_rng(seed)
    num_lanes = [4, 8][seed % 2]
    n = int(rng.integers(2, 6))
    ln = rng.integers(100, 3 * 1000, n).astype(np.int64)
    while ln.sum() > 1000 * num_lanes:  # one microbatch: within the pool's tokens
        ln = rng.integers(100, 3 * 1000, n).astype(np.int64)
    sc = tiny_cost(1000).base
    degrees = allowed_degrees(num_lanes)
    bk = Buckets.build(ln, sc, num_lanes, degrees)
    out = slot_milp(bk, sc, num_lanes, time_limit_s=10, node_limit=None, rel_gap=0.0)
    exact = brute_force(ln, sc, num_lanes, degrees)
    assert out.choice is not None and out.result.optimal
    assert out.choice.makespan == pytest.approx(exact, rel=1e-6)
    # the driver (greedy + exact MILP) reaches it too; the aggregated class MILP never beats it
    greedy = greedy_homogeneous(ln, sc, num_lanes, degrees)
    lower = makespan_lower_bound(ln, sc, num_lanes, degrees)
    assert lower <= exact + 1e-6
    solved = solve_microbatch(ln, sc, num_lanes, degrees, greedy, lower, time_limit_s=10, node_limit=None,
                              exact_vars=1000)
    assert solved.choice.makespan == pytest.approx(exact, rel=1e-6)
    agg = solve_microbatch(ln, sc, num_lanes, degrees, greedy, lower, time_limit_s=10, node_limit=None,
                           exact_vars=0)
    assert exact - 1e-6 <= agg.choice.makespan <= greedy.makespan + 1e-9


# ---------------------------------------------------------------------------------------------
# the policy
# ---------------------------------------------------------------------------------------------


def plan(lengths, cost=FLEX, world=64, **extra):
    items = BatchItems.from_lengths(lengths)
    p = make_plan(items, cost, PlanConfig(policy="flexsp", world_size=world, extra=extra))
    p.validate(np.asarray(lengths), cost, doc_ids=items.doc_ids)
    return p


@given(st.lists(st.integers(1, 12_000), min_size=1, max_size=40), st.sampled_from([4, 8, 16, 6, 12]),
       st.sampled_from([1, 2]))
def test_flexsp_plans_validate(lengths, world, min_degree):
    cost = tiny_cost(3000)
    cap_total = 3000 * (1 << (world.bit_length() - 1))  # the largest (power-of-two) degree holds every doc
    ln = [min(x, cap_total) for x in lengths]
    p = plan(ln, cost, world, min_degree=min_degree, max_solves=2, node_limit=50)
    greedy_only = plan(ln, cost, world, min_degree=min_degree, max_solves=0)
    assert p.predicted_ms <= greedy_only.predicted_ms + 1e-6  # the MILPs never make a step slower
    degrees = {len(g.lanes) for mb in p.pools[0].microbatches for g in mb}
    assert all(d & (d - 1) == 0 and d >= min_degree for d in degrees)
    for mb in p.pools[0].microbatches:
        assert sum(len(g.lanes) for g in mb) <= world


def test_flexsp_is_deterministic_and_beats_baselines_on_wikipedia(wiki_lengths):
    rng = np.random.default_rng(0)
    ln = wiki_lengths[wiki_lengths <= 64 * 5950]
    batch = ln[rng.permutation(len(ln))[:512]]
    a, b = plan(batch), plan(batch)
    assert a.fingerprint() == b.fingerprint() and a.notes == b.notes
    assert not any("time limit" in n or "failed" in n for n in a.notes)  # no clock, no fallback in this plan
    items = BatchItems.from_lengths(batch)
    sp = make_plan(items, FLEX, PlanConfig(policy="batch-ada", world_size=64, extra={"min_degree": 64}))
    ada = make_plan(items, FLEX, PlanConfig(policy="batch-ada", world_size=64))
    assert sp.predicted_ms / a.predicted_ms >= 1.4
    assert ada.predicted_ms / a.predicted_ms >= 1.1
    assert a.plan_seconds < 5.0


@given(st.integers(0, 10**6), st.sampled_from([2, 8, 16, 64]), st.sampled_from([1, 2]))
def test_flexsp_is_never_behind_hydra_or_batch_ada(seed, world, min_degree):
    rng = np.random.default_rng(seed)
    cost = FLEX if seed % 2 else tiny_cost(3000)
    cap = cost.base.max_tokens_per_lane
    ln = np.minimum((rng.pareto(1.1, int(rng.integers(1, 80))) * 800 + 1).astype(np.int64), cap * world)
    items = BatchItems.from_lengths(ln)
    p = plan(ln, cost, world, min_degree=min_degree, max_solves=2)
    p.validate(ln, cost, doc_ids=range(len(ln)))
    others = [("batch-ada", {"min_degree": min_degree})] + ([("hydra", {})] if min_degree == 1 else [])
    for name, extra in others:
        other = make_plan(items, cost, PlanConfig(policy=name, world_size=world, extra=extra))
        assert p.predicted_ms <= other.predicted_ms * (1 + 1e-9), name
    assert all(len(g.lanes) >= min_degree for mb in p.pools[0].microbatches for g in mb)


def test_flexsp_is_never_behind_hydra_on_tensor_parallel_lanes(wiki_lengths):
    """Wikipedia on llama3-8b/H100, 8 ranks, 32K (a sweep cell): hydra's plan on lanes of 2 TP ranks was 1.2%
    ahead of flexsp, which compared only hydra's one-rank plan with its own."""
    from balanced_loader.diagnostics import sweep

    cost = cost_preset("analytic:llama3-8b@h100", world_size=8)
    cell = sweep.cells("wikipedia", wiki_lengths, "llama3-8b@h100", cost, [8], [32768])[0]
    notes = []
    for k, b in enumerate(sweep.cell_batches(cell, wiki_lengths, cost)):
        items = BatchItems.from_lengths(b)
        flexsp = make_plan(items, cost, PlanConfig(policy="flexsp", world_size=8), k)
        hydra = make_plan(items, cost, PlanConfig(policy="hydra", world_size=8), k)
        flexsp.validate(b, cost, doc_ids=range(len(b)))
        assert flexsp.predicted_ms <= hydra.predicted_ms * (1 + 1e-9)
        notes.extend(flexsp.notes)
    assert any("hydra's plan on lanes of tp" in n for n in notes)


def test_flexsp_bad_input_and_options():
    with pytest.raises(ValueError, match="doc 1 "):
        plan([10, 64 * 5950 + 1])
    with pytest.raises(ValueError, match="unknown option"):
        plan([10], bogus=1)
    with pytest.raises(ValueError, match="power of two"):
        plan([10], min_degree=3)
    assert plan([]).pools[0].microbatches == ()


def test_flexsp_falls_back_when_the_solver_fails_or_is_missing(monkeypatch):
    import scipy.optimize

    from balanced_loader.planning.solvers import solver

    rng = np.random.default_rng(1)
    ln = rng.integers(100, 12_000, 60)
    cost = tiny_cost(3000)
    solver.reset_warnings()

    def boom(*a, **k):
        raise RuntimeError("solver exploded")

    monkeypatch.setattr(scipy.optimize, "milp", boom)
    with pytest.warns(RuntimeWarning, match="HiGHS failed"):
        p = plan(ln, cost, 16)
    assert any("greedy plan kept" in n for n in p.notes)
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    with pytest.warns(RuntimeWarning, match="unavailable"):
        p = plan(ln, cost, 16)
    assert any("unavailable" in n for n in p.notes)


def test_rebalancing_with_two_passes_moves_short_docs_to_early_lanes():
    # linear work 1 ms/token, beta 2 ms, cap 10. Lanes 0-1 run a 20-token doc until 12 ms; lanes 2-3 are
    # free at 0. One pass: each lane takes at most 10 tokens, so lanes 0-1 still get one doc each and end
    # at 12 + 2 + 9 = 23 ms. Two passes: lanes 2-3 hold all four 9-token docs in two groups each (2 + 9 +
    # 2 + 9 = 22 ms) and lanes 0-1 take nothing after their long doc.
    sc = CostModel(quadratic_ms=0.0, linear_ms=1.0, microbatch_ms=2.0, comm_bytes_per_token=0.0,
                   bandwidth_gbs=((2, 1.0),), max_tokens_per_lane=10).base
    ln = np.array([20, 9, 9, 9, 9], dtype=np.int64)

    def grp(d, docs):
        return SpGroup(degree=d, docs=tuple(docs), ms=sc.group_ms(ln[list(docs)], d))

    mbs = [(grp(2, [0]),), (grp(1, [1]), grp(1, [2]), grp(1, [3]), grp(1, [4]))]
    lanes = [[(0, 1)], [(0,), (1,), (2,), (3,)]]
    one = rebalance_single_lanes(mbs, lanes, ln, sc, 4)
    two = rebalance_single_lanes(mbs, lanes, ln, sc, 4, passes=2)
    assert pool_time(*one, 4, 1) == pytest.approx(23.0)
    assert pool_time(*two, 4, 1) == pytest.approx(22.0)
    mbs2, lanes2 = two
    assert len(mbs2) == 3  # the second groups of lanes 2-3 form an extra microbatch right after
    assert sorted(i for mb in mbs2 for g in mb for i in g.docs) == list(range(5))
    assert all(ln[list(g.docs)].sum() <= 10 * g.degree for mb in mbs2 for g in mb)
    assert {x for mb in lanes2[1:] for ln_ in mb for x in ln_} == {2, 3}
    for mb in lanes2:  # the lanes of one microbatch are disjoint
        flat = [x for ln_ in mb for x in ln_]
        assert len(flat) == len(set(flat))
