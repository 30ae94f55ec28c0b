"""Failures never hang: a rank that raises (or stalls) ends the whole world with a clear error."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from distributed import WorldError, run_distributed

from parallel_runtime.diagnostics.selfcheck import main as selfcheck_main
from parallel_runtime.engines.context import make_engine
from parallel_runtime.groups import GroupCache
from parallel_runtime.topology import Topology


def _raise_mid_training(rank: int, world: int) -> int:
    x = torch.ones(4)
    for step in range(1000):
        if rank == 1 and step == 3:
            raise ValueError(f"boom at step {step}")
        dist.all_reduce(x)
        x /= world
    return 0


def _raise_inside_ring(rank: int, world: int) -> None:
    groups = GroupCache.build([Topology.uniform(world)])
    eng = make_engine("ring", groups, tuple(range(world)), rank)
    attn = eng.bind([64, 7])
    q = torch.randn(72 // world * 1, 2, 8)
    if rank == 2:
        raise RuntimeError("rank 2 lost its device")
    attn(q, q[:, :1], q[:, :1]).sum().backward()


def _stall(rank: int, world: int) -> None:
    if rank == 2:
        time.sleep(1000)
    dist.all_reduce(torch.ones(2))


@pytest.mark.multirank
def test_a_rank_that_raises_ends_every_rank_with_a_clear_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_distributed(_raise_mid_training, 3, timeout=60, grace=20)
    msg = str(info.value)
    assert time.monotonic() - t0 < 45
    assert msg.startswith("rank 1 failed first: ValueError: boom at step 3"), msg
    assert "traceback of rank 1" in msg and "_raise_mid_training" in msg
    # the others failed on their own (a broken collective), well before the grace period ended
    for r in (0, 2):
        line = next(line for line in msg.splitlines() if line.startswith(f"  rank {r} (after rank 1 failed): "))
        assert "terminated" not in line, msg


@pytest.mark.multirank
def test_a_rank_that_raises_inside_ring_attention_does_not_hang_its_peers() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorldError, match="rank 2 failed first: RuntimeError: rank 2 lost its device"):
        run_distributed(_raise_inside_ring, 4, timeout=60, grace=20)
    assert time.monotonic() - t0 < 45


@pytest.mark.multirank
def test_a_stalled_rank_times_out() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_distributed(_stall, 3, timeout=6, grace=2)
    assert time.monotonic() - t0 < 25
    assert "rank 2: no result" in str(info.value)


def test_selfcheck_rejects_a_bad_layout_in_one_line(capsys) -> None:
    assert selfcheck_main(["--world-size", "6", "--tp", "4", "--cp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "selfcheck: --world-size 6 is not divisible by tp x cp = 4 x 2 = 8"
    assert selfcheck_main(["--world-size", "4", "--cp", "4", "--cp-engine", "ulysses", "--kv-heads", "2"]) == 2
    assert "Ulysses degree 4 must divide the KV heads per TP rank (2 / tp 1 = 2)" in capsys.readouterr().err
    assert selfcheck_main(["--world-size", "3", "--cp", "3", "--cp-engine", "nested"]) == 2
    assert "cp=3 has none" in capsys.readouterr().err
