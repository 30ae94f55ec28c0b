"""Context-parallel benchmarks (CPU gloo by default): ring overlap and bytes per layer.

    .venv/bin/python tools/bench_cp.py overlap --world-size 2 --repeats 7
    .venv/bin/python tools/bench_cp.py bytes --world-size 4
    .venv/bin/python tools/bench_cp.py engines --world-size 4 --tokens 4096
    .venv/bin/python tools/bench_cp.py kernels --device cuda        # local attention impls (GPU check)

``overlap``: ring attention forward+backward with the K/V (and dK/dV) transfers posted
before each step's compute versus waited for first, in one world, back to back in
alternating order, ``--repeats`` pairs: medians of each, the median (and IQR) of the paired
ratio serial/overlapped, the transfers alone (the same messages without compute), and the
time each mode spends blocked waiting for transfers (max over ranks).

``bytes``: the model (2 layers, 16 heads, 8 KV heads, head dim 16) under ring, Ulysses and
nested engines; bytes each rank sends per layer, counted by the engines' instrumentation, against the formulas of
``papers/hydra_dcp.md`` (s = padded tokens of the group, D per TP rank, b = 4 bytes).

``engines``: ring, Ulysses and every nested split of ``--world-size`` on one packed batch of
long-tailed docs (attention alone, 8 heads, 8 KV heads, head dim 64), forward+backward time,
bytes sent and time blocked on ring transfers.

``kernels``: local varlen attention implementations (masked, loop, sdpa, flash when
installed) forward+backward on one device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from parallel_runtime.engines.context import (
    CommStats,
    PackedLayout,
    RingAttention,
    make_engine,
    shard_microbatch,
)
from parallel_runtime.engines.tensor import TensorParallel
from parallel_runtime.groups import GroupCache
from parallel_runtime.launch import spawn_world
from parallel_runtime.model import ModelConfig, Transformer
from parallel_runtime.topology import Topology

# ---- overlap ---------------------------------------------------------------------------------


def _timed(fn, repeats: int) -> list[float]:
    """Per-repeat wall time, max over ranks (every rank waits at a barrier first)."""
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(float(t))
    return out


def _overlap_case(rank: int, world: int, pg, case: dict, repeats: int, dev: torch.device) -> dict:
    ranks = tuple(range(world))
    n, h, hkv, d = case["tokens_per_rank"], case["heads"], case["kv_heads"], case["head_dim"]
    lengths = [n * world]  # one doc, zigzag over the ring
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(n, h, d, generator=g).to(dev).requires_grad_()
    k = torch.randn(n, hkv, d, generator=g).to(dev).requires_grad_()
    v = torch.randn(n, hkv, d, generator=g).to(dev).requires_grad_()
    dout = torch.randn(n, h, d, generator=g).to(dev)
    engines = {m: RingAttention(pg, ranks, rank, overlap=(m == "overlap")) for m in ("overlap", "serial")}
    bound = {m: e.bind(lengths) for m, e in engines.items()}

    def step(m: str) -> None:
        bound[m](q, k, v).backward(dout)
        q.grad = k.grad = v.grad = None

    kv = torch.cat([k.detach(), v.detach()], 1).contiguous()
    nxt, prv = ranks[(rank + 1) % world], ranks[(rank - 1) % world]

    def transfers() -> None:  # the same messages: K/V for r-1 steps forward; K/V and dK/dV backward
        for per_step in (1, 2):
            for _ in range(world - 1):
                p2p = []
                for _ in range(per_step):
                    p2p += [dist.P2POp(dist.isend, kv, nxt, group=pg),
                            dist.P2POp(dist.irecv, torch.empty_like(kv), prv, group=pg)]
                for r in dist.batch_isend_irecv(p2p):
                    r.wait()

    for m in ("overlap", "serial"):
        step(m)  # warm up (and build masks)
    times: dict[str, list[float]] = {"overlap": [], "serial": [], "transfer": []}
    waits: dict[str, list[float]] = {"overlap": [], "serial": []}
    for i in range(repeats):
        for m in (("overlap", "serial") if i % 2 == 0 else ("serial", "overlap")):
            engines[m].stats.reset()
            times[m] += _timed(lambda m=m: step(m), 1)
            w = torch.tensor([engines[m].stats.wait_s], dtype=torch.float64)
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            waits[m].append(float(w))
        times["transfer"] += _timed(transfers, 1)
    med = {m: statistics.median(t) for m, t in times.items()}
    wmed = {m: statistics.median(t) for m, t in waits.items()}
    paired = sorted(a / b for a, b in zip(times["serial"], times["overlap"]))  # same repeat, back to back
    q1, q3 = np.percentile(paired, [25, 75])
    return {**case, "world_size": world, "kv_bytes_per_message": kv.numel() * kv.element_size(),
            "overlap_ms": 1e3 * med["overlap"], "serial_ms": 1e3 * med["serial"],
            "transfer_ms": 1e3 * med["transfer"], "speedup": statistics.median(paired),
            "speedup_iqr": [float(q1), float(q3)],
            "exposed_overlap_ms": 1e3 * wmed["overlap"], "exposed_serial_ms": 1e3 * wmed["serial"],
            "samples_ms": {m: [round(1e3 * x, 2) for x in t] for m, t in times.items()}}


def _overlap_rank(rank: int, world: int, cases: list[dict], repeats: int, device: str) -> list[dict]:
    groups = GroupCache.build([Topology.uniform(world)])
    pg = groups.get(tuple(range(world)))
    return [_overlap_case(rank, world, pg, case, repeats, torch.device(device)) for case in cases]


OVERLAP_CASES = [  # K/V messages of 8 MiB; compute per ring step grows with tokens per rank (x tokens / heads)
    {"tokens_per_rank": 32, "heads": 512, "kv_heads": 512, "head_dim": 64},
    {"tokens_per_rank": 128, "heads": 128, "kv_heads": 128, "head_dim": 64},
    {"tokens_per_rank": 512, "heads": 32, "kv_heads": 32, "head_dim": 64},
]


# ---- bytes ---------------------------------------------------------------------------------


def _bytes_rank(rank: int, world: int, layouts: list[dict], lengths: list[int]) -> list[dict]:
    out = []
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=n) for n in lengths]
    for lay in layouts:
        tp, kind, inner = lay["tp"], lay["engine"], lay["inner"]
        cfg = ModelConfig(hidden=128, num_layers=2, num_heads=16, num_kv_heads=8, head_dim=16, ffn_hidden=256)
        topo = Topology.uniform(world, tp=tp)
        groups = GroupCache.build([topo], inner_sizes=[inner] if kind == "nested" else None)
        coord = topo.coord(rank)
        tpg = TensorParallel(size=tp, index=coord.tp_index, group=groups.get(topo.tp_ranks(rank)))
        model = Transformer(cfg, tp=tpg, seed=0)
        lanes = topo.pools[0].num_lanes
        cp_ranks = topo.pools[0].cp_ranks(range(lanes), 0, coord.tp_index)
        stats = CommStats()
        eng = make_engine(kind, groups, cp_ranks, rank, inner=inner, stats=stats)
        mb = shard_microbatch(docs, lanes, coord.lane, inner=eng.inner)
        t = {k: torch.from_numpy(v) for k, v in mb.items()}
        loss = model(t["input_ids"], t["position_ids"], t["labels"], attn=eng.bind(mb["lengths"]),
                     num_valid_tokens=sum(n - 1 for n in lengths))
        fwd = dict(stats.bytes)
        loss.backward()
        bwd = {k: v - fwd.get(k, 0) for k, v in stats.bytes.items()}
        c, u, r = lanes, eng.inner, eng.outer
        s = int(sum(-(-n // (2 * c)) * 2 * c for n in lengths))  # padded tokens of the group
        b = 4
        dq, dkv = cfg.num_heads // tp * cfg.dim_per_head, cfg.num_kv_heads // tp * cfg.dim_per_head
        a2a = s / c * 2 * (dq + dkv) * b * (u - 1) / u
        ring = 2 * s * (dkv / u) * b * (r - 1) / r
        L = cfg.num_layers
        out.append({**lay, "degree": c, "inner": u, "outer": r, "s_padded": s, "tokens": sum(lengths),
                    "fwd_counted": sum(fwd.values()) / L, "fwd_formula": a2a + ring,
                    "bwd_counted": sum(bwd.values()) / L, "bwd_formula": a2a + 2 * ring,
                    "fwd_by_kind": {k: v / L for k, v in fwd.items()}})
    return out


# ---- engines -------------------------------------------------------------------------------


def _doc_lengths(total: int, seed: int = 0) -> list[int]:
    """Long-tailed doc lengths (lognormal) summing to ``total``."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(min(total - sum(lengths), max(1, rng.lognormal(5.5, 1.2)))))
    return lengths


