"""Tier 1 (pure): topology and group lists over simulated worlds of up to 2,048 ranks."""

from __future__ import annotations

import time

import numpy as np
import pytest

from balanced_loader.materialize import cp_positions
from balanced_loader.plan import Group, Pool, StepPlan, single_pool_ranks
from parallel_runtime.topology import PoolShape, Topology, nested_split, required_groups

UNIFORM = [(1, 1, 1), (8, 1, 1), (8, 2, 1), (8, 1, 2), (16, 2, 2), (64, 4, 4), (96, 3, 2), (2048, 8, 4),
           (2048, 1, 1), (2048, 2, 16)]


def hetero_2048() -> Topology:
    """Three pools of different shapes, ranks interleaved (not contiguous) to catch index shortcuts."""
    perm = np.random.default_rng(0).permutation(2048)
    a = [tuple(int(x) for x in row) for row in perm[:1024].reshape(4, 256)]  # tp 8, pp 4, 32 lanes
    b = [tuple(int(x) for x in row) for row in perm[1024:1536].reshape(2, 256)]  # tp 4, pp 2, 64 lanes
    c = [tuple(int(x) for x in perm[1536:])]  # tp 1, pp 1, 512 lanes
    return Topology(world_size=2048, pools=(PoolShape(tp=8, pp=4, ranks=tuple(a)),
                                            PoolShape(tp=4, pp=2, ranks=tuple(b)),
                                            PoolShape(tp=1, pp=1, ranks=tuple(c))))


def all_topologies() -> list[Topology]:
    return [Topology.uniform(w, tp=t, pp=p) for w, t, p in UNIFORM] + [hetero_2048()]


@pytest.mark.parametrize("topo", all_topologies(), ids=lambda t: f"w{t.world_size}-{len(t.pools)}pools")
def test_coordinates_groups_and_neighbours_are_consistent(topo: Topology) -> None:
    seen_tp: set[int] = set()
    for r in range(topo.world_size):
        c = topo.coord(r)
        p = topo.pools[c.pool]
        assert p.rank(c.stage, c.lane, c.tp_index) == r
        tp = topo.tp_ranks(r)
        assert len(tp) == p.tp and tp[c.tp_index] == r
        assert all(topo.coord(x).lane == c.lane and topo.coord(x).stage == c.stage for x in tp)
        if c.tp_index == 0:
            assert not seen_tp & set(tp)
            seen_tp |= set(tp)
        prev, nxt = topo.stage_neighbours(r)
        assert (prev is None) == (c.stage == 0) and (nxt is None) == (c.stage == p.pp - 1)
        if nxt is not None:
            assert topo.stage_neighbours(nxt)[0] == r
            cn = topo.coord(nxt)
            assert (cn.pool, cn.stage, cn.lane, cn.tp_index) == (c.pool, c.stage + 1, c.lane, c.tp_index)
        pipe = topo.pipeline_ranks(r)
        assert len(pipe) == p.pp and pipe[c.stage] == r
    assert seen_tp == set(range(topo.world_size))  # TP groups partition the world


def test_uniform_grid_matches_contract_layout() -> None:
    topo = Topology.uniform(16, tp=2, pp=2)
    # stage-major, TP innermost: stage 1 holds ranks 8..15, lane 1 tp 1 of stage 1 is rank 11
    assert topo.coord(11).stage == 1 and topo.coord(11).lane == 1 and topo.coord(11).tp_index == 1
    assert topo.tp_ranks(11) == (10, 11)
    assert topo.stage_neighbours(3) == (None, 11)
    assert "stage 1: [8,9] [10,11] [12,13] [14,15]" in topo.describe()


@pytest.mark.parametrize(("pools", "world", "message"), [
    ((PoolShape(tp=2, pp=1, ranks=((0, 1, 2),)),), 3, "not a positive multiple of tp=2"),
    ((PoolShape(tp=1, pp=2, ranks=((0, 1),)),), 2, "it needs pp=2"),
    ((PoolShape(tp=1, pp=2, ranks=((0, 1), (2,))),), 3, "every stage needs the same number of lanes"),
    ((PoolShape(tp=1, pp=1, ranks=((0, 1),)), PoolShape(tp=1, pp=1, ranks=((1, 2),))), 3, "used twice"),
    ((PoolShape(tp=1, pp=1, ranks=((0, 1),)),), 3, "missing ranks [2]"),
    ((PoolShape(tp=1, pp=1, ranks=((0, 5),)),), 2, "outside the world"),
    ((PoolShape(tp=0, pp=1, ranks=((0,),)),), 1, "tp and pp must be >= 1"),
])
def test_bad_pools_fail_with_a_clear_error(pools, world, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Topology(world_size=world, pools=pools)


def _plan(world: int, tp: int, pp: int, microbatches) -> StepPlan:
    mbs = tuple(tuple(Group(lanes=tuple(lanes), segments=((i, 0, 10),)) for i, lanes in enumerate(mb))
                for mb in microbatches)
    return StepPlan(step=0, world_size=world, pools=(Pool(tp=tp, pp=pp, ranks=single_pool_ranks(world, tp, pp),
                                                          microbatches=mbs),))


def test_bad_plan_lanes_fail_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="lane 4 is outside 0..3"):
        Topology.from_plan(_plan(8, 2, 1, [[[0, 4]]]))
    with pytest.raises(ValueError, match="microbatch 1, group 1: lane 2 is in two groups"):
        Topology.from_plan(_plan(4, 1, 1, [[[0, 1]], [[2, 3], [2]]]))


