"""Pull and push overlapped with forward/backward, the fused optimizer step, the step's time breakdown and
the per-step peak that leaves the kernel's counters alone.

The overlapped exchange moves the same buckets as the one after the backward and sums each element's
contributions in the same order, so a run with ``train.overlap`` equals one without it bit for bit:
4 gloo ranks of cpu-hetero.yaml (a 2-stage pipeline beside a pool with CP groups), buckets of 4,096
elements so that many are in flight while the backward runs.
"""

from __future__ import annotations

import resource
import time

import pytest
import torch
from distributed import run_distributed
from test_trainer import HETERO, small_run

from parallel_runtime.training import optimizer as O
from parallel_runtime.training.breakdown import KEYS, StepTimes
from parallel_runtime.training.optimizer import AdamWConfig, FlatLayout, ParamSpec, ShardedOptimizer
from parallel_runtime.training.peaks import PeakProbe, resident_bytes


def _runs(rank: int, world: int, sets: list[str], tmp: str) -> dict:
    from parallel_runtime.config import load_recipe
    from parallel_runtime.training import trainer as T

    T.BUCKET_ELEMS = 4096  # many buckets: most go while the backward still runs
    out = {}
    for on in (True, False):
        t = T.Trainer(load_recipe(HETERO, [*sets, f"train.overlap={str(on).lower()}"]), f"{tmp}/{on}")
        ms = t.train(2)
        out[on] = {"loss": [m["loss"] for m in ms], "norm": [m["grad_norm"] for m in ms],
                   "bytes": [(m["pull_bytes"], m["push_bytes"]) for m in ms], "master": t.optimizer.master.clone(),
                   "overlapped": dict(t.overlap.overlapped) if t.overlap else None, "last": ms[-1]}
    return out


@pytest.mark.multirank
def test_overlapped_pull_and_push_equal_the_sequential_ones_bit_for_bit(tmp_path) -> None:
    res = run_distributed(_runs, 4, small_run(tmp_path), str(tmp_path), timeout=300)
    for rank, r in enumerate(res):
        on, off = r[True], r[False]
        assert on["loss"] == off["loss"] and on["norm"] == off["norm"] and on["bytes"] == off["bytes"]
        assert torch.equal(on["master"], off["master"]), rank
        # whole-model ranks (pool 1) and the last pipeline stage send gradient buckets from the hooks
        if rank != 0:
            assert on["overlapped"]["push"] > 0, (rank, on["overlapped"])
        assert off["overlapped"] is None
    last = res[0][True]["last"]
    times = last["time_ms"]
    assert set(times) == set(KEYS) and all(len(v) == 4 and min(v) >= 0 for v in times.values())
    assert max(times["forward_backward"]) > 0 and max(times["optimizer"]) > 0
    phases = sum(times[k][0] for k in ("plan_check", "pull", "forward_backward", "push", "optimizer", "closed_loop",
                                       "other"))
    assert phases == pytest.approx(last["step_ms"], rel=0.05)
    assert len(last["memory"]["peak_exact"]) == 4


def _shared_runs(rank: int, world: int, sets: list[str], tmp: str) -> dict:
    from parallel_runtime.config import load_recipe
    from parallel_runtime.training import trainer as T
    from parallel_runtime.training.runtime import GradBuffer

    attach, share_master = GradBuffer.attach, O.ShardedOptimizer.share_master
    out = {}
    for shared, overlap in ((True, True), (False, True), (True, False)):
        # unshared: the buffers are never offered as the optimizer's shards (it keeps buffers of its own)
        GradBuffer.attach = attach if shared else (lambda self, params, layout=None: attach(self, params))
        O.ShardedOptimizer.share_master = share_master if shared else (lambda self, full: None)
        t = T.Trainer(load_recipe(HETERO, [*sets, f"train.overlap={str(overlap).lower()}"]), f"{tmp}/{shared}{overlap}")
        ms = t.train(3)
        out[shared, overlap] = {"loss": [m["loss"] for m in ms], "norm": [m["grad_norm"] for m in ms],
                                "master": t.optimizer.master.clone(),
                                "shared": (t.optimizer.grad_shared, t.optimizer.master_shared),
                                "optimizer_bytes": ms[-1]["memory"]["optimizer_bytes"]}
    GradBuffer.attach, O.ShardedOptimizer.share_master = attach, share_master
    return out


@pytest.mark.multirank
def test_the_shards_inside_the_working_parameters_and_gradients_change_nothing(tmp_path) -> None:
    res = run_distributed(_shared_runs, 4, small_run(tmp_path), str(tmp_path), timeout=300)
    for rank, r in enumerate(res):
        ref = r[False, True]
        assert ref["shared"] == (False, False)
        # ranks 2-3 hold the whole model (pool 1): their master and gradient shards live in the working
        # parameters and gradients; the pipeline stages (ranks 0-1) hold half of it each and keep their own
        for key in ((True, True), (True, False)):
            assert r[key]["shared"] == (rank >= 2, rank >= 2), (rank, key)
            assert r[key]["loss"] == ref["loss"] and r[key]["norm"] == ref["norm"], (rank, key)
            assert torch.equal(r[key]["master"], ref["master"]), (rank, key)
    shard = res[0][False, True]["master"].numel() * 4
    mine, theirs = res[0][True, True]["optimizer_bytes"], res[0][False, True]["optimizer_bytes"]
    assert mine[:2] == theirs[:2] and [b + 2 * shard for b in mine[2:]] == theirs[2:]


