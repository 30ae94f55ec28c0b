"""Reliability III (issue 38): a user's dynamic-CP loop under DDP whose ranks run different numbers of
microbatches. Iterating ``batch.microbatches`` with a backward (an all-reduce) on each, as with ``cp=1``,
hung forever on every rank; now every rank refuses at its first forward, in one line naming
``bind.microbatches`` and ``no_sync``, from the plan alone (no collective). The documented loop
(``bind.microbatches`` with ``no_sync`` on all but the rank's last) trains and agrees across ranks.

Two real gloo ranks, a real ``DistributedDataParallel``; ``run_distributed``'s timeout bounds the test
itself, so a regression fails instead of hanging.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

tr = pytest.importorskip("transformers")

from distributed import run_distributed  # noqa: E402

from balanced_loader.materialize import materialize_rank  # noqa: E402
from balanced_loader.plan import Group, Pool, StepPlan  # noqa: E402
from balanced_loader.wrapping import DatasetSource  # noqa: E402


def _plan() -> StepPlan:
    """Rank 0 runs two microbatches, rank 1 one (docs 0 and 2 on lane 0, doc 1 on lane 1)."""
    mbs = ((Group(lanes=(0,), segments=((0, 0, 24),)), Group(lanes=(1,), segments=((1, 0, 40),))),
           (Group(lanes=(0,), segments=((2, 0, 16),)),))
    return StepPlan(step=0, world_size=2, pools=(Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=mbs),))


def _per_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from parallel_runtime.integrations import enable_context_parallel

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 128, n) for n in (24, 40, 16)]
    plan = _plan()
    batch = SimpleNamespace(step=0, plan=plan, rank=rank, num_valid_tokens=77,
                            microbatches=tuple(materialize_rank(plan, rank, DatasetSource(docs))))
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    bind = enable_context_parallel(model)
    out: dict = {"count": len(batch.microbatches)}
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    try:  # the loop of the issue: every microbatch's backward all-reduces (was: every rank waits forever)
        for mb in batch.microbatches:
            with bind(mb, plan=batch.plan):
                ddp(**mb.to_hf()).loss.backward()
        out["bad"] = "trained"
    except ValueError as e:
        out["bad"] = str(e)
    model.zero_grad(set_to_none=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    mbs = bind.microbatches(batch)
    for i, mb in enumerate(mbs):  # the documented loop
        sync = contextlib.nullcontext() if i == len(mbs) - 1 else ddp.no_sync()
        with sync, bind(mb, plan=batch.plan):
            ddp(**mb.to_hf()).loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    other = grad.clone()
    dist.broadcast(other, src=0)
    out["same_grads"] = bool(torch.equal(grad, other))
    return out


@pytest.mark.multirank
def test_a_loop_that_all_reduces_every_microbatch_is_refused_on_every_rank_not_a_hang():
    res = run_distributed(_per_rank, 2, timeout=180)
    assert [r["count"] for r in res] == [2, 1]
    for r in res:
        line = r["bad"]
        assert "\n" not in line and "bind.microbatches" in line and "no_sync" in line, line
        assert "ranks run 1 to 2" in line or "after microbatch 0 of its 2" in line, line
    assert all(r["same_grads"] for r in res)
