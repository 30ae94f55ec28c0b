"""Loader throughput: shards -> materialized microbatches, against plain webdataset reading of the same shards.

Both run in one process, alternating, ``--repeats`` times; medians are reported.

* **plain webdataset**: ``webdataset.WebDataset(urls).decode()`` over every shard, summing
  each sample's token count (the tokens decoded, nothing else done).
* **loader, whole cluster**: one BalancedLoader (planning in its background thread) and
  every rank's microbatches materialized in this process (``loader.microbatches(plan, r)``):
  int64 ``input_ids``/``labels``/``position_ids`` and ``cu_seqlens`` for all ``--world``
  ranks, i.e. every token of the epoch once, like the plain read.
* **loader, one rank**: what one rank of a real job does: plan every step and materialize
  only its own microbatches; compared with plain reading of ``1/world`` of the shards
  (webdataset's split by node), i.e. plain time / world.

Bytes read per rank (counted by the source) are reported against the bytes of that rank's
own tokens: a rank reads only its segments (one ``pread`` per run, plus one token of look-ahead
for the last label of a run cut by context parallelism), never the whole dataset.

The whole-cluster path runs once per integrity mode of the source, side by side (``verify=``
``full``, the default: member headers once per doc plus the block checksums of every read;
``header``: headers only; ``off``: no checks), so the cost of the checks is a ratio from one run.
With checksums a read is widened to whole checksum blocks, and the first read of a doc also reads
its headers (about 640 bytes); the bytes-read ratios show both.

    python tools/bench_loader.py                  # stdlib corpus shards in .demo/ (built once)
    python tools/bench_loader.py --shards DIR --world 16 --global-batch-tokens 524288
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

from balanced_loader.build.corpus import stdlib_shards
from balanced_loader.data.shards import VERIFY_MODES, ShardSource
from balanced_loader.loader import BalancedLoader
from balanced_loader.materialize import needed_token_count
from balanced_loader.outputs.files import atomic_write
from balanced_loader.outputs.records import Figure, tool_command, update_record
from balanced_loader.presets import resolve_cost

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plain_read(urls: list[str]) -> tuple[int, float]:
    import webdataset as wds

    t0 = time.perf_counter()
    tokens = 0
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode():
        tokens += len(sample["npy"])
    return tokens, time.perf_counter() - t0


def make_loader(src: ShardSource, args: argparse.Namespace, rank: int = 0) -> BalancedLoader:
    cost = resolve_cost(args.cost, args.world)
    if args.lane_cap:
        cost = cost.with_base(max_tokens_per_lane=args.lane_cap)
    return BalancedLoader(src, policy=args.policy, cost=cost, world_size=args.world, rank=rank,
                          global_batch_tokens=args.global_batch_tokens, seed=args.seed, epochs=1,
                          prefetch_steps=args.prefetch_steps, planner_workers=args.planner_workers)


def loader_cluster(src: ShardSource, args: argparse.Namespace) -> dict:
    """Every rank's microbatches of one epoch, materialized in this process."""
    world = args.world
    read = [0] * world
    needed = [0] * world
    tokens = positions = steps = groups = cp_groups = 0
    wait = plan_s = 0.0
    t0 = time.perf_counter()
    loader = make_loader(src, args)
    while True:
        before = src.bytes_read
        batch = next(loader, None)  # materializes rank 0
        if batch is None:
            break
        steps += 1
        wait += batch.planner_wait_s
        plan_s += batch.plan.plan_seconds
        for r in range(world):
            if r:
                before = src.bytes_read
            mbs = batch.microbatches if r == 0 else loader.microbatches(batch.plan, r)
            read[r] += src.bytes_read - before
            n = needed_token_count(mbs)
            needed[r] += n * src.dtype.itemsize
            tokens += n
            positions += sum(m.num_tokens for m in mbs)
        for p in batch.plan.pools:
            for mb in p.microbatches:
                groups += len(mb)
                cp_groups += sum(g.degree > 1 for g in mb)
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "positions": positions, "seconds": seconds, "steps": steps, "planner_wait_s": wait,
            "plan_seconds": plan_s,
            "bytes_read": read, "bytes_needed": needed, "groups": groups, "cp_groups": cp_groups,
            "max_seq_len": loader.max_seq_len}


READ_CHUNK = 2048