def test_the_fused_step_equals_the_chunked_one() -> None:
    assert O._FUSED_ADAMW is not None  # torch 2.13 has the CPU kernel
    specs = [ParamSpec(name="w", shape=(37, 5)), ParamSpec(name="n", shape=(5,), decay=False),
             ParamSpec(name="b", shape=(11,))]
    g = torch.Generator().manual_seed(0)
    init = {s.name: torch.randn(s.shape, generator=g) for s in specs}
    for rank in range(3):  # the shard boundaries cut through runs with and without weight decay
        fused, chunked = (ShardedOptimizer(FlatLayout(specs, 3), init, AdamWConfig(weight_decay=0.1), rank=rank)
                          for _ in range(2))
        for step in range(3):
            grad = torch.randn(fused.grad.shape, generator=torch.Generator().manual_seed(10 * step + rank))
            for opt, run in ((fused, fused._fused_step), (chunked, chunked._chunked_step)):
                opt.grad.copy_(grad)
                opt.steps += 1
                run(1e-2)
        assert torch.allclose(fused.master, chunked.master, rtol=1e-6, atol=1e-7)
        assert torch.allclose(fused.exp_avg_sq, chunked.exp_avg_sq, rtol=1e-6, atol=1e-9)


def test_step_times_add_up_and_reset() -> None:
    t = StepTimes()
    with t.phase("forward_backward"):
        pass
    t.add("optimizer", 0.002)
    t.add("data_wait", 0.5)
    rec = t.record(10.0, None)
    assert rec["optimizer"] == [2.0] and rec["data_wait"] == [500.0]
    assert rec["other"][0] == pytest.approx(10.0 - 2.0 - rec["forward_backward"][0], abs=1e-3)
    assert t.record(0.0, None)["optimizer"] == [0.0]


def test_the_peak_probe_sees_a_step_peak_and_leaves_the_kernel_counters() -> None:
    # an earlier high point of this process: what getrusage / GNU time / SLURM report as its peak
    big = torch.ones(64 << 18)  # 64 MiB, touched
    del big
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    probe = PeakProbe(torch.device("cpu"), interval_s=0.001)
    try:
        probe.reset()
        x = torch.ones(32 << 18)  # 32 MiB in the "step", held for a moment
        time.sleep(0.05)
        del x
        peak = probe.peak()
        assert peak >= probe.base + (24 << 20)
        assert not probe.exact  # below the process's earlier high: a sampled figure
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= before  # never reset
        probe.reset()  # a step that sets a new high for the process: the kernel's own mark, exactly
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # whatever ran before set it
        above = hwm - resident_bytes() + (32 << 20)
        y = torch.ones(above // 4)
        del y
        probe.peak()
        assert probe.exact
    finally:
        probe.close()


def test_uncovered_ranges_are_the_complement_of_the_windows() -> None:
    from parallel_runtime.training.exchange import Bucket, uncovered

    def bk(a: int, b: int) -> Bucket:
        return Bucket(mine_n=[], peer_n=[], ps=None, pe=None, parts=(), a=a, b=b)

    assert uncovered((bk(4, 8), bk(0, 2)), 10) == [(2, 4), (8, 10)]
    assert uncovered((bk(0, 10),), 10) == []
    assert uncovered((), 5) == [(0, 5)]


def test_flattened_parameters_are_views_of_one_buffer_with_their_values() -> None:
    from parallel_runtime.model import ModelConfig, Transformer
    from parallel_runtime.training.params import local_params, param_specs
    from parallel_runtime.training.runtime import GradBuffer, flatten_params, in_layout_order

    cfg = ModelConfig(vocab_size=32, hidden=16, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden=24)
    model = Transformer(cfg, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = [id(p) for p in model.parameters()]
    specs = param_specs(cfg)
    params = local_params(model, {s.name: s for s in specs})
    flatten_params(params)
    base = params[0].tensor.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in model.parameters())
    assert [id(p) for p in model.parameters()] == ids  # the same Parameter objects
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    layout = FlatLayout(specs, 3)
    assert in_layout_order(params, layout) and not in_layout_order(params[1:], layout)
    full = GradBuffer(torch.device("cpu")).attach(params, layout)
    assert full is not None and full.numel() == layout.padded and not full.any()
    assert params[1].tensor.grad.data_ptr() == full[layout.offsets[1]:].data_ptr()


def test_the_peak_probe_samples_from_the_models_hooks_without_a_thread() -> None:
    import threading

    from torch import nn

    class Hold(nn.Module):
        """Keeps a touched 32 MiB tensor from its forward until the test drops it."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))
            self.kept: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.kept.append(torch.ones(8 << 20))
            return x * self.w

    big = torch.ones(96 << 18)  # an earlier high of this process (96 MiB): the step's figure is a sample
    del big
    model = nn.Sequential(Hold(), Hold())
    threads = threading.active_count()
    probe = PeakProbe(torch.device("cpu"), interval_s=None)
    try:
        probe.watch(model)
        probe.watch(model)  # idempotent: one set of hooks
        probe.reset()
        model(torch.ones(4)).sum().backward()
        for m in model:
            m.kept.clear()  # gone before the step ends: only a sample taken inside it can see them
        peak = probe.peak()
        assert threading.active_count() == threads
        assert not probe.exact and peak >= probe.base + (56 << 20)
    finally:
        probe.close()
    probe.reset()  # closed: hooks removed, nothing sampled
    model(torch.ones(4)).sum().backward()
