"""Contract 1: plan types, JSON round trip, fingerprint, and every validate() invariant."""

from __future__ import annotations

import json

import numpy as np
import pytest

from balanced_loader.cost import CostModel
from balanced_loader.plan import Group, Plan, Pool, StepPlan, single_pool_ranks
from balanced_loader.simulate import step_ms

COST = CostModel.from_dict({
    "quadratic_ms": 1e-3, "linear_ms": 0.1, "microbatch_ms": 1.0, "comm_bytes_per_token": 1e6,
    "bandwidth_gbs": {2: 100.0, 8: 10.0}, "max_tokens_per_lane": 100,
    "strategies": [{"tp": 2, "pp": 2, "max_tokens_per_lane": 400}],
})
LENGTHS = np.array([150, 40, 60, 30])


def make(microbatches, tp=1, pp=1, world=4) -> StepPlan:
    pool = Pool(tp=tp, pp=pp, ranks=single_pool_ranks(world, tp, pp), microbatches=microbatches)
    return StepPlan(step=3, world_size=world, pools=(pool,))


def good() -> StepPlan:
    return make((
        (Group(lanes=(0, 1), segments=((0, 0, 150),)), Group(lanes=(2,), segments=((1, 0, 40), (2, 0, 60)))),
        (Group(lanes=(3,), segments=((3, 0, 30),)),),
    ))


def test_valid_plan_passes_and_round_trips():
    p = good()
    p.validate(LENGTHS, COST, doc_ids=range(4))
    text = Plan(policy="x", world_size=4, steps=(p,)).dumps()
    d = json.loads(text)
    assert d["format"] == "balanced-loader/plan" and d["version"] == 1 and d["world_size"] == 4
    back = Plan.from_json(d).steps[0]
    assert back == p
    assert back.fingerprint() == p.fingerprint()


def test_fingerprint_ignores_timing_but_not_content():
    p = good()
    assert p.with_timing(plan_seconds=9.0, predicted_ms=1.0).fingerprint() == p.fingerprint()
    other = make(((Group(lanes=(0, 1), segments=((0, 0, 150),)),),))
    assert other.fingerprint() != p.fingerprint()


@pytest.mark.parametrize("mbs, world, message", [
    ((((Group(lanes=(0, 1), segments=((0, 0, 150),)), Group(lanes=(1,), segments=((1, 0, 40),))),)), 4,
     "lane 1 is in two groups of one microbatch"),
    ((((Group(lanes=(5,), segments=((1, 0, 40),)),),)), 4, "lane 5 is outside"),
    ((((Group(lanes=(0,), segments=((1, 0, 20),)),),)), 4, "doc 1 covers 20 of its 40 tokens"),
    ((((Group(lanes=(0,), segments=((1, 0, 40),)), Group(lanes=(1,), segments=((1, 10, 30),))),)), 4,
     "overlaps"),
    ((((Group(lanes=(0,), segments=((0, 0, 150),)),),)), 4, "exceed max_tokens_per_lane 100"),
    ((((Group(lanes=(0,), segments=((9, 0, 10),)),),)), 4, "doc 9 is not in the length index"),
])
def test_invalid_plans_name_the_problem(mbs, world, message):
    with pytest.raises(ValueError, match=message) as e:
        make(mbs, world=world).validate(LENGTHS, COST)
    assert "step 3" in str(e.value)


def test_missing_docs_and_ranks():
    p = make(((Group(lanes=(0,), segments=((1, 0, 40),)),),))
    with pytest.raises(ValueError, match=r"docs missing from the plan \[0, 2, 3\]"):
        p.validate(LENGTHS, COST, doc_ids=range(4))
    pool = Pool(tp=1, pp=1, ranks=((0, 1, 2),), microbatches=())
    with pytest.raises(ValueError, match=r"missing ranks \[3\]"):
        StepPlan(step=0, world_size=4, pools=(pool,)).validate(LENGTHS)


def test_shape_must_be_in_cost_file_and_tp_pp_grid():
    p = make(((Group(lanes=(0,), segments=((0, 0, 150),)),),), tp=2, pp=2, world=8)
    p.validate(LENGTHS, COST)  # tp=2, pp=2 holds 400 tokens per lane
    assert p.pools[0].num_lanes == 2 and p.pools[0].rank(1, 1, 1) == 7
    with pytest.raises(ValueError, match="shape tp=4, pp=1 is not in the cost file"):
        make(((Group(lanes=(0,), segments=((1, 0, 40),)),),), tp=4, world=8).validate(LENGTHS, COST)


def test_structure_checks_without_lengths_and_caps_from_any_mapping():
    # the runtime's view: no length index, caps from anything with lane_cap(tp, pp)
    class Caps:
        def lane_cap(self, tp: int, pp: int) -> int:
            return {(1, 1): 100}[(tp, pp)]

    good().validate(caps=Caps())
    good().validate()
    with pytest.raises(ValueError, match="lane 1 is in two groups"):
        make(((Group(lanes=(0, 1), segments=((0, 0, 150),)), Group(lanes=(1,), segments=((1, 0, 40),))),)).validate()
    with pytest.raises(ValueError, match="doc 1 segment at 10 leaves a gap before token 0"):
        make(((Group(lanes=(0,), segments=((1, 10, 30),)),),)).validate()
    with pytest.raises(ValueError, match="exceed max_tokens_per_lane 100"):
        make(((Group(lanes=(0,), segments=((0, 0, 150),)),),)).validate(caps=Caps())


