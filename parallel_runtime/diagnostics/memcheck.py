"""The estimate's accuracy: its memory for one microbatch against the device's own count.

``python -m parallel_runtime.diagnostics.memcheck --recipe R [--tokens N] [--device cuda]`` runs one rank
(a world of one: one lane, tp = pp = 1) on one microbatch of ``N`` tokens (four docs) twice, as the trainer
does (pull, forward/backward, push, optimizer step), and compares the peak of the second step:

* **predicted**: :func:`parallel_runtime.diagnostics.estimate.run_rank` on fake tensors (the GPU's code
  paths, flash-attention's stand-in when the device has flash-attention installed);
* **measured**: ``torch.cuda.max_memory_allocated`` on CUDA (its peak reset when the second step starts:
  every live tensor of the process, as the estimate counts them); on CPU (a dry run of the same code)
  the live bytes of the real tensors, counted by the estimate's own tracker.

Prints JSON; exit 1 when they differ by more than ``--tolerance`` (default 10%), 2 on bad input.
``tools/gpu_check.sh`` runs it on the device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

import numpy as np
import torch


def one_microbatch_plan(tokens: int, docs: int = 4):
    """A one-rank plan: one pool (tp = pp = 1, one lane), one microbatch of ``docs`` docs of ``tokens`` in all."""
    from balanced_loader.plan import Group, Pool, StepPlan

    lengths = [tokens // docs + (1 if i < tokens % docs else 0) for i in range(docs)]
    group = Group(lanes=(0,), segments=tuple((i, 0, n) for i, n in enumerate(lengths)))
    pool = Pool(tp=1, pp=1, ranks=((0,),), microbatches=((group,),))
    return StepPlan(step=0, world_size=1, pools=(pool,)), np.asarray(lengths, dtype=np.int64)


ONE_RANK = ["world.size=1", "policy.name=hydra", "policy.extra={}", "policy.compare=[]", "policy.tp=1",
            "policy.pp=1", "world.backend=auto"]  # the recipe on a world of one: its model, dtype, attention


def predicted(recipe, tokens: int, *, flash: bool) -> dict[str, Any]:
    """The estimate's peak of the second of two steps on one microbatch."""
    from balanced_loader.materialize import materialize_rank
    from parallel_runtime.diagnostics.estimate import Context, run_rank

    plan, lengths = one_microbatch_plan(tokens)
    ctx = Context(recipe, [plan], {(0, 0): materialize_rank(plan, 0, None)}, [lengths])
    fig = run_rank(ctx, 0, [0, 0], flash=flash).steps[-1]
    return {"peak_bytes": fig.peak, "parts": fig.parts}


def measured(recipe, tokens: int, device: torch.device) -> dict[str, Any]:
    """The same two steps on real tensors of ``device``: the second step's peak of allocated bytes."""
    import torch.distributed as dist

    from balanced_loader.materialize import materialize_rank, num_valid_tokens
    from parallel_runtime.diagnostics.memtrack import MemoryTracker
    from parallel_runtime.groups import GroupCache
    from parallel_runtime.topology import Topology
    from parallel_runtime.training.optimizer import FlatLayout, ShardedOptimizer
    from parallel_runtime.training.overlap import Overlap, overlap_wanted
    from parallel_runtime.training.params import init_params, param_specs
    from parallel_runtime.training.rank_step import execute_step
    from parallel_runtime.training.runtime import DTYPES, Runtime
    from parallel_runtime.training.transport import ShardExchange

    plan, _ = one_microbatch_plan(tokens)
    mbs = materialize_rank(plan, 0, None)
    t = recipe.train
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # on CPU the estimate's own tracker counts the real tensors, from before the first one is made
    tracker = MemoryTracker() if device.type != "cuda" else contextlib.nullcontext()
    try:
        with tracker:
            specs = param_specs(recipe.model)
            opt = ShardedOptimizer(FlatLayout(specs, 1), init_params(recipe.model, recipe.seed), recipe.optimizer,
                                   rank=0, device=device)
            xc = ShardExchange(opt)
            overlap = Overlap(xc) if overlap_wanted(t.overlap, gpu=True) else None  # as the estimate it checks
            rt = Runtime(recipe.model, rank=0, device=device, dtype=DTYPES[t.dtype], attention=t.attention,
                         groups=GroupCache(rank=0), specs=specs, layout=opt.layout)
            topo = Topology.from_plan(plan)
            for _ in range(2):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                else:
                    tracker.reset_peak()
                execute_step(rt, xc, overlap, topo, plan, mbs, num_valid_tokens(plan), step=0, push=True,
                             recompute=t.recompute)
                opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                    "counter": "torch.cuda.max_memory_allocated"}
        return {"peak_bytes": int(tracker.peak), "counter": "live bytes of the real CPU tensors (the tracker)"}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime.diagnostics.memcheck",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tolerance", type=float, default=0.10)
    args = ap.parse_args(argv)
    from parallel_runtime.config import load_recipe
    from parallel_runtime.engines.flash import flash_available

    try:
        recipe = load_recipe(args.recipe, [*args.overrides, *ONE_RANK])
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but torch sees no CUDA device")
        if args.tokens < 4:
            raise ValueError(f"--tokens must be >= 4, got {args.tokens}")
    except ValueError as e:
        print(f"memcheck: error: {e}", file=sys.stderr)
        return 2
    flash = device.type == "cuda" and flash_available()
    pred = predicted(recipe, args.tokens, flash=flash)
    meas = measured(recipe, args.tokens, device)
    ratio = pred["peak_bytes"] / meas["peak_bytes"] if meas["peak_bytes"] else None
    out = {"recipe": args.recipe, "tokens": args.tokens, "device": str(device), "flash": flash,
           "predicted": pred, "measured": meas, "ratio": ratio,
           "ok": ratio is not None and abs(ratio - 1) <= args.tolerance}
    print(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
