"""Hydraulis: stage 1 kernel, stage 2 ILP against brute force, and the ``hydraulis`` policy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.batches.items import batch_bounds, to_items
from balanced_loader.batches.order import epoch_order
from balanced_loader.plan import BatchItems
from balanced_loader.planning import make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.solvers import assign
from balanced_loader.planning.solvers import candidates as cands
from balanced_loader.planning.solvers.solver import MilpResult
from balanced_loader.presets import cost_preset
from balanced_loader.simulate import serial_pool_ms

HYD = cost_preset("hydraulis-llama7b-a800")


# ---------------------------------------------------------------------------------------------
# stage 1
# ---------------------------------------------------------------------------------------------


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=25), st.integers(1, 5), st.integers(1, 6),
       st.integers(0, 3))
def test_dispatch_kernel_equals_reference(lengths, pipes, restarts, seed):
    ln = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng(seed)
    caps = np.sort(rng.integers(1000, 6000, pipes))
    caps[-1] = max(caps[-1], int(ln.max()))
    cost = ln[:, None] * rng.uniform(0.5, 2.0, pipes)[None, :] + ln[:, None] ** 2 * 1e-4  # [n, P]
    allowed = ln[:, None] <= caps[None, :]
    ppm1 = rng.integers(0, 3, pipes).astype(np.float64)
    orders = assign.dispatch_orders(ln, allowed, restarts, seed)
    a, obj = assign.dispatch_kernel(cost, allowed, ppm1, orders)
    a_ref, obj_ref = assign.dispatch_reference(cost, allowed, ppm1, orders)
    assert np.array_equal(a, a_ref) and obj == pytest.approx(obj_ref)
    assert allowed[np.arange(len(ln)), a].all()
    vals = [cost[a == p, p].sum() + ppm1[p] * cost[a == p, p].max(initial=0.0) for p in range(pipes)]
    assert max(vals) == pytest.approx(obj)


# ---------------------------------------------------------------------------------------------
# stage 2 against brute force
# ---------------------------------------------------------------------------------------------


def partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1:]


def brute_pipeline(lengths, work, cap, c, pp):
    best = np.inf
    for part in partitions(list(range(len(lengths)))):
        if all(lengths[b].sum() <= cap for b in part):
            best = min(best, serial_pool_ms(np.array([work[b].sum() for b in part]), pp, c))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_stage2_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    cap = 1000
    ln = rng.integers(50, cap + 1, n).astype(np.int64)
    work = ln * 0.1 + ln.astype(np.float64) ** 2 * 3e-4
    pp = [1, 2, 4][seed % 3]
    c = 15.0
    got = assign.pack_pipeline(ln, work, cap, c, pp, time_limit_s=10, node_limit=None, max_v=n + 1, min_gain=0.0,
                               rel_gap=0.0)
    assert got.ms == pytest.approx(brute_pipeline(ln, work, cap, c, pp), rel=1e-9)
    assert sorted(i for b in got.bins for i in b) == list(range(n))
    assert all(ln[b].sum() <= cap for b in got.bins)


@pytest.mark.parametrize("seed", range(4))
def test_minmax_ilp_equals_brute_force(seed):
    rng = np.random.default_rng(10 + seed)
    n, v, cap = 6, int(rng.integers(2, 4)), 1200
    ln = rng.integers(100, 700, n).astype(np.int64)
    work = ln.astype(np.float64) * rng.uniform(0.8, 1.2, n)
    bins, res = assign.minmax_ilp(ln, work, v, cap, time_limit_s=10, node_limit=None, rel_gap=0.0)
    best = min((max(work[b].sum() for b in p) for p in partitions(list(range(n)))
                if len(p) == v and all(ln[b].sum() <= cap for b in p)), default=np.inf)
    if np.isfinite(best):
        assert res.optimal and max(work[b].sum() for b in bins) == pytest.approx(best, rel=1e-9)
    else:
        assert bins is None


def test_stage2_keeps_greedy_when_the_ilp_fails(monkeypatch):
    def timed_out(*a, **k):
        return MilpResult(x=None, objective=np.inf, optimal=False, time_limit_hit=True, node_limit_hit=False,
                          note="MILP without solution (time limit)")

    monkeypatch.setattr(assign, "solve_milp", timed_out)
    ln = np.array([300, 300, 200, 200, 200], dtype=np.int64)  # longest-first greedy: 700 vs 600 optimal
    work = ln * 1.0
    got = assign.pack_pipeline(ln, work, 1000, 5.0, 4, time_limit_s=0.1, node_limit=10, min_gain=0.0, max_v=1)
    assert got.time_limit_hits >= 1 and got.source in ("greedy", "ffd")
    assert got.ms < np.inf and all(ln[b].sum() <= 1000 for b in got.bins)


# ---------------------------------------------------------------------------------------------
# the policy
# ---------------------------------------------------------------------------------------------


def plan(lengths, world=32, cost=HYD, **kw):
    items = BatchItems.from_lengths(lengths)
    p = make_plan(items, cost, PlanConfig(policy="hydraulis", world_size=world, **kw))
    p.validate(np.asarray(lengths), cost, doc_ids=items.doc_ids)
    return p


@given(st.lists(st.integers(1, 84_992), min_size=1, max_size=40), st.sampled_from([8, 16, 32]))
def test_hydraulis_plans_validate_with_pipelines_or_pools_of_one_shape(lengths, world):
    p = plan(lengths, world, extra={"restarts": 4})
    offset = 0
    for pool in p.pools:
        assert HYD.shape(pool.tp, pool.pp).usable
        size = pool.tp * pool.pp * pool.num_lanes
        assert sorted(r for stage in pool.ranks for r in stage) == list(range(offset, offset + size))
        offset += size
        if pool.num_lanes == 1:  # a one-lane pipeline: one group per microbatch
            assert all(len(mb) == 1 and mb[0].lanes == (0,) for mb in pool.microbatches)
    assert offset == world


@given(st.integers(0, 10**6), st.sampled_from([8, 16, 32]))
def test_hydraulis_is_never_behind_the_best_homogeneous_shape(seed, world):
    rng = np.random.default_rng(seed)
    ln = np.minimum((rng.pareto(1.0, int(rng.integers(1, 60))) * 3000 + 1).astype(np.int64), 84_992)
    p = plan(ln, world, extra={"restarts": 4})
    items = BatchItems.from_lengths(ln)
    for sc in HYD.shapes():
        if world % sc.gpus or int(ln.max()) > sc.max_tokens_per_lane * (1 << ((world // sc.gpus).bit_length() - 1)):
            continue
        homo = make_plan(items, HYD, PlanConfig(policy="hydra", world_size=world, tp=sc.tp, pp=sc.pp))
        assert p.predicted_ms <= homo.predicted_ms * (1 + 1e-9), (sc.tp, sc.pp)


def test_hydraulis_plans_docs_longer_than_one_pipeline_with_cp():
    ln = [300_000, 120_000, 5_000, 700, 90_000]  # the largest pipeline (tp 8) holds 84,992 tokens
    p = plan(ln, 32)
    wide = [g for pool in p.pools for mb in pool.microbatches for g in mb if len(g.lanes) > 1]
    assert {s[0] for g in wide for s in g.segments} >= {0, 1, 4}
    assert any("with CP inside" in n for n in p.notes)
    with pytest.raises(ValueError, match="cannot honour --cp 3"):
        plan(ln, 32, cp=3)
    assert all(len(g.lanes) == 1 for pool in plan([5_000, 700], 32, cp=1).pools
               for mb in pool.microbatches for g in mb)


def test_hydraulis_candidate_sources(tmp_path):
    rng = np.random.default_rng(2)
    ln = rng.integers(100, 20_000, 60)
    path = tmp_path / "c.yaml"
    out = cands.generate(rng.integers(100, 32_000, 2000), None, HYD, 32)
    path.write_text(cands.dumps(out, world_size=32, max_len=32768, delta_s=128, delta_n=1, fixed_cost="packed"))
    a = plan(ln, candidates=str(path))
    b = plan(ln, candidates=str(path))
    assert a.fingerprint() == b.fingerprint()
    hist = plan(ln, extra={"length_histogram": {1000: 50, 30_000: 1}})
    assert hist.predicted_ms > 0
    # a file whose candidates cannot hold the batch's longest doc: homogeneous fallback, noted
    small = [cands.normalize({(1, 2): 16})]
    path.write_text(cands.dumps(small, world_size=32, max_len=11264, delta_s=128, delta_n=1, fixed_cost="packed"))
    c = plan([500, 40_000], candidates=str(path))
    assert any("no candidate holds the 40000-token doc" in n for n in c.notes)


def test_hydraulis_bad_input():
    with pytest.raises(ValueError, match="'strategies'") as e:
        plan([100], world=8, cost=cost_preset("flexsp-gpt7b-a100"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="doc 1 \\(400000 tokens\\) fits no shape"):
        plan([10, 400_000])
    with pytest.raises(ValueError, match="unknown option"):
        plan([10], extra={"bogus": 1})
    with pytest.raises(ValueError, match="cannot read candidates file"):
        plan([10], candidates="/nonexistent/c.yaml")
    empty = plan([])
    assert sum(p.tp * p.pp for p in empty.pools) == 32 and all(not p.microbatches for p in empty.pools)


def wiki_batches(wiki_lengths, count):
    order = epoch_order(len(wiki_lengths), seed=0, epoch=0)
    items, _ = to_items(wiki_lengths[order], order, max_len=32768, long_docs="truncate")
    bounds = batch_bounds(items.lengths, 200_000)
    for b in range(count):
        sl = slice(bounds[b], bounds[b + 1])
        yield BatchItems(doc_ids=items.doc_ids[sl], starts=items.starts[sl], lengths=items.lengths[sl])


def test_hydraulis_beats_homogeneous_on_wikipedia(wiki_lengths):
    truncated = np.minimum(wiki_lengths, 32768)
    ratios = []
    for items in wiki_batches(wiki_lengths, 2):
        hyd = make_plan(items, HYD, PlanConfig(policy="hydraulis", world_size=32))
        hyd.validate(truncated, HYD, doc_ids=items.doc_ids)
        homo = []
        for c in cands.generate(items.lengths, None, HYD, 32):
            if len(c.pipelines) == 1 and c.max_tokens(HYD) >= int(items.lengths.max()):
                (tp, pp, _), = c.pipelines
                try:
                    homo.append(make_plan(items, HYD, PlanConfig(policy="maxlen", world_size=32, tp=tp,
                                                                 pp=pp)).predicted_ms)
                except ValueError as e:
                    if "not available" in str(e):
                        pytest.skip("the maxlen policy is not in this build")
        ratios.append(min(homo) / hyd.predicted_ms)
    assert np.mean(ratios) >= 1.25
