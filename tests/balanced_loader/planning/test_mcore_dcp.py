"""``mcore-dcp``: Megatron-Core main's BalancedCPScheduler, checked on hand-traced batches
(traces agree with the real scheduler of megatron-core 0.16.1, run on CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems
from balanced_loader.planning import make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.policies.mcore_dcp import gpus_needed, schedule

COST = CostModel.from_dict({"quadratic_ms": 0.0, "linear_ms": 1.0, "microbatch_ms": 1.0,
                            "comm_bytes_per_token": 0.0, "bandwidth_gbs": {2: 1.0},
                            "max_tokens_per_lane": 10})


@pytest.mark.parametrize(("s", "degree"), [(1, 1), (10, 1), (11, 2), (20, 2), (21, 4), (30, 4), (40, 4),
                                           (41, 8), (1000, 128)])
def test_memory_fit_power_of_two_degree(s, degree):
    # 2**ceil(log2(s / cap)), at least 1, with cap 10
    assert gpus_needed(s, 10) == degree


def test_round_stops_when_the_next_doc_needs_ranks_no_group_has():
    # need [4, 1, 1, 1, 1], work s^2/d = [225, 100, 100, 25, 25]; buckets [[30], [10, 10, 5, 5]].
    # The 30 takes all 4 ranks; the 10s need a size-1 group that does not exist -> next round.
    assert schedule(np.asarray([30, 10, 10, 5, 5]), 4, 10) == [
        [(0, 4, [0])], [(0, 1, [1]), (1, 1, [2]), (2, 1, [3]), (3, 1, [4])]]


def test_existing_group_with_the_lowest_load_takes_the_doc():
    # need [2, 1, 1, 1, 1]: 20 -> ranks 0-1, 8 -> rank 2, 6 -> rank 3 (new groups while ranks are
    # free); then 6 -> the lighter of {rank 2: 64, rank 3: 36} = rank 3; 2 -> rank 2 (64 < 72).
    rounds = schedule(np.asarray([20, 8, 6, 6, 2]), 4, 10)
    assert rounds == [[(0, 2, [0]), (2, 1, [1, 4]), (3, 1, [2, 3])]]
    plan = make_plan(BatchItems.from_lengths([20, 8, 6, 6, 2]), COST, PlanConfig(policy="mcore-dcp", world_size=4))
    mbs = [[(g.lanes, [s[0] for s in g.segments]) for g in mb] for mb in plan.pools[0].microbatches]
    # every doc is its own pass; a group's docs run in the order they were added
    assert mbs == [[((0, 1), [0]), ((2,), [1]), ((3,), [2])], [((2,), [4]), ((3,), [3])]]


def test_idle_ranks_are_filled_by_doubling_groups():
    # 20 -> ranks 0-1, 3 -> rank 2; five ranks idle: double the size-1 group (2), then the
    # oldest size-2 group (4, shifting the other right), then the other (4).
    assert schedule(np.asarray([20, 3]), 8, 10) == [[(0, 4, [0]), (4, 4, [1])]]


def test_plans_validate_and_rounds_follow_each_other():
    rng = np.random.default_rng(2)
    lengths = np.minimum(rng.lognormal(2.0, 1.2, 300).astype(np.int64) + 1, 160)
    plan = make_plan(BatchItems.from_lengths(lengths), COST, PlanConfig(policy="mcore-dcp", world_size=16))
    plan.validate(lengths, COST, doc_ids=range(300))
    rounds = schedule(lengths, 16, 10)
    assert len(plan.pools[0].microbatches) == sum(max(len(d) for _, _, d in r) for r in rounds)
    for rnd in rounds:  # every round covers every rank exactly once
        assert sorted(lane for first, size, _ in rnd for lane in range(first, first + size)) == list(range(16))


def test_matches_the_real_megatron_scheduler():
    mod = pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")

    class Group:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    rng = np.random.default_rng(0)
    for _ in range(50):
        ranks = int(rng.choice([1, 2, 4, 8, 16]))
        cap = int(rng.integers(2, 40))
        lengths = rng.integers(1, cap * ranks + 1, int(rng.integers(1, 60)))
        _, ids = mod.BalancedCPScheduler(cap, Group(ranks)).get_groups_and_subsamples(
            [(i, int(s)) for i, s in enumerate(lengths)], None)
        ours = []
        for rnd in schedule(lengths, ranks, cap):
            per_rank = [[] for _ in range(ranks)]
            for first, size, docs in rnd:
                for r in range(first, first + size):
                    per_rank[r] = list(docs)
            ours.append(per_rank)
        assert ours == [[list(x) for x in r] for r in ids]


def round_by_round_ms(lengths, lanes: int, cost: CostModel) -> float:
    """Megatron's execution read literally: each round lasts as long as its slowest group (its docs one
    after another), and a barrier separates the rounds; the step is the sum of the rounds."""
    sc = cost.shape(1, 1)
    total = 0.0
    for rnd in schedule(np.asarray(lengths), lanes, sc.max_tokens_per_lane):
        total += max(sum(sc.group_ms([int(lengths[i])], size) for i in docs) for _, size, docs in rnd)
    return total


def test_one_barrier_per_round_boundary_and_round_by_round_time():
    rng = np.random.default_rng(5)
    for lanes in (4, 16):
        lengths = np.minimum(rng.lognormal(2.0, 1.3, 200).astype(np.int64) + 1, 10 * lanes)
        plan = make_plan(BatchItems.from_lengths(lengths), COST, PlanConfig(policy="mcore-dcp", world_size=lanes))
        plan.validate(lengths, COST, doc_ids=range(len(lengths)))
        rounds = schedule(lengths, lanes, 10)
        starts = np.cumsum([0] + [max(len(d) for _, _, d in r) for r in rounds])  # first microbatch per round
        assert plan.pools[0].barriers == tuple(int(k) for k in starts[1:-1])
        assert len(rounds) > 2
        # with the barriers, contract-2 timing is exactly the round-by-round sum of maxima
        assert np.isclose(plan.predicted_ms, round_by_round_ms(lengths, lanes, COST), rtol=1e-9)


@pytest.mark.parametrize("lanes", [3, 5, 6, 7, 12])
def test_lane_counts_that_are_not_powers_of_two_finish(lanes):
    """Every sequence placed once, in groups inside the lanes; a sequence wider than the widest power-of-two
    group is one ValueError (it used to loop forever in ``schedule``)."""
    rng = np.random.default_rng(lanes)
    cap = 4096
    widest = 1 << (lanes.bit_length() - 1)
    for _ in range(10):
        ln = rng.integers(1, cap * widest + 1, size=int(rng.integers(1, 60)))
        placed = []
        for rnd in schedule(ln, lanes, cap):
            end = 0
            for first, size, docs in rnd:
                assert first == end and size >= 1
                end = first + size
                assert all(gpus_needed(int(ln[i]), cap) <= size for i in docs)
                placed += docs
            assert end <= lanes
        assert sorted(placed) == list(range(len(ln)))
    with pytest.raises(ValueError, match="widest power-of-two group"):
        schedule(np.array([cap * widest + 1]), lanes, cap)
