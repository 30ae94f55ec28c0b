"""Pipeline parallelism: the 1F1B order and stage split (pure), then pipelined pools on 4 gloo ranks
against the one-process reference (loss, every gradient, parameters after AdamW steps).

:func:`run_plans_exact` is the shared exactness check of this folder: it executes a list of
step plans with the runtime's pieces (groups, pull, forward_backward, push, AdamW on fixed
shards) and, on rank 0, the same steps on one whole model, and returns the largest relative
differences.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from balanced_loader.materialize import materialize_rank, num_valid_tokens
from balanced_loader.plan import Group, Pool, StepPlan, single_pool_ranks
from balanced_loader.wrapping import DatasetSource
from parallel_runtime.engines.pipeline import BACKWARD, FORWARD, schedule_1f1b, stage_layers
from parallel_runtime.groups import GroupCache, plan_groups
from parallel_runtime.model import ModelConfig, Transformer
from parallel_runtime.topology import Topology
from parallel_runtime.training.optimizer import AdamWConfig, FlatLayout, LocalParam, ShardedOptimizer
from parallel_runtime.training.params import init_params, param_specs
from parallel_runtime.training.runtime import Runtime
from parallel_runtime.training.step import forward_backward, reference_forward_backward
from parallel_runtime.training.transport import ShardExchange

TOL = 1e-5
# eps well above fp32 gradient noise: Adam divides by |g| + eps, so with eps=1e-8 a gradient element at
# the noise level (~1e-8) moves by up to lr whatever its sign; exactness of the layouts is what is tested here
OPT = AdamWConfig(lr=1e-2, eps=1e-4, weight_decay=0.1, max_grad_norm=1.0)


# ---- tier 1: pure -----------------------------------------------------------------------


@pytest.mark.parametrize(("m", "pp"), [(1, 1), (5, 1), (1, 2), (2, 4), (6, 2), (7, 4), (3, 3)])
def test_1f1b_runs_every_microbatch_once_in_dependency_order(m: int, pp: int) -> None:
    scheds = [schedule_1f1b(m, pp, s) for s in range(pp)]
    for s, ops in enumerate(scheds):
        assert sorted(k for kind, k in ops if kind == FORWARD) == list(range(m))
        assert sorted(k for kind, k in ops if kind == BACKWARD) == list(range(m))
        pos = {op: i for i, op in enumerate(ops)}
        assert all(pos[(FORWARD, k)] < pos[(BACKWARD, k)] for k in range(m))
        in_flight = max(sum(1 for kind, _ in ops[:i + 1] if kind == FORWARD) -
                        sum(1 for kind, _ in ops[:i + 1] if kind == BACKWARD) for i in range(len(ops)))
        assert in_flight <= min(pp - s, m)  # 1F1B: at most pp - stage activations held
    # simulate: blocking receives, asynchronous sends -> every stage finishes (no deadlock)
    done: set[tuple[str, int, int]] = set()
    cursor = [0] * pp
    progress = True
    while progress:
        progress = False
        for s in range(pp):
            if cursor[s] == len(scheds[s]):
                continue
            kind, k = scheds[s][cursor[s]]
            need = (FORWARD, s - 1, k) if kind == FORWARD and s > 0 else (BACKWARD, s + 1, k) if kind == BACKWARD \
                and s < pp - 1 else None
            if need is None or need in done:
                done.add((kind, s, k))
                cursor[s] += 1
                progress = True
    assert all(cursor[s] == len(scheds[s]) for s in range(pp))


def test_stage_layers_split_contiguously() -> None:
    assert [list(stage_layers(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        stage_layers(2, 3, 0)


# ---- the exactness check shared by the multi-rank tests ----------------------------------------


def plan_json(world: int, pools: list[tuple[int, int, int, list[list[tuple[tuple[int, ...], list[int]]]]]],
              step: int = 0) -> dict:
    """A step plan from ``(tp, pp, offset, microbatches)`` pools; each microbatch is a list of
    ``(lanes, doc lengths)`` groups. Doc ids are numbered in order of appearance from ``1000 * step``."""
    doc = 1000 * step
    out = []
    for tp, pp, offset, mbs in pools:
        lanes = max((max(g[0]) for mb in mbs for g in mb), default=0) + 1
        micro = []
        for mb in mbs:
            groups = []
            for lanes_, lengths in mb:
                segs = []
                for n in lengths:
                    segs.append((doc, 0, n))
                    doc += 1
                groups.append(Group(lanes=tuple(lanes_), segments=tuple(segs)))
            micro.append(tuple(groups))
        out.append(Pool(tp=tp, pp=pp, ranks=single_pool_ranks(tp * pp * lanes, tp, pp, offset),
                        microbatches=tuple(micro)))
    return StepPlan(step=step, world_size=world, pools=tuple(out)).to_json()


def run_plans_exact(rank: int, world: int, cases: list[dict]) -> list[dict] | None:
    """Execute each case's plans (one optimizer step each) here and, on rank 0, on one whole model.

    A case: ``model`` (ModelConfig kwargs), ``plans`` (plan JSON, one per step), ``engine`` and
    ``inner`` (the CP engine and the layout's Ulysses size), ``seed``. Rank 0 returns per case
    the largest relative differences of loss, gradient and parameters after the last step.
    """
    out = []
    for case in cases:
        cfg = ModelConfig(**case["model"])
        plans = [StepPlan.from_json(p, world) for p in case["plans"]]
        lengths: dict[int, int] = {}
        for plan in plans:
            for pool in plan.pools:
                for mb in pool.microbatches:
                    for g in mb:
                        lengths.update({d: n for d, _, n in g.segments})
        rng = np.random.default_rng(case["seed"])
        docs = [rng.integers(0, cfg.vocab_size, size=lengths.get(d, 1)) for d in range(max(lengths) + 1)]
        source = DatasetSource(docs)
        specs = param_specs(cfg)
        opt = ShardedOptimizer(FlatLayout(specs, world), init_params(cfg, case["seed"]), OPT, rank=rank)
        xc = ShardExchange(opt)
        groups = GroupCache(rank=rank)
        rt = Runtime(cfg, rank=rank, device=torch.device("cpu"), dtype=torch.float32, attention="masked",
                     groups=groups, specs=specs)
        losses, grads = [], []
        for plan in plans:
            groups.ensure(plan_groups(plan, case["engine"], case["inner"]))
            topo = Topology.from_plan(plan)
            sm = rt.stage_model(topo)
            xc.pull(sm.params)
            mbs = materialize_rank(plan, rank, source, cp_inner=case["inner"])
            res = forward_backward(rt, sm, plan, topo, mbs, num_valid_tokens(plan))
            xc.push(sm.params)
            for lp in sm.params:
                lp.tensor.grad = None
            loss = torch.tensor([res.loss_sum], dtype=torch.float64)
            dist.all_reduce(loss)
            losses.append(float(loss))
            grads.append(opt.gather_grad())
            opt.step()
        params = opt.gather_full()
        if rank != 0:
            out.append(None)
            continue
        ref_opt = ShardedOptimizer(FlatLayout(specs, 1), init_params(cfg, case["seed"]), OPT)
        ref_xc = ShardExchange(ref_opt)
        model = Transformer(cfg, seed=None)
        local = [LocalParam(spec=next(s for s in specs if s.name == n), tensor=p) for n, p in model.named_parameters()]
        worst = {"loss": 0.0, "grad": 0.0, "params": 0.0}
        n = ref_opt.layout.numel
        for plan, loss, grad in zip(plans, losses, grads):
            ref_xc.pull(local)
            ref = reference_forward_backward(model, plan, source, num_valid_tokens(plan), device=torch.device("cpu"))
            ref_xc.push(local)
            for lp in local:
                lp.tensor.grad = None
            g_ref = ref_opt.gather_grad()[:n]
            worst["loss"] = max(worst["loss"], abs(loss - ref.loss_sum) / abs(ref.loss_sum))
            worst["grad"] = max(worst["grad"], float((grad[:n] - g_ref).abs().max() / g_ref.abs().max()))
            ref_opt.step()
        p_ref = ref_opt.gather_full()[:n]
        worst["params"] = float((params[:n] - p_ref).abs().max() / p_ref.abs().max())
        worst["name"] = case["name"]
        out.append(worst)
    return out if rank == 0 else None


def check(results: list[dict]) -> None:
    for r in results:
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["params"] <= TOL, json.dumps(r)


# ---- tier 3: four ranks --------------------------------------------------------------------

TINY = {"vocab_size": 256, "hidden": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
        "ffn_hidden": 64}


def _pipeline_cases() -> list[dict]:
    w = 4
    uneven = [[((0,), [17, 5])], [((0,), [40])], [((0,), [3, 9, 12])], [((0,), [1, 26])], [((0,), [8])]]
    # pp=4 over one lane; pp=2 over two lanes (lanes idle in some microbatches, uneven lengths)
    pp4 = plan_json(w, [(1, 4, 0, uneven)])
    pp2 = plan_json(w, [(1, 2, 0, [[((0,), [30]), ((1,), [7, 7])], [((1,), [50])], [((0,), [2, 11])],
                                   [((1,), [4])], [((0,), [19])]])], step=1)
    # CP groups inside a pipelined pool, in the pattern a per-lane 1F1B would deadlock on:
    # lane 0 runs microbatches [0, 2], lane 1 [0, 1, 2], microbatches 0 and 2 are CP groups of both
    cross = plan_json(w, [(1, 2, 0, [[((0, 1), [45, 6])], [((1,), [12, 3])], [((1, 0), [33])]])], step=2)
    # one pipeline of 2 stages beside a 2-lane pool: no pipeline (pp=1) and pp=2 in one step
    side = plan_json(w, [(1, 2, 0, [[((0,), [21])], [((0,), [6, 6, 6])]]),
                         (1, 1, 2, [[((0, 1), [40])], [((0,), [9]), ((1,), [13, 2])]])], step=3)
    return [
        {"name": "pp4 then pp2 then cross then side", "model": TINY, "plans": [pp4, pp2, cross, side],
         "engine": "ring", "inner": 1, "seed": 1},
    ]


@pytest.mark.multirank
def test_1f1b_pipelines_equal_the_reference_on_four_ranks() -> None:
    check(run_distributed(run_plans_exact, 4, _pipeline_cases(), timeout=240)[0])