def read_path(folder: str, repeats: int) -> dict[str, list[float]]:
    """Seconds to read every doc whole and then in ``READ_CHUNK``-token pieces, per integrity mode,
    each repeat with fresh sources (headers checked again), modes interleaved."""
    out: dict[str, list[float]] = {m: [] for m in VERIFY_MODES}
    for i in range(repeats):
        for m in VERIFY_MODES[i % 3:] + VERIFY_MODES[:i % 3]:
            src = ShardSource(folder, verify=m)
            t0 = time.perf_counter()
            for d in range(src.num_docs):
                n = int(src.lengths[d])
                src.read(d, 0, n)
                for a in range(0, n, READ_CHUNK):
                    src.read(d, a, min(READ_CHUNK, n - a))
            out[m].append(time.perf_counter() - t0)
            src.close()
    return out


def loader_one_rank(src: ShardSource, args: argparse.Namespace, rank: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = sum(needed_token_count(list(b.microbatches)) for b in make_loader(src, args, rank))
    return tokens, time.perf_counter() - t0


def write_figures(args: argparse.Namespace, speed: float, bytes_off: float, bytes_full: float, full: float,
                  header: float) -> None:
    """This run's figures as the benchmark's record (docs/RESULTS.md is made from the records): ``bytes_off`` /
    ``bytes_full`` the worst rank's bytes read / needed without checks and with the default ones."""
    see = "docs/results/data_loader.md"
    figures = [
        Figure(id="loader.throughput", area="data", topic="loader", see=see, target=">= 0.8",
               figure="shards -> materialized microbatches vs plain webdataset read, same shards",
               value=f"**{speed:.2f}** (whole cluster of {args.world} ranks, verify=full, median of {args.repeats})"),
        Figure(id="loader.bytes_read", area="data", topic="loader", see=see, target="< 1.1",
               figure="bytes read per rank / bytes needed (verify=off; the default checks: integrity below)",
               value=f"**{bytes_off:.4f}** max"),
        Figure(id="reliability.integrity_cost", area="reliability", topic="integrity",
               see="docs/results/reliability.md", target="stated",
               figure="loader cost of the default checks (crc per doc and per 1 KiB block)",
               value=f"full checks {full:.2f}x the time of none for the whole cluster, header-only {header:.2f}x; "
                     f"worst rank reads {bytes_full:.2f}x the bytes it needs"),
    ]
    update_record(args.record, "bench_loader", figures, command=tool_command(),
                  details={"args": {k: v for k, v in vars(args).items() if k not in ("json", "record")}})
    print(f"wrote the record {args.record}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default=os.path.join(REPO, ".demo", "stdlib-shards"),
                   help="shard folder (default: the stdlib corpus in .demo/, built if missing)")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--policy", default="greedy")
    p.add_argument("--cost", default="analytic:tiny@cpu", help="cost preset or cost file")
    p.add_argument("--lane-cap", type=int, default=32768,
                   help="max_tokens_per_lane override (0: the cost model's); long docs then use CP groups")
    p.add_argument("--global-batch-tokens", type=int, default=262144)
    p.add_argument("--prefetch-steps", type=int, default=2)
    p.add_argument("--planner-workers", type=int, default=0, help="0: planner thread; N: N planner processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--record", metavar="PATH",
                   help="write the figures as a record (docs/results/records/bench_loader.json; then run "
                        "python -m balanced_loader.outputs.records)")
    args = p.parse_args(argv)

    if os.path.abspath(args.shards) == os.path.join(REPO, ".demo", "stdlib-shards"):
        src = stdlib_shards(args.shards, progress=sys.stderr.isatty())
    else:
        src = ShardSource(args.shards)
    urls = [src.shard_path(i) for i in range(len(src.shard_names))]
    print(f"{src.describe()}: {src.num_docs} docs, {src.num_tokens} tokens ({src.dtype}), {len(urls)} shards; "
          f"world {args.world}, policy {args.policy}, {args.global_batch_tokens} tokens/step, "
          f"lane cap {args.lane_cap or 'from cost'}, {args.repeats} repeats", flush=True)

    stats = make_loader(src, args).epoch_stats(0)
    print(f"epoch 0 doc stats: {stats.to_json()}")
    logging.getLogger("balanced_loader").setLevel(logging.ERROR)  # the same line for every loader below
    plain_read(urls)  # warm the page cache for both
    plain_t, rank_t = [], []
    mode_t: dict[str, list[float]] = {m: [] for m in VERIFY_MODES}
    runs: dict[str, dict] = {}
    rank_tokens = plain_tokens = None
    for i in range(args.repeats):  # rotate which path goes first, so drifting load hits all alike
        order = [*VERIFY_MODES, "plain"]
        for what in order[i % len(order):] + order[:i % len(order)]:
            if what == "plain":
                plain_tokens, t = plain_read(urls)
                plain_t.append(t)
            else:
                # a fresh source per run, so every run pays the once-per-doc header checks (a real first epoch)
                runs[what] = loader_cluster(ShardSource(src.folder, verify=what), args)
                mode_t[what].append(runs[what]["seconds"])
        rank_tokens, t = loader_one_rank(src, args, 0)
        rank_t.append(t)
    assert plain_tokens is not None and rank_tokens is not None
    cluster, cluster_t = runs["full"], mode_t["full"]
    plain_s, cluster_s, rank_s = (statistics.median(x) for x in (plain_t, cluster_t, rank_t))
    plain_rate = plain_tokens / plain_s
    cluster_rate = cluster["tokens"] / cluster_s
    rank_rate = rank_tokens / rank_s
    share_rate = plain_rate  # a rank reading 1/world of the shards reads at the same rate
    ratios = [r / max(n, 1) for r, n in zip(cluster["bytes_read"], cluster["bytes_needed"])]
    for m in VERIFY_MODES:
        assert runs[m]["tokens"] == plain_tokens == src.num_tokens, "every token must be delivered exactly once"

    print()
    print("| path | tokens | seconds (median) | tokens/s | vs plain |")
    print("|---|---:|---:|---:|---:|")
    print(f"| plain webdataset read, all shards | {plain_tokens:,} | {plain_s:.3f} | {plain_rate / 1e6:.1f}M | 1.00 |")
    for m in VERIFY_MODES:
        s = statistics.median(mode_t[m])
        rate = runs[m]["tokens"] / s
        print(f"| loader, whole cluster ({args.world} ranks materialized), verify={m} | {runs[m]['tokens']:,} "
              f"| {s:.3f} | {rate / 1e6:.1f}M | {rate / plain_rate:.2f} |")
    print(f"| loader, one rank (plans every step, reads its share) | {rank_tokens:,} | {rank_s:.3f} "
          f"| {rank_rate / 1e6:.1f}M | {rank_rate / share_rate:.2f} |")
    print()
    print(f"steps {cluster['steps']}, groups {cluster['groups']} ({cluster['cp_groups']} with CP > 1), "
          f"max_seq_len {cluster['max_seq_len']}, planning {cluster['plan_seconds']:.3f} s in total "
          f"(every rank plans every step; rank 0 waited {cluster['planner_wait_s']:.3f} s for plans), "
          f"positions incl. CP padding {cluster['positions']:,}")
    def paired(m: str) -> float:  # median over repeats of this mode's time / verify=off's in the same repeat
        return statistics.median(a / b for a, b in zip(mode_t[m], mode_t["off"]))

    print(f"integrity checks, whole cluster: verify=full {paired('full'):.3f}x, verify=header "
          f"{paired('header'):.3f}x the time of verify=off (median of per-repeat ratios)")
    reads = read_path(src.folder, args.repeats)
    medians = ", ".join(f"verify={m} {statistics.median(t):.3f} s" for m, t in reads.items())
    print(f"integrity checks, source reads only (every doc whole, then in {READ_CHUNK}-token pieces; "
          f"median s of {args.repeats}): {medians}"
          + f"; full/off {statistics.median(a / b for a, b in zip(reads['full'], reads['off'])):.3f}x, "
            f"header/off {statistics.median(a / b for a, b in zip(reads['header'], reads['off'])):.3f}x")
    for m in VERIFY_MODES:
        r = [a / max(n, 1) for a, n in zip(runs[m]["bytes_read"], runs[m]["bytes_needed"])]
        print(f"verify={m}: bytes read / bytes needed per rank: " + ", ".join(f"{x:.4f}" for x in r)
              + f" (max {max(r):.4f}; each rank reads {sum(runs[m]['bytes_read']) / args.world / 2**20:.1f} MiB "
                f"of the {sum(os.path.getsize(u) for u in urls) / 2**20:.1f} MiB of shards)")
    if args.record:
        off = max(a / max(n, 1) for a, n in zip(runs["off"]["bytes_read"], runs["off"]["bytes_needed"]))
        write_figures(args, cluster_rate / plain_rate, off, max(ratios), paired("full"), paired("header"))
    if args.json:
        with atomic_write(args.json, "w") as f:
            json.dump({"args": vars(args), "plain_s": plain_t, "cluster_s": cluster_t, "rank_s": rank_t,
                       "verify_s": mode_t, "verify_bytes_read": {m: runs[m]["bytes_read"] for m in VERIFY_MODES},
                       "read_path_s": reads,
                       "plain_tokens": plain_tokens, "rank_tokens": rank_tokens, "cluster": cluster,
                       "ratio_cluster": cluster_rate / plain_rate, "ratio_rank": rank_rate / share_rate,
                       "bytes_ratio_max": max(ratios)}, f, indent=1)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"bench_loader: error: {e}", file=sys.stderr)
        sys.exit(2)
