"""Slice-exact pull/push of the fixed optimizer shards.

Every rank receives exactly the elements of its (pool, stage, tp index) slices and sends back
exactly its gradient slices, in bounded buckets: pulled values equal the full parameters'
slices bit for bit, pushed shards equal the one-process sum, and the byte counters equal the
slice sizes (4 bytes per element). One 4-rank gloo world runs layouts of changing shapes
(tp=2 beside two tp=1 pipeline stages, tp=2 x pp=2, tp=4 with an idle rank, a rank with no
parameters at all, the first layout again) with a bucket of 7 elements (many buckets,
parameters split across buckets and across owners) and with the default bucket.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

from parallel_runtime.training.optimizer import AdamWConfig, FlatLayout, LocalParam, ParamSpec, ShardedOptimizer
from parallel_runtime.training.transport import ExchangeStats, ShardExchange

# 235 elements, padded to 4 shards of 59: most parameters straddle an owner boundary
SPECS = [ParamSpec(name="emb", shape=(8, 6), tp_dim=0), ParamSpec(name="wq", shape=(6, 8), tp_dim=1),
         ParamSpec(name="n1", shape=(6,), decay=False), ParamSpec(name="w3", shape=(4, 8, 3), tp_dim=1),
         ParamSpec(name="wo", shape=(8, 4), tp_dim=1), ParamSpec(name="n2", shape=(5,), decay=False)]
STAGES = [["emb", "wq", "n1"], ["w3", "wo", "n2"]]
ALL = STAGES[0] + STAGES[1]

# per step, per rank: (param names, tp index, tp size, has gradients)
STEPS = [
    [(ALL, 0, 2, True), (ALL, 1, 2, True), (STAGES[0], 0, 1, True), (STAGES[1], 0, 1, True)],  # tp=2 | pp=2
    [(STAGES[0], 0, 2, True), (STAGES[0], 1, 2, True), (STAGES[1], 0, 2, True), (STAGES[1], 1, 2, True)],  # 2x2
    [(ALL, 0, 4, True), (ALL, 1, 4, True), (ALL, 2, 4, True), (ALL, 3, 4, False)],  # tp=4, rank 3 idle
    [(ALL, 0, 1, True), (ALL, 0, 1, True), ([], 0, 1, True), (ALL, 0, 1, True)],  # rank 2 holds nothing
    [(ALL, 0, 2, True), (ALL, 1, 2, True), (STAGES[0], 0, 1, True), (STAGES[1], 0, 1, True)],  # step 0 again
]
SPEC = {s.name: s for s in SPECS}


def _init() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g) for s in SPECS}


def _grad(step: int, rank: int, name: str, shape: torch.Size) -> torch.Tensor:
    """Small integers: any summation order is exact."""
    g = torch.Generator().manual_seed(step * 1000 + rank * 100 + ALL.index(name))
    return torch.randint(-8, 9, shape, generator=g).float()


def _params(names: list[str], ti: int, ts: int) -> list[LocalParam]:
    out = []
    for n in names:
        shape = list(SPEC[n].shape)
        if SPEC[n].tp_dim is not None:
            shape[SPEC[n].tp_dim] //= ts
        out.append(LocalParam(spec=SPEC[n], tensor=torch.nn.Parameter(torch.full(shape, float("nan"))), tp_index=ti,
                              tp_size=ts))
    return out


def _local(step: int, rank: int) -> list[LocalParam]:
    names, ti, ts, _ = STEPS[step][rank]
    return _params(names, ti, ts)


def _contributes(lp: LocalParam) -> bool:
    return lp.spec.tp_dim is not None or lp.tp_index == 0


def _world(rank: int, world: int) -> dict[str, list[dict]]:
    return {"small": _steps(rank, world, 7), "default": _steps(rank, world, 8 << 20)}


def _steps(rank: int, world: int, bucket_elems: int) -> list[dict]:
    opt = ShardedOptimizer(FlatLayout(SPECS, world), iter(_init().items()), AdamWConfig(), rank=rank)
    xc = ShardExchange(opt, bucket_elems=bucket_elems)
    out = []
    run = ExchangeStats()  # every step so far
    for step in range(len(STEPS)):
        local = _local(step, rank)
        xc.pull(local)
        pull = xc.take_stats()
        pulled = {lp.spec.name: lp.tensor.detach().clone() for lp in local}
        if STEPS[step][rank][3]:
            for lp in local:
                lp.tensor.grad = _grad(step, rank, lp.spec.name, lp.tensor.shape)
        xc.push(local)
        s = pull + xc.take_stats()
        run = run + s
        out.append({"pulled": pulled, "grad": opt.gather_grad(),
                    "bytes": [s.bytes_pulled, s.bytes_pull_sent, s.bytes_pushed, s.bytes_push_received, s.exchanges],
                    "pull_exchanges": pull.exchanges, "plans": run.plans_built, "peak": run.peak_bucket_elems})
    return out


def _reference(step: int, world: int) -> tuple[torch.Tensor, list[int], list[int], list[int], list[int]]:
    """The summed full gradient, and per rank the elements pulled / pushed and served / collected as owner."""
    layout = FlatLayout(SPECS, world)
    full = torch.zeros(layout.padded)
    where = torch.arange(layout.padded)  # flat index of every element -> its owner
    pulled, pushed, served, collected = [0] * world, [0] * world, [0] * world, [0] * world
    for rank in range(world):
        for lp in _local(step, rank):
            idx = layout.slice_view(where, lp).reshape(-1)
            owners = torch.bincount(idx // layout.shard_size, minlength=world).tolist()
            pulled[rank] += idx.numel()
            served = [a + b for a, b in zip(served, owners)]
            if STEPS[step][rank][3] and _contributes(lp):
                layout.slice_view(full, lp).add_(_grad(step, rank, lp.spec.name, lp.tensor.shape))
                pushed[rank] += idx.numel()
                collected = [a + b for a, b in zip(collected, owners)]
    return full, pulled, pushed, served, collected


def _check(res: list[list[dict]], world: int) -> None:
    layout = FlatLayout(SPECS, world)
    init = _init()
    for step in range(len(STEPS)):
        full, pulled, pushed, served, collected = _reference(step, world)
        for rank in range(world):
            r = res[rank][step]
            for lp in _local(step, rank):  # bit-exact slices of the initial parameters
                flat = torch.cat([init[s.name].reshape(-1) for s in SPECS] + [torch.zeros(layout.padded - 235)])
                assert torch.equal(r["pulled"][lp.spec.name], layout.slice_view(flat, lp)), (step, rank, lp.spec.name)
            assert torch.equal(r["grad"], full), (step, rank)  # exactly the one-process sum
            assert r["bytes"][:4] == [4 * pulled[rank], 4 * served[rank], 4 * pushed[rank], 4 * collected[rank]], \
                (step, rank, r["bytes"])
    assert sum(pulled) > 0 and sum(pushed) > 0


@pytest.mark.multirank
def test_pull_push_move_exactly_the_slices() -> None:
    res = run_distributed(_world, 4, timeout=120)
    small, default = [r["small"] for r in res], [r["default"] for r in res]
    _check(small, 4)
    _check(default, 4)
    # 7-element buckets: many collectives, never a buffer above the bound; the default: one per pull
    assert all(s["pull_exchanges"] >= 10 and s["peak"] <= 7 for r in small for s in r)
    assert all(s["pull_exchanges"] == 1 for r in default for s in r)
    # exchange plans are cached per set of layouts: step 4 repeats step 0 and derives none
    for r in small + default:
        assert r[-1]["plans"] == r[-2]["plans"] > 0


def test_one_process_many_buckets_and_overlapping_slices() -> None:
    """World size 1 runs the same exchange without a collective: tp=2 halves of strided parameters and a
    replicated one twice in one local list, 3-element buckets."""
    opt = ShardedOptimizer(FlatLayout(SPECS, 1), _init(), AdamWConfig())
    xc = ShardExchange(opt, bucket_elems=3)
    local = _params(ALL, 0, 2) + _params(ALL, 1, 2)
    xc.pull(local)
    layout = FlatLayout(SPECS, 1)
    flat = torch.cat([_init()[s.name].reshape(-1) for s in SPECS])
    for lp in local:
        assert torch.equal(lp.tensor.detach(), layout.slice_view(flat, lp))
        lp.tensor.grad = torch.ones_like(lp.tensor)
    xc.push(local)
    # every TP-split element once from its half; replicated n1, n2 only from tp index 0
    assert torch.equal(opt.grad, torch.ones(235))
    sizes = sum(lp.tensor.numel() for lp in local)
    moved = xc.take_stats()
    assert moved.bytes_pulled == 4 * sizes and moved.bytes_pushed == 4 * (sizes - 11)
    assert moved.exchanges >= 2 * 235 // 3 and moved.peak_bucket_elems <= 3


def test_bf16_working_parameters_round_trip() -> None:
    """Working parameters in bf16: pulled values are the fp32 slices rounded once; bf16 gradients land exactly."""
    opt = ShardedOptimizer(FlatLayout(SPECS, 1), _init(), AdamWConfig())
    xc = ShardExchange(opt, bucket_elems=5)
    local = [LocalParam(spec=lp.spec, tensor=torch.nn.Parameter(lp.tensor.detach().bfloat16()), tp_index=lp.tp_index,
                        tp_size=lp.tp_size) for lp in _params(ALL, 1, 2)]
    xc.pull(local)
    layout = FlatLayout(SPECS, 1)
    flat = torch.cat([_init()[s.name].reshape(-1) for s in SPECS])
    for lp in local:
        assert lp.tensor.dtype == torch.bfloat16
        assert torch.equal(lp.tensor.detach(), layout.slice_view(flat, lp).bfloat16())
        lp.tensor.grad = torch.full_like(lp.tensor, 0.5)
    xc.push(local)  # tp index 1: the replicated n1, n2 are not contributed
    expect = torch.zeros(235)
    for lp in local:
        if lp.spec.tp_dim is not None:
            layout.slice_view(expect, lp).fill_(0.5)
    assert torch.equal(opt.grad, expect)


def test_bad_local_layouts_fail_in_one_line() -> None:
    xc = ShardExchange(ShardedOptimizer(FlatLayout(SPECS, 1), _init(), AdamWConfig()))
    with pytest.raises(ValueError, match=r"wq: the working tensor has shape \(6, 8\), its slice \(tp 0/2\) has "
                                         r"\(6, 4\)"):
        xc.pull([LocalParam(spec=SPEC["wq"], tensor=torch.nn.Parameter(torch.empty(6, 8)), tp_size=2)])
    with pytest.raises(ValueError, match="wo: dim 1 of size 4 is not divisible by tp=3"):
        xc.pull([LocalParam(spec=SPEC["wo"], tensor=torch.nn.Parameter(torch.empty(8, 1)), tp_size=3)])
    with pytest.raises(ValueError, match="bucket_elems must be >= 1"):
        ShardExchange(ShardedOptimizer(FlatLayout(SPECS, 1), _init(), AdamWConfig()), bucket_elems=0)
