"""The exchange's per-step record: what moved since the last take, frozen, and nothing counted twice.

The bytes, buckets and sums themselves are tests/parallel_runtime/training/test_slices.py's (one 4-rank world)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parallel_runtime.training.optimizer import AdamWConfig, FlatLayout, LocalParam, ParamSpec, ShardedOptimizer
from parallel_runtime.training.transport import ExchangeStats, ShardExchange

SPECS = [ParamSpec(name="w", shape=(6, 4), tp_dim=0), ParamSpec(name="n", shape=(4,), decay=False)]


def _setup(bucket_elems: int) -> tuple[ShardedOptimizer, ShardExchange, list[LocalParam]]:
    opt = ShardedOptimizer(FlatLayout(SPECS, 1), {"w": torch.randn(6, 4), "n": torch.ones(4)}, AdamWConfig())
    local = [LocalParam(spec=s, tensor=torch.nn.Parameter(torch.empty(s.shape))) for s in SPECS]
    return opt, ShardExchange(opt, bucket_elems=bucket_elems), local


def test_each_take_holds_what_moved_since_the_last_one() -> None:
    opt, xc, local = _setup(bucket_elems=5)
    assert xc.take_stats() == ExchangeStats()  # nothing moved yet
    xc.pull(local)
    pull = xc.take_stats()
    assert pull.bytes_pulled == pull.bytes_pull_sent == 4 * 28 and pull.bytes_pushed == 0
    assert pull.exchanges >= 28 // 5 and 0 < pull.peak_bucket_elems <= 5 and pull.plans_built == 1
    for lp in local:
        lp.tensor.grad = torch.ones_like(lp.tensor)
    xc.push(local)
    push = xc.take_stats()
    assert push.bytes_pulled == 0 and push.bytes_pushed == push.bytes_push_received == 4 * 28
    assert push.plans_built == 0  # the pull's plan: the same slices, cached
    both = pull + push
    assert (both.bytes_pulled, both.bytes_pushed, both.exchanges) == (4 * 28, 4 * 28, pull.exchanges + push.exchanges)
    assert both.peak_bucket_elems == max(pull.peak_bucket_elems, push.peak_bucket_elems)
    assert torch.equal(opt.grad, torch.ones(28))
    with pytest.raises(dataclasses.FrozenInstanceError):
        both.bytes_pulled = 0  # a record is read, never zeroed
    assert xc.buffer_bytes > 0  # the buffers stay for the next step


def test_bucket_elems_is_checked() -> None:
    opt, _, _ = _setup(bucket_elems=5)
    with pytest.raises(ValueError, match="bucket_elems must be >= 1"):
        ShardExchange(opt, bucket_elems=0)