def test_rank_grid():
    pool = Pool(tp=2, pp=2, ranks=single_pool_ranks(8, 2, 2), microbatches=())
    assert pool.lane_ranks(1, stage=1) == (6, 7)
    assert pool.group_ranks((1, 0), stage=0, tp_index=1) == (3, 1)


def test_plan_file_errors(tmp_path):
    with pytest.raises(ValueError, match="not a plan file"):
        Plan.from_json({"steps": []})
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        Plan.load(str(bad))
    with pytest.raises(ValueError, match="cannot read plan file"):
        Plan.load(str(tmp_path / "missing.json"))


def test_empty_step_is_valid():
    p = make(())
    p.validate(LENGTHS, COST, doc_ids=[])
    assert step_ms(p, COST) == 0.0


def with_barriers(p: StepPlan, barriers: tuple[int, ...]) -> StepPlan:
    pool = p.pools[0]
    return StepPlan(step=p.step, world_size=p.world_size, pools=(
        Pool(tp=pool.tp, pp=pool.pp, ranks=pool.ranks, microbatches=pool.microbatches, barriers=barriers),))


def test_barriers_round_trip_and_enter_the_fingerprint():
    p = good()
    assert "barriers" not in p.pools[0].to_json()  # plans without barriers keep their bytes
    b = with_barriers(p, (1,))
    b.validate(LENGTHS, COST, doc_ids=range(4))
    d = json.loads(Plan(policy="x", world_size=4, steps=(b,)).dumps())
    assert d["steps"][0]["pools"][0]["barriers"] == [1]
    back = Plan.from_json(d).steps[0]
    assert back == b and back.pools[0].barriers == (1,)
    assert back.fingerprint() == b.fingerprint() != p.fingerprint()
    # a barrier waits for every lane: never faster than the same placements without it
    assert step_ms(b, COST) >= step_ms(p, COST)


@pytest.mark.parametrize("barriers, message", [
    ((0,), r"barrier before microbatch 0 is outside 1\.\.1"),
    ((2,), r"barrier before microbatch 2 is outside 1\.\.1"),
    ((1, 1), r"barriers must be sorted and unique, got \[1, 1\]"),
])
def test_invalid_barriers_name_the_problem(barriers, message):
    with pytest.raises(ValueError, match=message) as e:
        with_barriers(good(), barriers).validate(LENGTHS, COST)
    assert "step 3, pool 0" in str(e.value) and "\n" not in str(e.value)


def test_unsorted_barriers_are_rejected():
    three = make(tuple((Group(lanes=(k,), segments=((k, 0, int(LENGTHS[k])),)),) for k in range(1, 4))
                 + ((Group(lanes=(0, 1), segments=((0, 0, 150),)),),))
    three.validate(LENGTHS, COST)
    with_barriers(three, (1, 3)).validate(LENGTHS, COST)
    with pytest.raises(ValueError, match=r"sorted and unique, got \[3, 1\]"):
        with_barriers(three, (3, 1)).validate(LENGTHS, COST)


def test_column_groups_read_as_plain_groups() -> None:
    import copy
    import pickle

    from balanced_loader.plan import SegmentColumns, column_groups, segment_lengths

    cols = SegmentColumns(np.array([5, 6, 7]), np.array([0, 0, 3]), np.array([10, 20, 30]))
    lazy = column_groups([(0,), (1, 2)], [0, 1, 3], cols)
    plain = [Group(lanes=(0,), segments=((5, 0, 10),)), Group(lanes=(1, 2), segments=((6, 0, 20), (7, 3, 30)))]
    assert lazy == plain and plain == lazy and [hash(g) for g in lazy] == [hash(g) for g in plain]
    assert lazy[1] != plain[0] and plain[0] != lazy[1]
    assert [g.to_json() for g in lazy] == [g.to_json() for g in plain] and lazy[1].tokens == 50
    for back in (pickle.loads(pickle.dumps(lazy[1])), copy.deepcopy(lazy[1])):
        assert type(back) is Group and back == plain[1]
    lengths, nseg = segment_lengths(lazy)
    assert lengths.tolist() == [10, 20, 30] and nseg.tolist() == [1, 2]
    assert segment_lengths(lazy[::-1]) is None and segment_lengths(plain) is None  # not read in order


def test_a_policys_column_groups_time_and_hash_as_their_json() -> None:
    from balanced_loader.plan import BatchItems, ColumnGroup
    from balanced_loader.planning import make_plan
    from balanced_loader.planning.config import PlanConfig

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 400, size=300)
    plan = make_plan(BatchItems.from_lengths(lengths), COST, PlanConfig(policy="hydra", world_size=8))
    assert all(type(g) is ColumnGroup for mb in plan.pools[0].microbatches for g in mb)
    again = StepPlan.from_json(json.loads(json.dumps(plan.to_json())), 8)  # plain groups
    assert all(type(g) is Group for mb in again.pools[0].microbatches for g in mb)
    assert again.pools == plan.pools and again.fingerprint() == plan.fingerprint()
    assert step_ms(again, COST) == step_ms(plan, COST)  # the arrays' fast path times what the tuples do
    plan.validate(lengths, caps=COST)
