"""Heterogeneous pools with one fixed optimizer layout, and dynamic CP groups per microbatch.

In one 4-rank gloo world: a push of one matrix held in two layouts at once (split over tp=2
on ranks 0-1, whole on ranks 2-3) lands in one set of coordinates; then steps whose pools
change shape from step to step (tp=2 beside pp=2, four lanes with CP groups of 2 and 4,
tp=2 x pp=2, a pool with no work at all) are executed with pull / forward_backward / push /
AdamW on the fixed shards, and compared with the one-process reference after every step
(loss, full gradient) and at the end (parameters). The same plans run with the ring engine
and with the nested engine (2-lane groups Ulysses, 4-lane groups Ulysses x ring), so each
microbatch selects its own cached groups and engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed import run_distributed
from test_pipeline import TINY, check, plan_json, run_plans_exact

from balanced_loader.plan import StepPlan
from parallel_runtime.training.optimizer import AdamWConfig, FlatLayout, LocalParam, ParamSpec, ShardedOptimizer
from parallel_runtime.training.transport import ShardExchange


def _plans(tp2_cp: bool) -> list[dict]:
    w = 4
    cp_tp2 = [((0, 1), [37])] if tp2_cp else [((0,), [20]), ((1,), [17])]
    return [
        # step 0: a tp=2 lane (ranks 0-1) beside a 2-stage pipeline (ranks 2-3)
        plan_json(w, [(2, 1, 0, [[((0,), [25, 4])], [((0,), [11])]]),
                      (1, 2, 2, [[((0,), [30])], [((0,), [5, 9])], [((0,), [14])]])], step=0),
        # step 1: four lanes, CP groups of 4 and 2 lanes per microbatch, idle lanes skip
        plan_json(w, [(1, 1, 0, [[((0, 1, 2, 3), [61, 3])], [((2, 3), [27]), ((0,), [8, 8])],
                                 [((1, 0), [22])], [((3,), [6])]])], step=1),
        # step 2: tp=2 x pp=2 over all four ranks
        plan_json(w, [(2, 2, 0, [[((0,), [19])], [((0,), [33, 2])], [((0,), [7])]])], step=2),
        # step 3: two tp=2 lanes (a CP group of both with ring) ; step 4: one pool idle the whole step
        plan_json(w, [(2, 1, 0, [cp_tp2, [((1,), [12])]])], step=3),
        plan_json(w, [(1, 1, 0, [[((0, 1), [29])], [((1,), [9])]]), (1, 2, 2, [])], step=4),
    ]


def _cases() -> list[dict]:
    return [
        {"name": "ring", "model": TINY, "plans": _plans(tp2_cp=True), "engine": "ring", "inner": 1, "seed": 2},
        {"name": "nested 2", "model": TINY, "plans": _plans(tp2_cp=False), "engine": "nested", "inner": 2,
         "seed": 3},
    ]


def test_plans_are_valid() -> None:
    for case in _cases():
        for p in case["plans"]:
            plan = StepPlan.from_json(p, 4)
            lengths = {d: n for pool in plan.pools for mb in pool.microbatches for g in mb for d, _, n in g.segments}
            plan.validate(np.array([lengths.get(i, 1) for i in range(max(lengths) + 1)]))


def _world(rank: int, world: int, cases: list[dict]) -> dict:
    return {"push_pull": _push_pull(rank, world), "plans": run_plans_exact(rank, world, cases)}


@pytest.mark.multirank
def test_pools_of_changing_shapes_share_one_optimizer_layout_exactly() -> None:
    res = run_distributed(_world, 4, _cases(), timeout=240)
    check(res[0]["plans"])
    _check_push_pull(res)


def _push_pull(rank: int, world: int) -> dict:
    """Two layouts of one 8x6 matrix in one step: ranks 0-1 hold it split over tp=2 (dim 0),
    ranks 2-3 hold it whole (tp=1); a replicated vector everywhere. Push must sum all of them."""
    specs = [ParamSpec(name="w", shape=(8, 6), tp_dim=0), ParamSpec(name="n", shape=(6,), decay=False)]
    init = {"w": torch.arange(48, dtype=torch.float32).view(8, 6) / 10, "n": torch.ones(6)}
    opt = ShardedOptimizer(FlatLayout(specs, world), init, AdamWConfig(max_grad_norm=0.0), rank=rank)
    xc = ShardExchange(opt)
    tp_size, tp_index = (2, rank) if rank < 2 else (1, 0)
    w = torch.nn.Parameter(torch.empty(8 // tp_size, 6))
    n = torch.nn.Parameter(torch.empty(6))
    local = [LocalParam(spec=specs[0], tensor=w, tp_index=tp_index, tp_size=tp_size),
             LocalParam(spec=specs[1], tensor=n, tp_index=tp_index, tp_size=tp_size)]
    xc.pull(local)
    pulled = w.detach().clone()
    w.grad = torch.full_like(w, float(rank + 1))
    n.grad = torch.full_like(n, float(rank + 1))
    xc.push(local)
    moved = xc.take_stats()
    return {"pulled": pulled, "grad": opt.gather_grad()[:54], "bytes": (moved.bytes_pulled, moved.bytes_pushed)}


def _check_push_pull(results: list[dict]) -> None:
    res = [r["push_pull"] for r in results]
    full = torch.arange(48, dtype=torch.float32).view(8, 6) / 10
    assert torch.equal(res[0]["pulled"], full[:4]) and torch.equal(res[1]["pulled"], full[4:])
    assert torch.equal(res[2]["pulled"], full) and torch.equal(res[3]["pulled"], full)
    w = torch.zeros(8, 6)
    w[:4] += 1  # rank 0's half
    w[4:] += 2  # rank 1's half
    w += 3 + 4  # ranks 2 and 3 whole
    n = torch.full((6,), 1.0 + 3 + 4)  # replicated: tp index 0 of each TP group only (ranks 0, 2, 3)
    assert torch.equal(res[0]["grad"], torch.cat([w.reshape(-1), n]))
    # exactly the slices: 24 + 6 elements on the tp=2 ranks (rank 1 pushes no replicated n), 48 + 6 on the others
    assert [r["bytes"] for r in res] == [(30 * 4, 30 * 4), (30 * 4, 24 * 4), (54 * 4, 54 * 4), (54 * 4, 54 * 4)]


# ---- the pools policy (pure) ---------------------------------------------------------------


def test_pools_policy_plans_valid_heterogeneous_steps() -> None:
    from balanced_loader.cost import CostModel
    from balanced_loader.plan import BatchItems
    from balanced_loader.planning import make_plan
    from balanced_loader.planning.config import PlanConfig

    cost = CostModel.from_dict({"quadratic_ms": 2e-5, "linear_ms": 0.04, "microbatch_ms": 5.0,
                                "comm_bytes_per_token": 4096, "bandwidth_gbs": {2: 0.6}, "max_tokens_per_lane": 512,
                                "strategies": [{"tp": 1, "pp": 2, "max_tokens_per_lane": 1024}]})
    config = PlanConfig(policy="pools", world_size=4, extra={"pools": [{"tp": 1, "pp": 2, "lanes": 1},
                                                                       {"tp": 1, "pp": 1, "lanes": 2}]})
    rng = np.random.default_rng(0)
    for step in range(20):
        lengths = np.minimum(rng.lognormal(5.5, 1.0, size=int(rng.integers(1, 30))).astype(int) + 1, 1024)
        plan = make_plan(BatchItems.from_lengths(lengths), cost, config, step)
        plan.validate(lengths, cost, doc_ids=range(len(lengths)))  # every doc once, lane caps respected
        assert [(p.tp, p.pp, p.ranks) for p in plan.pools] == [(1, 2, ((0,), (1,))), (1, 1, ((2, 3),))]
        wide = [g for mb in plan.pools[1].microbatches for g in mb if g.degree == 2]
        assert all(g.tokens > 0 for g in wide)
        if (lengths > 512).sum() >= 4:  # too much long work for pool 0 alone: pool 1 runs some as CP groups
            assert wide, step
    with pytest.raises(ValueError, match=r"extra.pools hold 2 \+ 1 = 3 ranks .* but the world has 4"):
        make_plan(BatchItems.from_lengths([5]), cost, PlanConfig(policy="pools", world_size=4, extra={
            "pools": [{"tp": 1, "pp": 2, "lanes": 1}, {"tp": 1, "pp": 1, "lanes": 1}]}))
    with pytest.raises(ValueError, match=r"doc 0 \(3000 tokens\) fits no pool: the largest holds 1024 tokens"):
        make_plan(BatchItems.from_lengths([3000]), cost, config)
    with pytest.raises(ValueError, match=r"extra.pools\[0\]: unknown key\(s\) \['cp'\]"):
        make_plan(BatchItems.from_lengths([5]), cost, PlanConfig(policy="pools", world_size=4, extra={
            "pools": [{"tp": 1, "pp": 1, "lanes": 4, "cp": 2}]}))
