"""``batch-ada``: FlexSP's BatchAda, the best single SP degree with best-fit-decreasing bins."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.cost import CostModel
from balanced_loader.plan import BatchItems
from balanced_loader.planning import make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.planning.solvers.bins import lpt_blocks

COST = CostModel(quadratic_ms=2e-4, linear_ms=0.5, microbatch_ms=40.0, comm_bytes_per_token=4e6,
                 bandwidth_gbs=((2, 100.0), (4, 20.0), (8, 5.0)), max_tokens_per_lane=1000)


def plan(lengths, world=8, cost=COST, **extra):
    items = BatchItems.from_lengths(lengths)
    p = make_plan(items, cost, PlanConfig(policy="batch-ada", world_size=world, extra=extra))
    p.validate(np.asarray(lengths), cost, doc_ids=items.doc_ids)
    return p


def degrees_of(p) -> set[int]:
    return {len(g.lanes) for mb in p.pools[0].microbatches for g in mb}


@given(st.lists(st.integers(1, 8000), min_size=1, max_size=60), st.sampled_from([1, 2, 8, 16]),
       st.sampled_from([0.5, 0.9, 1.0]))
def test_batch_ada_plans_validate_with_one_degree(lengths, world, fill):
    ln = [min(x, 1000 * world) for x in lengths]
    p = plan(ln, world, fill=fill)
    ds = degrees_of(p)
    assert len(ds) == 1
    d = ds.pop()
    assert d & (d - 1) == 0 and max(ln) <= 1000 * d
    for mb in p.pools[0].microbatches:  # groups sit on aligned blocks
        assert all(g.lanes == tuple(range(g.lanes[0], g.lanes[0] + d)) and g.lanes[0] % d == 0 for g in mb)


def test_batch_ada_picks_the_fastest_degree():
    rng = np.random.default_rng(0)
    ln = rng.integers(50, 3500, 80)
    best = plan(ln)
    per_degree = [plan(ln, min_degree=d).predicted_ms for d in (4, 8) if ln.max() <= 1000 * d]
    # min_degree d allows d and larger; the unrestricted plan is at least as fast as every restriction
    assert all(best.predicted_ms <= t + 1e-9 for t in per_degree)
    assert min(degrees_of(best)) >= 4  # 3500 tokens need 4 lanes


def test_fill_controls_bin_size():
    ln = [600] * 16
    tight = plan(ln, fill=1.0, min_degree=8)
    loose = plan(ln, fill=0.5, min_degree=8)
    assert max(g.tokens for mb in tight.pools[0].microbatches for g in mb) == 7800
    assert max(g.tokens for mb in loose.pools[0].microbatches for g in mb) <= 4000


def test_lpt_blocks():
    block, pos = lpt_blocks(np.array([5.0, 1.0, 4.0, 3.0, 3.0]), 2)
    assert block.tolist() == [0, 1, 1, 1, 0]  # 5->0, 4->1, 3->1, 3->0, 1->1
    loads = np.bincount(block, weights=[5.0, 1.0, 4.0, 3.0, 3.0])
    assert loads.max() == 8.0
    assert pos.tolist() == [0, 2, 0, 1, 1]


def test_batch_ada_bad_input():
    with pytest.raises(ValueError, match="doc 2 "):
        plan([1, 2, 8001])
    with pytest.raises(ValueError, match="fill"):
        plan([1], fill=0)
    with pytest.raises(ValueError, match="unknown option"):
        plan([1], nope=True)
    assert plan([]).pools[0].microbatches == ()
