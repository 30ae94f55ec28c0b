"""Tensor parallel layers and the 1-rank gloo tier.

Tier 2 (one gloo rank): groups of one rank, the whole selfcheck path with world size 1.
Tier 3 (two gloo ranks): each TP layer in float64 against the unsplit torch op, values and
gradients, then the model with tp 2 and with two data-parallel lanes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed

from parallel_runtime.diagnostics.selfcheck import LayoutSpec, run_rank
from parallel_runtime.engines.context import LocalAttention, make_engine
from parallel_runtime.engines.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    shard,
    vocab_parallel_cross_entropy,
)
from parallel_runtime.groups import GroupCache
from parallel_runtime.topology import Topology


def _world1(rank: int, world: int) -> dict:
    groups = GroupCache.build([Topology.uniform(1)])
    out = {"num_groups": len(groups), "single": groups.get([0]) is None}
    try:
        groups.get([0, 1])
    except ValueError as e:
        out["missing"] = str(e)
    out["local"] = isinstance(make_engine("ring", groups, (0,), 0), LocalAttention)
    out["check"] = run_rank(rank, world, LayoutSpec(world_size=1))
    return out


@pytest.mark.multirank
def test_one_rank_world() -> None:
    (res,) = run_distributed(_world1, 1)
    assert res["num_groups"] == 0 and res["single"] and res["local"]
    assert "was not pre-created" in res["missing"]
    assert res["check"]["ok"] and res["check"]["max_rel_diff_grad"] < 1e-6


def _tp_layers(rank: int, world: int) -> dict:
    tp = TensorParallel(size=world, index=rank, group=dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    errs = {}

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).detach().abs().max())

    # column-parallel: y = x W^T, W [6, 5] split by rows
    w, x, gy = (torch.randn(*s, generator=g, dtype=f64) for s in ((6, 5), (3, 5), (3, 6)))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (F.linear(xr, wr) * gy).sum().backward()
    col = ColumnParallelLinear(5, 6, tp, dtype=f64)
    with torch.no_grad():
        col.weight.copy_(shard(w, 0, tp))
    xl = x.clone().requires_grad_()
    y = col(xl)
    (y * shard(gy, 1, tp)).sum().backward()
    errs["column_y"] = err(y, shard(F.linear(x, w), 1, tp))
    errs["column_dx"] = err(xl.grad, xr.grad)  # all-reduced over TP in backward
    errs["column_dw"] = err(col.weight.grad, shard(wr.grad, 0, tp))
    # row-parallel: W [4, 6] split by columns, input split the same way
    w, x, gy = (torch.randn(*s, generator=g, dtype=f64) for s in ((4, 6), (3, 6), (3, 4)))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (F.linear(xr, wr) * gy).sum().backward()
    row = RowParallelLinear(6, 4, tp, dtype=f64)
    with torch.no_grad():
        row.weight.copy_(shard(w, 1, tp))
    xl = shard(x, 1, tp).clone().requires_grad_()
    y = row(xl)
    (y * gy).sum().backward()
    errs["row_y"] = err(y, F.linear(x, w))
    errs["row_dx"] = err(xl.grad, shard(xr.grad, 1, tp))
    errs["row_dw"] = err(row.weight.grad, shard(wr.grad, 1, tp))
    # vocab-parallel embedding: ids from both halves of the vocab
    w = torch.randn(10, 3, generator=g, dtype=f64)
    ids = torch.tensor([0, 9, 4, 5, 5, 1, 7])
    gy = torch.randn(7, 3, generator=g, dtype=f64)
    wr = w.clone().requires_grad_()
    (F.embedding(ids, wr) * gy).sum().backward()
    emb = VocabParallelEmbedding(10, 3, tp, dtype=f64)
    with torch.no_grad():
        emb.weight.copy_(shard(w, 0, tp))
    y = emb(ids)
    (y * gy).sum().backward()
    errs["embed_y"] = err(y, F.embedding(ids, w))
    errs["embed_dw"] = err(emb.weight.grad, shard(wr.grad, 0, tp))
    # vocab-parallel cross-entropy with ignored labels
    logits = torch.randn(6, 10, generator=g, dtype=f64) * 3
    labels = torch.tensor([3, -100, 9, 0, 5, -100])
    gl = torch.rand(6, generator=g, dtype=f64)
    lr = logits.clone().requires_grad_()
    ref = F.cross_entropy(lr, labels, ignore_index=-100, reduction="none")
    (ref * gl).sum().backward()
    ll = shard(logits, 1, tp).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(ll, labels, tp)
    (loss * gl).sum().backward()
    errs["ce_loss"] = err(loss, ref)
    errs["ce_dlogits"] = err(ll.grad, shard(lr.grad, 1, tp))
    checks = [run_rank(rank, world, LayoutSpec(world_size=2, tp=2, seed=12)),
              run_rank(rank, world, LayoutSpec(world_size=2, tp=1, seed=13, hidden=32))]
    return {"errs": errs, "checks": checks}


@pytest.mark.multirank
def test_tp_layers_and_model_on_two_ranks() -> None:
    results = run_distributed(_tp_layers, 2)
    for res in results:
        for name, e in res["errs"].items():
            assert e < 1e-12, (name, e)
    for check in results[0]["checks"]:
        assert check["ok"], check


def test_tp_size_must_divide_shapes() -> None:
    with pytest.raises(ValueError, match="vocab_size \\(10\\) is not divisible by the tensor-parallel size 3"):
        VocabParallelEmbedding(10, 4, TensorParallel(size=3, index=0, group=object()))
    with pytest.raises(ValueError, match="needs a process group"):
        TensorParallel(size=2, index=0)