def _engines_rank(rank: int, world: int, total: int, heads: int, kv_heads: int, head_dim: int, repeats: int,
                  device: str) -> list[dict]:
    dev = torch.device(device)
    proper = [u for u in range(2, world) if world % u == 0]
    groups = GroupCache.build([Topology.uniform(world)], inner_sizes=proper)
    ranks = tuple(range(world))
    lengths = _doc_lengths(total)
    rows = []
    for kind, inner in [("ring", 1), ("ulysses", world)] + [("nested", u) for u in proper]:
        if kv_heads % inner:
            continue
        stats = CommStats()
        eng = make_engine(kind, groups, ranks, rank, inner=inner, stats=stats)
        n = PackedLayout(lengths=tuple(lengths), degree=world, inner=eng.inner).lane_tokens
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(n, heads, head_dim, generator=g).to(dev).requires_grad_()
        k = torch.randn(n, kv_heads, head_dim, generator=g).to(dev).requires_grad_()
        v = torch.randn(n, kv_heads, head_dim, generator=g).to(dev).requires_grad_()
        attn = eng.bind(lengths)

        def step() -> None:
            attn(q, k, v).sum().backward()  # noqa: B023 (runs inside this iteration)
            if dev.type == "cuda":
                torch.cuda.synchronize()

        step()
        stats.reset()
        ts = _timed(step, repeats)
        rows.append({"engine": kind, "inner": eng.inner, "outer": eng.outer, "tokens": total, "docs": len(lengths),
                     "fwd_bwd_ms": 1e3 * statistics.median(ts),
                     "bytes_per_rank": stats.total() // repeats, "exposed_wait_ms": 1e3 * stats.wait_s / repeats})
    return rows


# ---- kernels (one device) --------------------------------------------------------------------


def _kernels(device: str, repeats: int) -> list[dict]:
    from parallel_runtime.engines.attention import resolve_impl, varlen_attention

    dev = torch.device(device)
    # "auto" picks flash-attention exactly when it is installed and the tensor is a bf16 CUDA one
    flash = resolve_impl("auto", torch.empty(0, device=dev, dtype=torch.bfloat16)) == "flash"
    impls = ["masked", "loop", "sdpa"] + (["flash"] if flash else [])
    rows = []
    rng = np.random.default_rng(0)
    for total in (2048, 8192) if dev.type == "cuda" else (1024, 2048):
        lengths = []
        while sum(lengths) < total:
            lengths.append(int(min(total - sum(lengths), max(1, rng.lognormal(5.5, 1.0)))))
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=dev, dtype=torch.int32)
        for impl in impls:
            dtype = torch.bfloat16 if impl == "flash" else torch.float32
            q = torch.randn(total, 8, 64, device=dev, dtype=dtype, requires_grad=True)
            k = torch.randn(total, 4, 64, device=dev, dtype=dtype, requires_grad=True)
            v = torch.randn(total, 4, 64, device=dev, dtype=dtype, requires_grad=True)
            ts = []
            for i in range(repeats + 1):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                varlen_attention(q, k, v, cu, impl=impl).sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    ts.append(time.perf_counter() - t0)
            rows.append({"tokens": total, "docs": len(lengths), "impl": impl, "dtype": str(dtype),
                         "fwd_bwd_ms": 1e3 * statistics.median(ts)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("section", choices=["overlap", "bytes", "engines", "kernels"])
    ap.add_argument("--tokens", type=int, default=4096, help="engines: tokens of the packed batch")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="smaller overlap cases (a smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--cases", default=None, help="overlap cases as JSON: [{tokens_per_rank, heads, kv_heads, "
                    "head_dim}, ...]")
    args = ap.parse_args(argv)
    if args.section == "overlap":
        cases = OVERLAP_CASES if not args.quick else [{"tokens_per_rank": 128, "heads": 2, "kv_heads": 2,
                                                       "head_dim": 16}]
        if args.cases:
            cases = json.loads(args.cases)
        rows = spawn_world(_overlap_rank, args.world_size, cases, args.repeats, args.device, timeout_s=1800,
                           threads=args.threads)[0]
        print("| tokens/rank | heads (kv) | K/V message | transfers alone | step serial | step overlapped "
              "| speedup (IQR) | waiting, serial | waiting, overlapped |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            lo, hi = r["speedup_iqr"]
            print(f"| {r['tokens_per_rank']} | {r['heads']} ({r['kv_heads']}) | {r['kv_bytes_per_message'] / 2**20:.2f}"
                  f" MiB | {r['transfer_ms']:.1f} ms | {r['serial_ms']:.1f} ms | {r['overlap_ms']:.1f} ms | "
                  f"{r['speedup']:.3f}x ({lo:.2f}-{hi:.2f}) | {r['exposed_serial_ms']:.1f} ms | "
                  f"{r['exposed_overlap_ms']:.1f} ms |")
    elif args.section == "bytes":
        w = args.world_size
        layouts = [{"engine": "ring", "tp": 1, "inner": 1}, {"engine": "ulysses", "tp": 1, "inner": w},
                   {"engine": "nested", "tp": 1, "inner": 2}, {"engine": "ring", "tp": 2, "inner": 1},
                   {"engine": "nested", "tp": 1, "inner": w // 2}]
        layouts = [lay for lay in layouts if w % (lay["tp"] * lay["inner"]) == 0 and w // lay["tp"] > 1]
        if w // 2 < 2:
            layouts = [lay for lay in layouts if lay["engine"] != "nested"]
        uniq = []
        for lay in layouts:
            if lay not in uniq:
                uniq.append(lay)
        lengths = [1, 37, 255, 600, 1023, 77, 3, 1500]
        results = spawn_world(_bytes_rank, w, uniq, lengths, timeout_s=900)
        rows = results[0]
        print("| engine | tp | degree | inner x outer | s (padded) | fwd counted | fwd formula | ratio "
              "| bwd counted | bwd formula | ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['engine']} | {r['tp']} | {r['degree']} | {r['inner']} x {r['outer']} | {r['s_padded']} | "
                  f"{r['fwd_counted']:.0f} | {r['fwd_formula']:.0f} | {r['fwd_counted'] / r['fwd_formula']:.4f} | "
                  f"{r['bwd_counted']:.0f} | {r['bwd_formula']:.0f} | {r['bwd_counted'] / r['bwd_formula']:.4f} |")
        # every rank sends the same amount: check it
        for res in results[1:]:
            for a, b in zip(res, rows):
                assert a["fwd_counted"] == b["fwd_counted"], "ranks sent different byte counts"
    elif args.section == "engines":
        rows = spawn_world(_engines_rank, args.world_size, args.tokens, 8, 8, 64, args.repeats, args.device,
                           timeout_s=1800, threads=args.threads)[0]
        print("| engine | inner x outer | tokens (docs) | fwd+bwd | bytes sent per rank | waiting on ring |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['engine']} | {r['inner']} x {r['outer']} | {r['tokens']} ({r['docs']}) | "
                  f"{r['fwd_bwd_ms']:.1f} ms | {r['bytes_per_rank'] / 2**20:.2f} MiB | {r['exposed_wait_ms']:.1f} ms |")
    else:
        rows = _kernels(args.device, args.repeats)
        print("| tokens | docs | impl | dtype | fwd+bwd |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['tokens']} | {r['docs']} | {r['impl']} | {r['dtype']} | {r['fwd_bwd_ms']:.2f} ms |")
    print(json.dumps(rows), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
