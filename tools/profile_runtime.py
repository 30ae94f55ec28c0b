"""Where the runtime spends time beyond the plain loop: torch.profiler on one step of each, op by op.

The setting of tools/bench_runtime_vs_ddp.py (the 27.5M decoder 512x8, stdlib corpus, 8,192 tokens per
step, microbatch cap 1,024, hydra, 2 gloo ranks of 1 thread). One world of 2 ranks builds both:

* the runtime (``--model native`` or ``hf``, recipe overrides with ``--set``);
* the plain loop: the same Llama through torch DDP (what ``accelerator.prepare`` wraps it in) on the
  same loader with ``cp=1`` (``parallel_runtime.diagnostics.ddp_loop``),

and runs their steps alternately (``--warmup`` of each, then ``--steps`` of each, the order flipping every
pair), rank 0's under torch.profiler, so both see the same machine.

Prints the profiled ops' self CPU milliseconds and calls per step, both side by side: summed per phase of the
step (the runtime's ``time_ms`` phases, the loop's data / forward-backward / optimizer; each split into
forward, F, and what autograd runs in backward, B), then per op and per phase and op, the largest
differences first; then the runtime's ``time_ms`` record. The self time of a ``phase:`` range is the
Python between the ops.

    python tools/profile_runtime.py --model native --steps 2
    python tools/profile_runtime.py --model hf --set train.overlap=false
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COST_FILE = REPO / "recipes" / "cost-cpu-tiny.yaml"


PHASE = "phase:"  # torch.profiler ranges around the step's phases (runtime: StepTimes; loop: PlainLoop.step)
BACKWARD = "autograd::engine::evaluate_function"


def _place(e, memo: dict) -> tuple[str, str]:
    """``(phase, F|B)`` of a profiled event: its innermost phase range, B when autograd runs it."""
    key = id(e)
    if key not in memo:
        parent = e.cpu_parent
        phase, kind = ("other", "F") if parent is None else _place(parent, memo)
        if e.name.startswith(PHASE) and phase == "other":
            phase = e.name[len(PHASE):]
        if e.name.startswith(BACKWARD):
            kind = "B"
        memo[key] = (phase, kind)
    return memo[key]


def _profile(fn, into: dict[str, list[float]]) -> None:
    """Run ``fn()`` once under torch.profiler, adding to ``into["phase|F or B|op"]`` its self CPU ms and calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    memo: dict[int, tuple[str, str]] = {}
    for e in prof.events():
        phase, kind = _place(e, memo)
        row = into.setdefault(f"{phase}|{kind}|{e.name}", [0.0, 0])
        row[0] += e.self_cpu_time_total / 1e3
        row[1] += 1


def _annotated(phase):
    """``StepTimes.phase`` that also opens a profiler range named after the phase."""
    from torch.profiler import record_function

    @contextlib.contextmanager
    def wrapped(name: str):
        with record_function(PHASE + name), phase(name):
            yield

    return wrapped


def _runtime(recipe: str, sets: list[str], out: str):
    """The runtime's trainer on the recipe: ``(trainer, step function returning the step's metrics)``."""
    from torch.profiler import record_function

    from parallel_runtime.config import load_recipe
    from parallel_runtime.training.trainer import Trainer

    t = Trainer(load_recipe(recipe, sets), out)
    t.times.phase = _annotated(t.times.phase)  # this tool's trainer only: its phases become profiler ranges

    def step():
        with record_function(PHASE + "data_wait"):
            batch = t.next_batch(t.loader)
        return t.train_step(batch)

    return t, step


def _loop(rank: int, world: int, recipe: str):
    """The plain DDP loop of the Llama on the recipe's loader with ``cp=1``: ``(step function, loop)``."""
    from parallel_runtime.diagnostics.ddp_loop import PlainLoop

    loop = PlainLoop.with_ddp(recipe, rank=rank, world=world)
    return loop.step, loop


def profiled_rank(rank: int, world: int, recipe: str, sets: list[str], out: str, warmup: int, steps: int) -> dict:
    """Both steps alternately in the same processes (as :func:`interleaved_rank`), rank 0's under torch.profiler:
    ``{"runtime"|"loop": {key: [self CPU ms, calls] summed over the steps}}`` and the runtime's ``time_ms``."""
    import torch.distributed as dist

    t, runtime_step = _runtime(recipe, sets, out)
    loop_step, loop = _loop(rank, world, recipe)
    runs = {"runtime": runtime_step, "loop": loop_step}
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    ops: dict[str, dict[str, list[float]]] = {"runtime": {}, "loop": {}}
    recs: list[dict] = []
    for i in range(steps):
        for name in (("runtime", "loop") if i % 2 == 0 else ("loop", "runtime")):
            dist.barrier()
            fn = (lambda: recs.append(runtime_step())) if name == "runtime" else loop_step
            if rank == 0:
                _profile(fn, ops[name])
            else:
                fn()
    t.close()
    loop.close()
    return {"ops": ops, "time_ms": [r["time_ms"] for r in recs], "step_ms": [r["step_ms"] for r in recs]}


