"""The one check that a step's plan can run here, before any of its work starts.

:func:`check_plan_runs_here` runs, in this order (every rank, same plan):

1. **same plan everywhere**: the plan fingerprints are all-gathered and must agree; this is
   the step's first collective, so ranks holding different plans stop with one clear error
   before they could meet in mismatched collectives;
2. **the contract**: :meth:`StepPlan.validate` (ranks cover the world, lanes in range and
   disjoint per microbatch, the segments tile exactly the step's sequences). :func:`validate_contract` is the
   only place the runtime calls it;
3. **hostable**: the recipe's model splits over every pool shape and CP degree of the plan;
4. **groups exist**: groups the plan needs that were not created yet are created,
   collectively, in the order :func:`~parallel_runtime.topology.required_groups` gives.

It returns the plan's :class:`~parallel_runtime.topology.Topology` and the number of groups
it created.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from balanced_loader.plan import BatchItems, StepPlan
from parallel_runtime.config import Recipe, check_shape
from parallel_runtime.groups import GroupCache, plan_groups
from parallel_runtime.topology import PoolShape, Topology


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans for one step."""


def check_plan_runs_here(plan: StepPlan, *, recipe: Recipe, sequences: BatchItems, groups: GroupCache,
                         comm_device: torch.device, fingerprint: str | None = None) -> tuple[Topology, int]:
    """Check ``plan`` (steps 1-4 above; collective: call on every rank); returns its topology and new groups.
    ``fingerprint``: the plan's, when the caller has it (None: computed here)."""
    check_same_plan(plan, comm_device, fingerprint)
    validate_contract(plan, sequences)
    topo = Topology(world_size=plan.world_size, pools=tuple(PoolShape.of(p) for p in plan.pools))  # lanes: validated
    check_hostable(plan, recipe)
    return topo, groups.ensure(plan_groups(plan, recipe.world.cp_engine, recipe.world.cp_inner))


def check_same_plan(plan: StepPlan, comm_device: torch.device, fingerprint: str | None = None) -> None:
    """All-gather the plan fingerprints (``fingerprint``: the plan's, None: computed here); one clear error on
    every rank when they differ."""
    fp = int((fingerprint or plan.fingerprint())[:15], 16)  # first 60 bits of the hex digest: a non-negative int64
    mine = torch.tensor([fp, plan.step], dtype=torch.int64, device=comm_device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    fps = [int(f) for f in torch.stack(every)[:, 0].tolist()]  # one read of the device (NCCL: comm_device is it)
    if len(set(fps)) > 1:
        odd = [r for r, f in enumerate(fps) if f != fps[0]]
        raise PlanMismatchError(
            f"plans differ across ranks at step {plan.step}: rank(s) {odd} disagree with rank 0 "
            f"(fingerprints {[format(f, 'x') for f in fps]}); the policy is not deterministic here: set "
            f"policy.plan_source: broadcast, or give every rank the same data, recipe and seed")


def validate_contract(plan: StepPlan, sequences: BatchItems) -> None:
    """Contract 1's invariants (ValueError naming step, pool, microbatch and doc): the plan tiles exactly the
    step's ``sequences``."""
    plan.validate(sequences)


def check_hostable(plan: StepPlan, recipe: Recipe) -> None:
    """ValueError naming the field when the recipe's model cannot run one of the plan's pool shapes."""
    for i, pool in enumerate(plan.pools):
        check_shape(recipe.model, pool.tp, pool.pp, recipe.world,
                    where=f"plan step {plan.step}, pool {i} (tp={pool.tp}, pp={pool.pp})",
                    degrees=sorted({g.degree for mb in pool.microbatches for g in mb}))
