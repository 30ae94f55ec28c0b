"""The trainer end to end on gloo ranks: metrics, plans broadcast from rank 0, the entry point under
``accelerate launch``, and the failure modes (bad recipe, plans that differ across ranks, a rank
that crashes) -- each one clear line, never a hang.

:func:`small_run` is the shared small setup (also used by test_resume_train.py): ``cpu-hetero.yaml``
on a 300-file slice of the stdlib corpus, 256-token context, 2048-token steps, and lane caps
of 128 tokens (tp=1, pp=1) / 256 (pp=2) so long docs run as CP groups of both lanes of pool 1
while pool 0 (two pipeline stages) takes whole docs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import WorldError, run_distributed

from parallel_runtime import __main__ as entry
from parallel_runtime.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[3]
HETERO = str(REPO / "recipes" / "cpu-hetero.yaml")
SMALL_COST = """\
name: test-tiny
quadratic_ms: 2.0e-4
linear_ms: 0.04
microbatch_ms: 5.0
comm_bytes_per_token: 2048
bandwidth_gbs: {2: 0.05, 4: 0.02}
max_tokens_per_lane: 128
strategies:
  - {tp: 1, pp: 2, max_tokens_per_lane: 256}
"""


def small_run(tmp: Path) -> list[str]:
    """``--set`` overrides that shrink cpu-hetero.yaml to a test run (corpus and cost file built in ``tmp``)."""
    from balanced_loader.build.corpus import stdlib_shards

    shards = tmp / "shards"
    stdlib_shards(str(shards), limit=300)
    cost = tmp / "cost.yaml"
    cost.write_text(SMALL_COST)
    return [f"data.source={shards}", "data.max_seq_len=256", "data.global_batch_tokens=2048",
            "data.long_docs=truncate", f"cost.file={cost}", "cost.lane_caps={1x1: 128, 1x2: 256}",
            "world.timeout_s=60", "train.checkpoint_every=0"]


def train_rank(rank: int, world: int, recipe: str, sets: list[str], out: str, steps: int) -> list[dict]:
    """One rank of a training run (inside a spawned world)."""
    from parallel_runtime.config import load_recipe
    from parallel_runtime.training.trainer import Trainer

    return Trainer(load_recipe(recipe, sets), out).train(steps)


def reference_losses(recipe: str, sets: list[str], out: str, steps: int) -> list[float]:
    from parallel_runtime.config import load_recipe
    from parallel_runtime.training.trainer import Trainer

    Trainer(load_recipe(recipe, sets), out, reference=True).train(steps)
    return [m["loss"] for m in read_metrics(os.path.join(out, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, list[str]]:
    tmp = tmp_path_factory.mktemp("trainer")
    return tmp, small_run(tmp)


# ---- several runs in one world ------------------------------------------------------------


def _world(rank: int, world: int, sets: list[str], tmp: str) -> dict:
    out = {}
    out["local"] = train_rank(rank, world, HETERO, sets, f"{tmp}/local", 3)
    out["broadcast"] = train_rank(rank, world, HETERO, [*sets, "policy.plan_source=broadcast"],
                                  f"{tmp}/broadcast", 2)
    # a one-pool policy with CP groups, and maxlen executed beside it on the same batches
    out["compare"] = train_rank(rank, world, HETERO, [*sets, "policy.name=hydra", "policy.extra={}",
                                                      "policy.compare=[maxlen]"], f"{tmp}/compare", 2)
    return out


@pytest.mark.multirank
def test_training_metrics_broadcast_plans_and_compare_policies(small) -> None:
    tmp, sets = small
    res = run_distributed(_world, 4, sets, str(tmp), timeout=240)[0]
    local, broadcast = res["local"], res["broadcast"]
    ref = reference_losses(HETERO, sets, str(tmp / "ref"), 3)
    for m, b, r in zip(local, broadcast, ref):
        assert abs(m["loss"] - r) <= 1e-5 * abs(r)
        assert m["loss"] == b["loss"] and m["fingerprint"] == b["fingerprint"]  # rank 0's plan is the plan
    on_disk = read_metrics(str(tmp / "local" / "metrics.jsonl"))
    assert [m["step"] for m in on_disk] == [0, 1, 2]
    m = on_disk[0]
    for key in ("step", "loss", "tokens", "compute_ms", "predicted_ms", "skew", "bubble", "fingerprint",
                "planner_wait_ms", "pools", "cp_groups", "grad_norm", "pull_bytes", "push_bytes"):
        assert key in m, key
    assert len(m["compute_ms"]) == len(m["predicted_ms"]) == 4 and min(m["compute_ms"]) > 0
    assert m["pools"][0][:3] == [1, 2, 1] and m["pools"][1][:3] == [1, 1, 2]
    assert sum(x["cp_groups"] for x in on_disk) > 0  # dynamic CP inside pool 1
    assert all(x["pipeline_bytes"] > 0 for x in on_disk if x["pools"][0][3] > 0)
    comp = res["compare"]
    assert all("maxlen" in x["compare"] and len(x["compare"]["maxlen"]["compute_ms"]) == 4 for x in comp)
    assert all(abs(x["compare"]["maxlen"]["loss"] - x["loss"]) <= 1e-5 * x["loss"] for x in comp)  # same batch


# ---- failures --------------------------------------------------------------------------------


TWO_RANKS = ["world.size=2", "policy.extra.pools=[{tp: 1, pp: 1, lanes: 2}]"]


def _perturbed(rank: int, world: int, sets: list[str], out: str) -> None:
    import dataclasses

    from parallel_runtime.config import load_recipe
    from parallel_runtime.training.trainer import Trainer

    trainer = Trainer(load_recipe(HETERO, sets), out)
    if rank == 1:  # this rank plans something else: the same microbatches in the opposite order
        real = trainer.next_batch

        def next_batch(loader):
            b = real(loader)
            pool = b.plan.pools[0]
            pool = dataclasses.replace(pool, microbatches=pool.microbatches[::-1])
            return dataclasses.replace(b, plan=dataclasses.replace(b.plan, pools=(pool,)))

        trainer.next_batch = next_batch
    trainer.train(2)


def _crash(rank: int, world: int, sets: list[str], out: str) -> None:
    from parallel_runtime.config import load_recipe
    from parallel_runtime.training import rank_step
    from parallel_runtime.training import trainer as tr

    real = rank_step.forward_backward

    def fb(rt, sm, plan, *a, **k):
        if rank == 1 and plan.step == 1:
            raise RuntimeError("rank 1 lost its device")
        return real(rt, sm, plan, *a, **k)

    rank_step.forward_backward = fb
    tr.Trainer(load_recipe(HETERO, sets), out).train(3)


def _check_plans(rank: int, world: int) -> list:
    import numpy as np
    import torch

    from balanced_loader.plan import BatchItems, Group, Pool, StepPlan, single_pool_ranks
    from parallel_runtime.config import load_recipe
    from parallel_runtime.groups import GroupCache
    from parallel_runtime.training.plan_check import check_plan_runs_here

    recipe = load_recipe(HETERO, TWO_RANKS)
    groups = GroupCache(rank=rank)

    def check(segments):
        plan = StepPlan(step=0, world_size=2, pools=(Pool(tp=1, pp=1, ranks=single_pool_ranks(2), microbatches=(
            (Group(lanes=(1, 0), segments=segments),),)),))
        seqs = BatchItems(doc_ids=np.array([0, 1]), starts=np.array([0, 0]), lengths=np.array([10, 20]))
        return check_plan_runs_here(plan, recipe=recipe, sequences=seqs, groups=groups,
                                    comm_device=torch.device("cpu"))

    topo, created = check(((0, 0, 10), (1, 0, 20)))
    out = [topo.coord(rank).lane, created, check(((0, 0, 10), (1, 0, 20)))[1]]
    try:
        check(((0, 0, 10), (1, 0, 15)))  # doc 1 is not covered: contract 1 fails on every rank alike
    except ValueError as e:
        out.append(str(e))
    return out


@pytest.mark.multirank
def test_the_runtime_checks_a_plan_against_the_contract_and_creates_its_groups() -> None:
    got = run_distributed(_check_plans, 2, timeout=60)
    # lane r is rank r; the 2-lane CP group is created once, then only looked up
    assert [g[:3] for g in got] == [[0, 1, 0], [1, 1, 0]]
    assert all(g[3] == "step 0: doc 1's sequence [0, 20) is covered up to token 15, then nothing" for g in got)


@pytest.mark.multirank
def test_plans_that_differ_across_ranks_fail_before_any_step_collective(small) -> None:
    tmp, sets = small
    with pytest.raises(WorldError, match="plans differ across ranks at step 0: rank\\(s\\) \\[1\\] disagree"):
        run_distributed(_perturbed, 2, [*sets, *TWO_RANKS], str(tmp / "perturbed"), timeout=120)


@pytest.mark.multirank
def test_a_crashed_rank_stops_the_others_with_a_clear_error(small) -> None:
    tmp, sets = small
    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_distributed(_crash, 2, [*sets, *TWO_RANKS, "world.timeout_s=20"], str(tmp / "crash"), timeout=120,
                        grace=30)
    msg = str(info.value)
    assert msg.startswith("rank 1 failed first: RuntimeError: rank 1 lost its device"), msg
    assert "terminated" not in msg  # the others failed by themselves (broken collective), no hang
    assert time.monotonic() - t0 < 60


# ---- the entry point ------------------------------------------------------------------------


def test_entry_point_bad_input_is_one_line(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(HETERO).read_text().replace("  global_batch_tokens:", "  global_batch_tokns:"))
    assert entry.main(["--recipe", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown key 'data.global_batch_tokns'" in err
    assert entry.main(["--recipe", HETERO, "--set", "world.size=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "world.size / policy.extra: policy 'pools'" in err and "= 4 ranks" in err
    assert entry.main(["--recipe", HETERO]) == 2  # no launcher
    assert "accelerate launch --multi_gpu --num_processes 4" in capsys.readouterr().err


def test_entry_point_runs_the_diagnostics_as_subcommands(tmp_path, capsys) -> None:
    # python -m parallel_runtime selfcheck / profile reach the diagnostics' own argument checks
    assert entry.main(["selfcheck", "--world-size", "6", "--tp", "4", "--cp", "2"]) == 2
    assert capsys.readouterr().err.strip() == "selfcheck: --world-size 6 is not divisible by tp x cp = 4 x 2 = 8"
    assert entry.main(["profile", "--recipe", HETERO, "--shapes", "3x1"]) == 2
    assert "--shapes: tp=3 x pp=1 does not divide world.size 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # anything else is training: --recipe is required
        entry.main(["--steps", "1"])


@pytest.mark.multirank
def test_accelerate_launch_trains_and_resumes(small, tmp_path) -> None:
    _, sets = small
    sets = [*sets, "world.size=2", "policy.extra.pools=[{tp: 1, pp: 2, lanes: 1}]"]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(_free_port()), "-m", "parallel_runtime", "--recipe", HETERO, "--out", str(out)]
    cmd += [x for s in sets for x in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for steps in (1, 2):
        r = subprocess.run([*cmd, "--steps", str(steps)], capture_output=True, text=True, timeout=180, env=env,
                           cwd=REPO)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step    1" in r.stdout
    assert [m["step"] for m in read_metrics(str(out / "metrics.jsonl"))] == [0, 1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
