"""Where the runtime spends time beyond the plain loop: torch.profiler on one step of each, op by op.

The setting of tools/bench_runtime_vs_ddp.py (the 27.5M decoder 512x8, stdlib corpus, 8,192 tokens per
step, microbatch cap 1,024, hydra, 2 gloo ranks of 1 thread). Two worlds, one after the other:

* the runtime (``--model native`` or ``hf``, recipe overrides with ``--set``), rank 0 profiled over
  ``--steps`` steps after ``--warmup``;
* the plain loop: the same Llama through torch DDP (what ``accelerator.prepare`` wraps it in) on the
  same loader with ``cp=1``, the same steps.

Prints the profiled ops' self CPU milliseconds per step, both side by side, sorted by how much more
the runtime spends on them, then the step's phases from the runtime's ``time_ms`` record.

    python tools/profile_runtime.py --model native --steps 2
    python tools/profile_runtime.py --model hf --set train.overlap=false
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench_module():
    """tools/bench_runtime_vs_ddp.py, loaded by path (tools/ is not a package: no import path edits)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_runtime_vs_ddp", REPO / "tools" / "bench_runtime_vs_ddp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_BENCH = _bench_module()
LLAMA, recipe_text = _BENCH.LLAMA, _BENCH.recipe_text


def _profile(fn, steps: int):
    """Run ``fn()`` ``steps`` times under torch.profiler; ``{op: self CPU ms per step}``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}


def _runtime(recipe: str, sets: list[str], out: str):
    """The runtime's trainer on the recipe: ``(trainer, step function returning the step's metrics)``."""
    from parallel_runtime.config import load_recipe
    from parallel_runtime.training.trainer import Trainer

    t = Trainer(load_recipe(recipe, sets), out)
    return t, lambda: t.train_step(t.next_batch(t.loader))


def runtime_rank(rank: int, world: int, recipe: str, sets: list[str], out: str, warmup: int, steps: int) -> dict:
    t, step = _runtime(recipe, sets, out)
    for _ in range(warmup):
        step()
    recs: list[dict] = []
    ops = _profile(lambda: recs.append(step()), steps) if rank == 0 else None
    if rank != 0:
        for _ in range(steps):
            step()
    t.close()
    return {"ops": ops, "time_ms": [r["time_ms"] for r in recs], "step_ms": [r["step_ms"] for r in recs]}


def _loop(rank: int, world: int, recipe: str):
    """The plain DDP loop of the Llama on the recipe's loader with ``cp=1``: ``(step function, loader)``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoConfig, AutoModelForCausalLM

    import balanced_loader as bl
    from parallel_runtime.config import load_recipe

    r = load_recipe(recipe)
    d, o = r.data, r.optimizer
    loader = bl.BalancedLoader(bl.open_source(d.shards_dir), policy=r.policy.name, cost=r.cost_model(), cp=1,
                               world_size=world, rank=rank, global_batch_tokens=d.global_batch_tokens, seed=r.seed,
                               max_seq_len=d.max_seq_len, long_docs=d.long_docs, epochs=None)
    spec = dict(LLAMA)
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(r.seed)
    model = DDP(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    it = iter(loader)

    def step() -> None:
        batch = next(it)
        n = len(batch.microbatches)
        for i, mb in enumerate(batch.microbatches):
            hf = mb.to_hf()
            with contextlib.nullcontext() if i == n - 1 else model.no_sync():
                loss = model(input_ids=hf["input_ids"], position_ids=hf["position_ids"], labels=hf["labels"],
                             num_items_in_batch=batch.num_valid_tokens, use_cache=False).loss
                (loss * world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, loader


def loop_rank(rank: int, world: int, recipe: str, warmup: int, steps: int) -> dict:
    step, loader = _loop(rank, world, recipe)
    for _ in range(warmup):
        step()
    ops = _profile(step, steps) if rank == 0 else None
    if rank != 0:
        for _ in range(steps):
            step()
    loader.close()
    return {"ops": ops}


def interleaved_rank(rank: int, world: int, recipe: str, sets: list[str], out: str, warmup: int, pairs: int) -> dict:
    """The runtime's step and the loop's step alternately in the same processes (the order flips every pair),
    each timed from a barrier to a barrier: both see the same machine, step by step."""
    import time

    import torch.distributed as dist

    t, runtime_step = _runtime(recipe, sets, out)
    loop_step, loader = _loop(rank, world, recipe)
    runs = {"runtime": runtime_step, "loop": loop_step}
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    times: dict[str, list[float]] = {"runtime": [], "loop": []}
    for i in range(pairs):
        for name in (("runtime", "loop") if i % 2 == 0 else ("loop", "runtime")):
            dist.barrier()
            t0 = time.perf_counter()
            runs[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    t.close()
    loader.close()
    return times


def print_pairs(times: dict[str, list[float]], what: str) -> None:
    """Per pair the loop's step over the runtime's (the runtime's tokens/s over the loop's: same tokens), medians."""
    import statistics

    ratios = [lo / rt for rt, lo in zip(times["runtime"], times["loop"], strict=True)]
    print(f"interleaved, {what}: runtime steps {[round(x, 2) for x in times['runtime']]}")
    print(f"{' ' * (len(what) + 14)}loop steps    {[round(x, 2) for x in times['loop']]}")
    print(f"tokens/s runtime / loop per pair {[round(x, 3) for x in ratios]}; median {statistics.median(ratios):.3f} "
          f"(step medians {statistics.median(times['runtime']):.2f} s / {statistics.median(times['loop']):.2f} s)")


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
    from parallel_runtime.launch import spawn_world

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    shards = str(work / "stdlib-shards")
    stdlib_shards(shards)
    recipe = work / f"{a.model}.json"
    recipe.write_text(recipe_text(steps=10**6, shards=shards, hf=a.model == "hf", tokens=8192, cap=1024))
    limit = 3600.0
    if a.interleave:
        with tempfile.TemporaryDirectory(dir=work) as out:
            times = spawn_world(interleaved_rank, 2, str(recipe), a.sets, out, a.warmup, a.interleave,
                                timeout_s=limit)[0]
        print_pairs(times, f"{a.model} {' '.join(a.sets)}".strip())
        if a.json:
            Path(a.json).write_text(json.dumps(times, indent=1))
        return
    with tempfile.TemporaryDirectory(dir=work) as out:
        rt = spawn_world(runtime_rank, 2, str(recipe), a.sets, out, a.warmup, a.steps, timeout_s=limit)[0]
    loop = spawn_world(loop_rank, 2, str(recipe), a.warmup, a.steps, timeout_s=limit)[0]
    ops_rt, ops_loop = rt["ops"], loop["ops"]
    if a.json:
        Path(a.json).write_text(json.dumps({"runtime": rt, "loop": loop}, indent=1))
    names = sorted(set(ops_rt) | set(ops_loop), key=lambda k: ops_loop.get(k, 0.0) - ops_rt.get(k, 0.0))
    print(f"self CPU ms per step, rank 0 ({a.model} runtime {' '.join(a.sets)} vs the DDP loop)")
    print(f"{'op':<58} {'runtime':>9} {'loop':>9} {'more':>9}")
    for k in names[:a.top]:
        x, y = ops_rt.get(k, 0.0), ops_loop.get(k, 0.0)
        print(f"{k[:58]:<58} {x:9.1f} {y:9.1f} {x - y:9.1f}")
    print(f"{'all ops':<58} {sum(ops_rt.values()):9.1f} {sum(ops_loop.values()):9.1f} "
          f"{sum(ops_rt.values()) - sum(ops_loop.values()):9.1f}")
    print("runtime step phases, ms by rank:")
    for rec, ms in zip(rt["time_ms"], rt["step_ms"]):
        print(f"  step {ms:.0f} ms: " + ", ".join(f"{k} {v}" for k, v in rec.items()))


if __name__ == "__main__":
    main()
