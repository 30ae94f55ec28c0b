"""Peak memory of the optimizer's pull/push: full-buffer (old) against slice-exact (new).

    PYTHONPATH=$PWD .venv/bin/python tools/bench_slices.py --params 100000000 --world-size 4 --repeats 3

A model of ``--params`` fp32 parameters (2048 x 2048 matrices, TP-split alternately along
dim 0 and dim 1) on ``--world-size`` gloo processes, every rank holding a 1/world TP slice of
every matrix. One fresh world per (mode, repeat), the modes alternating: each rank builds its
optimizer shard and working slice, then runs one pull and one push. Reported per mode, median
over repeats of the largest rank: the process's peak RSS (``ru_maxrss``), its RSS just before
the pull, the growth of the peak over that (what pull and push add), the wall time of pull
and of push, and the bytes each rank received in the pull and sent in the push.

``old`` is the previous implementation, written here over the optimizer's public pieces: the
pull all-gathers the full flat model (:meth:`ShardedOptimizer.gather_full`) and copies the
slices out; the push adds the gradients into a zero full-size flat buffer and reduce-scatters it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from parallel_runtime.launch import spawn_world
from parallel_runtime.training.metrics import peak_rss_mb
from parallel_runtime.training.optimizer import AdamWConfig, FlatLayout, LocalParam, ParamSpec, ShardedOptimizer
from parallel_runtime.training.transport import ShardExchange

SIDE = 2048


def _specs(params: int) -> list[ParamSpec]:
    n = max(1, round(params / (SIDE * SIDE)))
    return [ParamSpec(name=f"w{i}", shape=(SIDE, SIDE), tp_dim=i % 2) for i in range(n)]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _old_pull(opt: ShardedOptimizer, local: list[LocalParam]) -> int:
    full = opt.gather_full()  # [padded]: the whole model on every rank
    for lp in local:
        lp.tensor.detach().copy_(opt.layout.slice_view(full, lp))
    return full.numel() * 4  # bytes received


def _old_push(opt: ShardedOptimizer, local: list[LocalParam]) -> int:
    full = torch.zeros(opt.layout.padded, dtype=torch.float32)  # [padded]
    for lp in local:
        if lp.tensor.grad is not None and (lp.spec.tp_dim is not None or lp.tp_index == 0):
            opt.layout.slice_view(full, lp).add_(lp.tensor.grad)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(opt.grad, full, op=dist.ReduceOp.SUM)
    return full.numel() * 4  # bytes sent


def _rank(rank: int, world: int, mode: str, params: int, bucket_elems: int) -> dict:
    specs = _specs(params)
    init = ((s.name, torch.full(s.shape, 0.001 * i)) for i, s in enumerate(specs))  # one matrix at a time
    opt = ShardedOptimizer(FlatLayout(specs, world), init, AdamWConfig(), rank=rank)
    xc = ShardExchange(opt, bucket_elems=bucket_elems)
    local = []
    for s in specs:
        shape = [SIDE, SIDE]
        shape[s.tp_dim] //= world
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.ones(shape)
        local.append(LocalParam(spec=s, tensor=p, tp_index=rank, tp_size=world))
    gc.collect()
    dist.barrier()
    before = _rss_mb()
    t0 = time.perf_counter()
    if mode == "old":
        pulled = _old_pull(opt, local)
    else:
        xc.pull(local)
        pulled = xc.take_stats().bytes_pulled
    t1 = time.perf_counter()
    if mode == "old":
        pushed = _old_push(opt, local)
    else:
        xc.push(local)
        pushed = xc.take_stats().bytes_pushed
    t2 = time.perf_counter()
    peak = peak_rss_mb()
    for i, lp in enumerate(local):  # every slice holds its matrix's value, every gradient element landed once
        if not torch.equal(lp.tensor.detach(), torch.full_like(lp.tensor, 0.001 * i)):
            raise AssertionError(f"rank {rank}: {mode} pull gave wrong values for {lp.spec.name}")
    return {"peak_mb": peak, "rss_before_mb": before, "added_mb": peak - before, "pull_s": t1 - t0,
            "push_s": t2 - t1, "pulled_bytes": pulled, "pushed_bytes": pushed,
            "grad_sum": float(opt.grad.double().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=32.0, help="bucket bound of the new pull/push (fp32 MB)")
    args = ap.parse_args()
    bucket = max(1, int(args.bucket_mb * 2**20 / 4))
    runs: dict[str, list[list[dict]]] = {"old": [], "new": []}
    for _ in range(args.repeats):
        for mode in ("old", "new"):
            runs[mode].append(spawn_world(_rank, args.world_size, mode, args.params, bucket, timeout_s=900))
    n = len(_specs(args.params)) * SIDE * SIDE
    out = {"params": n, "world_size": args.world_size, "repeats": args.repeats, "bucket_mb": args.bucket_mb,
           "slice_bytes_per_rank": n * 4 // args.world_size}
    for mode, worlds in runs.items():
        if any(sum(r["grad_sum"] for r in w) != n for w in worlds):
            raise AssertionError(f"{mode} push: the shards' gradients do not sum to one per parameter")
        out[mode] = {k: statistics.median(max(r[k] for r in w) for w in worlds)
                     for k in ("peak_mb", "rss_before_mb", "added_mb", "pull_s", "push_s", "pulled_bytes",
                               "pushed_bytes")}
    print(json.dumps(out, indent=1))
    print(f"\n{'':24}{'old':>12}{'new':>12}")
    for k in ("peak_mb", "rss_before_mb", "added_mb", "pull_s", "push_s", "pulled_bytes", "pushed_bytes"):
        print(f"{k:24}{out['old'][k]:>12.6g}{out['new'][k]:>12.6g}")


if __name__ == "__main__":
    main()