def interleaved_rank(rank: int, world: int, recipe: str, sets: list[str], out: str, warmup: int, pairs: int) -> dict:
    """The runtime's step and the loop's step alternately in the same processes (the order flips every pair),
    each timed from a barrier to a barrier: both see the same machine, step by step. Beside the wall time,
    this process's CPU seconds in the step (every thread: compute, gloo, the loader's planner), which other
    jobs on a shared machine disturb far less."""
    import resource
    import time

    import torch.distributed as dist

    t, runtime_step = _runtime(recipe, sets, out)
    loop_step, loop = _loop(rank, world, recipe)
    runs = {"runtime": runtime_step, "loop": loop_step}
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    times: dict[str, list[float]] = {"runtime": [], "loop": []}
    cpu: dict[str, list[float]] = {"runtime": [], "loop": []}
    usage: dict[str, list[tuple[float, float, int]]] = {"runtime": [], "loop": []}  # user s, system s, minor faults
    for i in range(pairs):
        for name in (("runtime", "loop") if i % 2 == 0 else ("loop", "runtime")):
            dist.barrier()
            t0, c0, u0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            runs[name]()
            c1, u1 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(c1 - c0)
            usage[name].append((u1.ru_utime - u0.ru_utime, u1.ru_stime - u0.ru_stime, u1.ru_minflt - u0.ru_minflt))
    t.close()
    loop.close()
    return {"wall": times, "cpu": cpu, "usage": usage}


def print_table(title: str, ops_rt: dict[str, list[float]], ops_loop: dict[str, list[float]], group,
                top: int | None) -> None:
    """Both profiles (``{key: [ms, calls]}``) summed by ``group(key)``, the largest differences in ms first
    (``top`` rows; None: all), with the calls of each (a count: other jobs on the machine do not move it)."""
    rt: dict[str, list[float]] = {}
    lo: dict[str, list[float]] = {}
    for src, dst in ((ops_rt, rt), (ops_loop, lo)):
        for k, (ms, calls) in src.items():
            row = dst.setdefault(group(k), [0.0, 0.0])
            row[0] += ms
            row[1] += calls
    zero = [0.0, 0.0]
    names = sorted(set(rt) | set(lo), key=lambda k: -abs(rt.get(k, zero)[0] - lo.get(k, zero)[0]))
    print(f"\n{title}\n{'':<60} {'runtime ms':>10} {'loop ms':>9} {'more':>9} {'calls':>8} {'loop':>8}")
    for k in names[:top]:
        (x, cx), (y, cy) = rt.get(k, zero), lo.get(k, zero)
        print(f"{k[:60]:<60} {x:10.1f} {y:9.1f} {x - y:9.1f} {cx:8.0f} {cy:8.0f}")
    x, y = sum(v[0] for v in rt.values()), sum(v[0] for v in lo.values())
    print(f"{'all':<60} {x:10.1f} {y:9.1f} {x - y:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("native", "hf"), default="native")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="runtime recipe override (repeatable)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (default 2)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--work", default="/tmp/profile_runtime")
    ap.add_argument("--json", help="write both profiles here")
    ap.add_argument("--interleave", type=int, default=0, metavar="PAIRS",
                    help="instead of profiling: time PAIRS runtime and loop steps alternately in the same processes")
    a = ap.parse_args()
    from balanced_loader.build.corpus import stdlib_shards
    from parallel_runtime.diagnostics.ddp_loop import format_pairs, recipe_text
    from parallel_runtime.launch import spawn_world

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    shards = str(work / "stdlib-shards")
    stdlib_shards(shards)
    recipe = work / f"{a.model}.json"
    recipe.write_text(recipe_text(steps=10**6, shards=shards, hf=a.model == "hf", cost_file=str(COST_FILE)))
    limit = 3600.0
    if a.interleave:
        with tempfile.TemporaryDirectory(dir=work) as out:
            ranks = spawn_world(interleaved_rank, 2, str(recipe), a.sets, out, a.warmup, a.interleave,
                                timeout_s=limit)
        what = f"{a.model} {' '.join(a.sets)}".strip()
        print(format_pairs(ranks[0]["wall"], what))
        cpu = {k: [sum(r["cpu"][k][i] for r in ranks) for i in range(a.interleave)] for k in ("runtime", "loop")}
        print("CPU seconds per step, both ranks:")
        print(format_pairs(cpu, what))
        for k in ("runtime", "loop"):
            u = [tuple(sum(r["usage"][k][i][j] for r in ranks) for j in range(3)) for i in range(a.interleave)]
            print(f"{k}: median per step, both ranks: user {statistics.median(x[0] for x in u):.2f} s, system "
                  f"{statistics.median(x[1] for x in u):.2f} s, minor faults {statistics.median(x[2] for x in u):,.0f}")
        if a.json:
            Path(a.json).write_text(json.dumps({"wall": ranks[0]["wall"], "cpu": cpu,
                                                "usage": [r["usage"] for r in ranks]}, indent=1))
        return
    with tempfile.TemporaryDirectory(dir=work) as out:
        res = spawn_world(profiled_rank, 2, str(recipe), a.sets, out, a.warmup, a.steps, timeout_s=limit)[0]
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    ops_rt, ops_loop = ({k: [v[0] / a.steps, v[1] / a.steps] for k, v in res["ops"][n].items()}
                        for n in ("runtime", "loop"))
    print(f"self CPU ms and calls per step, rank 0 ({a.model} runtime {' '.join(a.sets)} vs the DDP loop, "
          f"{a.steps} steps of each, alternated)")
    print_table("by phase (F: forward and everything outside autograd, B: backward)", ops_rt, ops_loop,
                lambda k: "|".join(k.split("|")[:2]), top=None)
    print_table("by op, all phases", ops_rt, ops_loop, lambda k: k.split("|", 2)[2], top=a.top)
    print_table("by phase and op", ops_rt, ops_loop, lambda k: k, top=a.top)
    print("runtime step phases, ms by rank:")
    for rec, ms in zip(res["time_ms"], res["step_ms"]):
        print(f"  step {ms:.0f} ms: " + ", ".join(f"{k} {v}" for k, v in rec.items()))


if __name__ == "__main__":
    main()
