"""The entry point under real launchers, when things go wrong and across "nodes".

* a rank stopped with SIGSTOP ends every other rank within the collective timeout (subgroups
  included), each saying what it waited in;
* bad input on a rank other than 0 is printed by that rank, and its peers name it;
* a fresh (nonexistent) ``data.shards_dir``: rank 0 builds the stdlib corpus while the others wait;
* ``torchrun --nnodes 2 --nproc-per-node 2`` (two "nodes" on this machine) equals ``--reference``.

Ranks are started the way ``srun`` does it (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR set per
process: rank 0 hosts the store) or by ``torchrun`` (its agent hosts the store).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_trainer import HETERO, REPO, _free_port, reference_losses, small_run

from parallel_runtime.config import load_recipe
from parallel_runtime.groups import GroupCache, declared_groups
from parallel_runtime.launch import world_timeout_s
from parallel_runtime.topology import GroupSpec, Topology
from parallel_runtime.training.metrics import read_metrics
from parallel_runtime.training.trainer import declared_topologies

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _cmd(out: Path, sets: list[str], *extra: str) -> list[str]:
    return ["-m", "parallel_runtime", "--recipe", HETERO, "--out", str(out), *extra,
            *(x for s in sets for x in ("--set", s))]


def _start_ranks(world: int, args: list[str], tmp: Path,
                 extra: dict[int, list[str]] | None = None) -> list[subprocess.Popen]:
    """``world`` processes with the launcher variables set directly (as ``srun`` would); stderr to files.
    ``extra[r]``: arguments only rank ``r`` gets (to make one rank's input differ)."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = {**ENV, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        err = open(tmp / f"rank{r}.err", "w")  # noqa: SIM115 (closed with the process by the test)
        procs.append(subprocess.Popen([sys.executable, *args, *(extra or {}).get(r, [])], env=env, cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=err))
    return procs


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _err(tmp: Path, r: int) -> str:
    return (tmp / f"rank{r}.err").read_text()


def test_declared_tp_and_cp_groups_stay_inside_a_node() -> None:
    # 8 nodes x 8 GPUs; torchrun numbers ranks node by node (rank // LOCAL_WORLD_SIZE = node)
    recipe = load_recipe(str(REPO / "recipes" / "gpu-h100x64-hetero.yaml"))
    gpn = recipe.cost_model().gpus_per_node
    specs = declared_groups(declared_topologies(recipe), recipe.world.cp_engine, recipe.world.cp_inner)
    inside = {kind: all(len({r // gpn for r in s.ranks}) == 1 for s in specs if s.kind == kind and len(s.ranks) <= gpn)
              for kind in ("tp", "cp", "pp")}
    # TP groups and CP blocks of up to a node (nested CP's Ulysses parts) stay inside a node; pipelines
    # are stage-major (each stage on its own nodes), so PP groups cross nodes by design
    assert inside == {"tp": True, "cp": True, "pp": False}
    assert sum(s.kind == "tp" for s in specs) > 0 and sum(s.kind == "cp" and len(s.ranks) == gpn for s in specs) > 0


def _recv_from_a_sleeper(rank: int, world: int) -> tuple[float | None, float, str]:
    cache = GroupCache(rank=rank)
    cache.ensure([GroupSpec(kind="pp", ranks=(2, 3))])  # no timeout given: the world's
    groups = GroupCache.build([Topology.uniform(world, pp=2)], timeout_s=3.0)
    t0, msg = time.monotonic(), ""
    if rank == 2:  # a pipeline receive from a peer that never sends
        try:
            dist.irecv(torch.zeros(2), 3, group=groups.get([2, 3])).wait()
        except RuntimeError as e:
            msg = str(e)
    elif rank == 3:
        time.sleep(8)
    return world_timeout_s(), time.monotonic() - t0, msg


@pytest.mark.multirank
def test_subgroups_time_out_like_the_world() -> None:
    res = run_distributed(_recv_from_a_sleeper, 4, timeout=120)
    assert all(r[0] == 120.0 for r in res)  # what GroupCache.ensure and GroupCache.build give a group by default
    assert 2.5 < res[2][1] < 7 and "Timed out" in res[2][2], res[2]  # not gloo's 30 minutes


@pytest.mark.multirank
def test_a_stopped_rank_ends_every_other_rank_within_the_timeout(tmp_path) -> None:
    timeout_s = 15  # the world's collective timeout: pool 0's pipeline group and pool 1's CP group too
    sets = [*small_run(tmp_path), f"world.timeout_s={timeout_s}"]
    procs = _start_ranks(4, _cmd(tmp_path / "run", sets, "--steps", "100000"), tmp_path)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
                _err(tmp_path, r) for r in range(4)]
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGSTOP)  # rank 1: stage 1 of pool 0's pipeline, peer of rank 0
        t0 = time.monotonic()
        for r in (0, 2, 3):
            procs[r].wait(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        _stop_all(procs)
    print(f"world.timeout_s={timeout_s}: ranks 0, 2, 3 ended {elapsed:.1f} s after rank 1 was stopped")
    assert elapsed < 90
    lines = {}
    for r in (0, 2, 3):
        assert procs[r].returncode == 1
        mine = [x for x in _err(tmp_path, r).splitlines() if x.startswith(f"parallel_runtime: rank {r}: ")]
        assert len(mine) == 1, _err(tmp_path, r)
        lines[r] = mine[0]
    # each rank timed out itself (saying where and with whom), or names the rank that failed first
    # (rank 0 when it timed out first: its store went with it, so its peers name it and not its message)
    timed_out = {r: x for r, x in lines.items() if f"timed out after {timeout_s} s in " in x}
    assert timed_out and all("(group ranks [" in x for x in timed_out.values()), lines
    assert any("(group ranks [0, 1])" in x or "(group ranks [0, 1, 2, 3])" in x for x in timed_out.values()), lines
    for r, x in lines.items():
        if r not in timed_out:
            named = int(x.split("failed first")[0].split(": rank ")[-1])
            assert named in timed_out, lines


@pytest.mark.multirank
def test_bad_input_on_rank_1_is_printed_by_rank_1_and_named_by_rank_0(tmp_path) -> None:
    sets = [*small_run(tmp_path), "world.size=2", "policy.extra.pools=[{tp: 1, pp: 2, lanes: 1}]",
            "world.timeout_s=60"]
    out = tmp_path / "run"
    procs = _start_ranks(2, _cmd(out, sets, "--steps", "1"), tmp_path)
    for p in procs:
        p.wait(timeout=240)
    assert [p.returncode for p in procs] == [0, 0], [_err(tmp_path, r) for r in range(2)]
    # only rank 1 resumes with a changed lr (a change that needs --allow-changed): a user error on rank 1 alone
    procs = _start_ranks(2, _cmd(out, sets, "--steps", "2"), tmp_path, extra={1: ["--set", "optimizer.lr=0.5"]})
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        _stop_all(procs)
    assert [p.returncode for p in procs] == [1, 2], [_err(tmp_path, r) for r in range(2)]
    e1 = [x for x in _err(tmp_path, 1).splitlines() if x.startswith("parallel_runtime:")]
    assert len(e1) == 1 and e1[0].startswith("parallel_runtime: rank 1: error: optimizer.lr ") and "0.5" in e1[0], e1
    e0 = [x for x in _err(tmp_path, 0).splitlines() if x.startswith("parallel_runtime:")]
    assert len(e0) == 1 and "rank 1 failed first (error: optimizer.lr " in e0[0], e0  # not a socket error


@pytest.mark.multirank
def test_torchrun_two_nodes_build_the_corpus_and_equal_the_reference(tmp_path) -> None:
    steps = 3
    shards = tmp_path / "fresh" / "stdlib-shards"  # does not exist: rank 0 builds it, the others wait
    sets = [*small_run(tmp_path), "data.source=stdlib", f"data.shards_dir={shards}", "data.stdlib_limit=300"]
    port = _free_port()
    nodes = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               *_cmd(tmp_path / "run", sets, "--steps", str(steps))]
        nodes.append(subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        outs = [p.communicate(timeout=400) for p in nodes]
    finally:
        _stop_all(nodes)
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-3000:] for o in outs]
    assert not list(shards.glob("*.tmp"))
    got = [m["loss"] for m in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))]
    ref = reference_losses(HETERO, sets, str(tmp_path / "ref"), steps)
    assert len(got) == len(ref) == steps
    for g, r in zip(got, ref):
        assert abs(g - r) <= 1e-5 * abs(r), (got, ref)