def test_lane_work_gives_each_rank_its_cp_group_per_microbatch() -> None:
    # 12 ranks, tp 2, pp 1 -> 6 lanes; microbatch 0: groups [0,1,2] and [5,3]; microbatch 1: [4] only
    plan = _plan(12, 2, 1, [[[0, 1, 2], [5, 3]], [[4]]])
    topo = Topology.from_plan(plan)
    work = {r: topo.lane_work(r, plan) for r in range(12)}
    assert work[3][0].cp_ranks == (1, 3, 5) and work[3][0].lane_index == 1  # lane 1, tp index 1
    assert work[11][0].cp_ranks == (11, 7) and work[11][0].lane_index == 0  # lane 5 first in its group
    assert work[6][0].cp_ranks == (10, 6) and work[6][0].lane_index == 1  # lane 3, tp index 0
    assert work[8][0] is None and work[8][1].cp_ranks == (8,)  # lane 4 skips microbatch 0
    assert all(work[r][1] is None for r in range(12) if r not in (8, 9))


@pytest.mark.parametrize(("degree", "inner"), [(4, 2), (8, 2), (8, 4), (6, 3), (6, 2), (12, 3)])
def test_nested_split_matches_the_cp_layout(degree: int, inner: int) -> None:
    ranks = tuple(range(100, 100 + degree))
    inners, outers = nested_split(ranks, inner)
    pos = cp_positions(40 * degree, degree, inner)  # [degree][per_lane]
    outer = degree // inner
    for j, g in enumerate(inners):
        # an inner group holds, between its lanes, exactly zigzag chunks j and 2*outer-1-j
        held = np.sort(np.concatenate([pos[r - 100] for r in g]))
        chunk = 40 * degree // (2 * outer)
        want = np.concatenate([np.arange(j * chunk, (j + 1) * chunk),
                               np.arange((2 * outer - 1 - j) * chunk, (2 * outer - j) * chunk)])
        assert np.array_equal(held, want)
    for i, g in enumerate(outers):
        assert [(r - 100) % inner for r in g] == [i] * outer


@pytest.mark.parametrize("topo", all_topologies(), ids=lambda t: f"w{t.world_size}-{len(t.pools)}pools")
def test_required_groups_are_deduplicated_deterministic_and_complete(topo: Topology) -> None:
    t0 = time.perf_counter()
    specs = required_groups([topo])
    assert time.perf_counter() - t0 < 20
    keys = [s.ranks for s in specs]
    assert len(keys) == len(set(keys)) and all(len(k) > 1 and list(k) == sorted(k) for k in keys)
    assert keys == [s.ranks for s in required_groups([topo])]
    have = set(keys)
    for p in topo.pools:
        for s in range(p.pp):
            for lane in range(p.num_lanes):
                assert p.tp == 1 or tuple(sorted(p.lane_ranks(lane, s))) in have
        d = 2
        while d <= p.num_lanes:  # aligned power-of-two blocks at every stage and tp index
            for b in range(p.num_lanes // d):
                for t in range(p.tp):
                    for s in range(p.pp):
                        blk = p.cp_ranks(range(b * d, (b + 1) * d), s, t)
                        assert tuple(sorted(blk)) in have
                        for u in (2, d // 2):
                            if 1 < u < d:
                                ins, outs = nested_split(blk, u)
                                assert all(tuple(sorted(g)) in have for g in ins + outs)
            d *= 2


def test_plan_groups_that_are_not_aligned_blocks_are_added() -> None:
    plan = _plan(12, 2, 1, [[[0, 1, 2], [5, 3]], [[4, 0, 1]]])
    topo = Topology.from_plan(plan)
    base = {s.ranks for s in required_groups([topo])}
    with_plan = {s.ranks for s in required_groups([topo], plans=[plan])}
    added = with_plan - base
    assert {(0, 2, 4), (1, 3, 5), (6, 10), (7, 11), (0, 2, 8), (1, 3, 9)} <= added
    # nested inner/outer groups of a 6-lane plan group with inner size 3
    plan6 = _plan(6, 1, 1, [[[5, 4, 3, 2, 1, 0]]])
    specs = required_groups([Topology.from_plan(plan6)], plans=[plan6], inner_sizes=[3])
    have = {s.ranks for s in specs}
    assert {(3, 4, 5), (0, 1, 2), (2, 5), (1, 4), (0, 3)} <= have
    assert {s.kind for s in specs if s.ranks == (2, 5)} == {"cp_outer"}


def test_gpus_per_node_keeps_inner_groups_inside_a_node() -> None:
    topo = Topology.uniform(16, tp=2)  # 8 lanes of 2 ranks
    free = {s.ranks for s in required_groups([topo])}
    node4 = required_groups([topo], gpus_per_node=4)
    # inner size 4 on the 8-lane block spans 8 ranks = two 4-GPU nodes: its outer groups (lanes i, i+4)
    # are not created; inner size 2 (4 ranks, one node) still is
    assert (0, 8) in free and (0, 8) not in {s.ranks for s in node4}
    assert (0, 4, 8, 12) in {s.ranks for s in node4 if s.kind == "cp_outer"}
    for spec in node4:  # every outer group's inner groups stay inside one node
        if spec.kind == "cp_outer":
            lanes = [r // 2 for r in spec.ranks]
            t = spec.ranks[0] % 2
            u = lanes[1] - lanes[0]
            for lane in lanes:
                first = lane - lane % u
                assert len({(2 * x + t) // 4 for x in range(first, first + u)}) == 1
