"""HydraCPScheduler against megatron-core's BalancedCPScheduler, judged under Megatron's execution model.

Both schedulers get the same ``sample_id_seqlens``; each schedule is timed by
:func:`balanced_loader.planning.megatron_cp.modeled_ms` (each sample its own forward/backward with the
contract-2 cost, every rank's samples back to back, a sample starting when all its ranks reach it, a
barrier after each group) with one cost (``hydra-gpt7b-a100``: FlexSP's GPT-7B A100 coefficients,
``microbatch_ms`` 30, lane cap 8192 = ``max_seq_len_per_rank``). Every output of both is checked by
``check_schedule`` (Megatron's rules). Megatron's scheduler runs on CPU as it is: its constructor reads
only ``dp_cp_group.size()`` and ``get_groups_and_subsamples`` never touches the group, so an object with a
``size()`` stands in for the process group (tests/balanced_loader/integrations/test_megatron_cp.py also runs both on
torch's fake process group).

Sections (``--only``):

* ``wikipedia``: for each lane count (``--lanes``, default 64 and 512) and context (32K, 256K): the docs of at
  most ``context`` tokens of data/wikipedia_lengths.txt.gz in a seeded shuffle, each batch the next docs until
  4 x lanes x 8192 tokens (tools/bench_planner.py's rule), ``--batches`` batches. Per batch: both modeled
  times, the speedup, each against the lower bound (:func:`lower_bound_ms`, below every valid schedule), the
  groups, the planning seconds of both (wall, one call each, same shared machine), and which of our
  candidates won.
* ``zoo``: corpora of real files of this machine, a file's byte size as its token count (the byte-level
  tokenizer): CPython's standard library, the venv's site-packages (.py), C headers (/usr/include), man pages
  (uncompressed sizes from the gzip trailer), /usr/share/doc, license texts, and Wikipedia; docs over the
  context cut into context-size pieces (as a loader with long_docs=split gives them); 8 and 64 lanes, 32K and
  256K (64K on 8 lanes, which hold at most 8 x 8192 tokens a sample), up to ``--zoo-batches`` batches each.
  Ours is also run without Megatron's schedule as a candidate (``megatron_candidate=False``), to show the
  placement alone is never slower.

    PYTHONPATH=. python tools/bench_megatron_cp.py                  # both sections (Megatron at 512 lanes: minutes)
    PYTHONPATH=. python tools/bench_megatron_cp.py --only zoo --json zoo.json

Needs megatron-core (``pip install --no-deps megatron-core==0.16.1``); without it the faithful reproduction
``mcore_dcp.schedule`` stands in for Megatron (the output says so).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import struct
import sysconfig
import time
import warnings

import numpy as np

from balanced_loader.integrations.megatron import HydraCPScheduler, check_schedule
from balanced_loader.planning.megatron_cp import lower_bound_ms, modeled_ms
from balanced_loader.planning.policies.mcore_dcp import schedule as mcore_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIKI = os.path.join(REPO, "data", "wikipedia_lengths.txt.gz")
CAP = 8192


class DpCpGroup:
    """What BalancedCPScheduler reads of its process group."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def megatron(lanes: int):
    """``(name, schedule(pairs) -> sample_id_groups)`` of megatron-core's scheduler, or the reproduction."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError:
        def repro(pairs):
            lengths = np.asarray([s for _, s in pairs])
            out = []
            for rnd in mcore_schedule(lengths, lanes, CAP):
                per = [[] for _ in range(lanes)]
                for first, size, docs in rnd:
                    for r in range(first, first + size):
                        per[r] = [pairs[i][0] for i in docs]
                out.append(per)
            return out
        return "reproduction (megatron-core not installed)", repro
    return "megatron-core BalancedCPScheduler", \
        lambda pairs: BalancedCPScheduler(CAP, DpCpGroup(lanes)).get_groups_and_subsamples(pairs, None)[1]


def batches(docs: np.ndarray, lanes: int, count: int) -> list[np.ndarray]:
    out, pos, budget = [], 0, 4 * lanes * CAP
    while len(out) < count and pos < len(docs):
        c = np.cumsum(docs[pos:pos + budget])  # enough docs: each has at least one token
        k = max(1, int(np.searchsorted(c, budget, side="right")))
        if c[min(k, len(c)) - 1] < budget // 2 and len(out):
            break  # a last partial batch under half the budget is not a batch
        out.append(docs[pos:pos + k])
        pos += k
    return out


def compare(b: np.ndarray, lanes: int, meg, *, also_alone: bool = False) -> dict:
    pairs = list(enumerate(b.tolist()))
    t0 = time.perf_counter()
    mids = meg(pairs)
    meg_s = time.perf_counter() - t0
    ours = HydraCPScheduler(CAP, world_size=lanes)
    t0 = time.perf_counter()
    groups, ids = ours.get_groups_and_subsamples(pairs)
    our_s = time.perf_counter() - t0
    check_schedule(ids, pairs, lanes, CAP, groups=groups)
    check_schedule(mids, pairs, lanes, CAP)
    cost = ours.cost
    mm, hm = modeled_ms(mids, pairs, cost, lanes), modeled_ms(ids, pairs, cost, lanes)
    lb = lower_bound_ms(b, cost.shape(1, 1), lanes, CAP)
    row = {"docs": len(b), "longest": int(b.max()), "megatron_ms": mm, "ours_ms": hm, "speedup": mm / hm,
           "ours_over_bound": hm / lb, "megatron_over_bound": mm / lb, "megatron_groups": len(mids),
           "ours_groups": len(ids), "won": ours.last["how"], "megatron_plan_s": meg_s, "ours_plan_s": our_s}
    if also_alone:
        alone = HydraCPScheduler(CAP, world_size=lanes, megatron_candidate=False)
        g2, ids2 = alone.get_groups_and_subsamples(pairs)
        check_schedule(ids2, pairs, lanes, CAP, groups=g2)
        row["alone_speedup"] = mm / modeled_ms(ids2, pairs, cost, lanes)
    return row


def wiki_lengths() -> np.ndarray:
    with gzip.open(WIKI) as f:
        return np.loadtxt(f, dtype=np.int64)


def bench_wikipedia(lane_counts: list[int], count: int, out: dict) -> None:
    wiki = wiki_lengths()
    print("\n### Wikipedia: HydraCPScheduler vs Megatron under Megatron's execution model\n")
    for lanes in lane_counts:
        name, meg = megatron(lanes)
        ours_tot = meg_tot = 0.0
        for ctx in (32768, 262144):
            docs = wiki[wiki <= ctx]
            docs = docs[np.random.default_rng(0).permutation(len(docs))]
            print(f"{lanes} lanes, {ctx // 1024}K context, Megatron = {name}\n")
            print("| batch | docs | longest | Megatron ms | ours ms | speedup | ours / bound | Megatron / bound | "
                  "groups (Megatron) | Megatron plan s | ours plan s | won |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            rows = []
            for k, b in enumerate(batches(docs, lanes, count)):
                r = compare(b, lanes, meg)
                rows.append(r)
                print(f"| {k} | {r['docs']:,} | {r['longest']:,} | {r['megatron_ms']:,.0f} | {r['ours_ms']:,.0f} | "
                      f"{r['speedup']:.3f} | {r['ours_over_bound']:.4f} | {r['megatron_over_bound']:.3f} | "
                      f"{r['megatron_groups']} | {r['megatron_plan_s']:.2f} | {r['ours_plan_s']:.2f} | {r['won']} |",
                      flush=True)
            ours_tot = sum(r["ours_ms"] for r in rows)
            meg_tot = sum(r["megatron_ms"] for r in rows)
            summary = {"lanes": lanes, "context": ctx, "megatron": name, "rows": rows,
                       "total_speedup": meg_tot / ours_tot, "min_speedup": min(r["speedup"] for r in rows),
                       "plan_s_ratio_median": statistics.median(r["ours_plan_s"] / r["megatron_plan_s"]
                                                                for r in rows)}
            out.setdefault("wikipedia", []).append(summary)
            print(f"\ntotal over {len(rows)} batches: Megatron / ours = {summary['total_speedup']:.3f} (per batch min "
                  f"{summary['min_speedup']:.3f}); planning time ours / Megatron median "
                  f"{summary['plan_s_ratio_median']:.3f}\n")


def gzip_size(path: str) -> int:
    """The uncompressed size a gzip file records in its trailer (mod 2^32; man pages are far smaller)."""
    with open(path, "rb") as f:
        f.seek(-4, 2)
        return struct.unpack("<I", f.read(4))[0]


def zoo() -> dict[str, np.ndarray]:
    """Real files of this machine as corpora: byte sizes, in sorted path order (shuffled per batch below)."""
    def sizes(paths, fn=os.path.getsize):
        out = []
        for p in sorted(set(paths)):
            try:
                if os.path.isfile(p) and not os.path.islink(p):
                    out.append(fn(p))
            except OSError:
                continue
        return np.asarray([s for s in out if s > 0], dtype=np.int64)

    stdlib = sysconfig.get_paths()["stdlib"]
    purelib = sysconfig.get_paths()["purelib"]
    corpora = {
        "cpython-stdlib": sizes(glob.glob(f"{stdlib}/**/*.py", recursive=True)),
        "site-packages": sizes(glob.glob(f"{purelib}/**/*.py", recursive=True)),
        "c-headers": sizes(glob.glob("/usr/include/**/*.h", recursive=True)),
        "man-pages": sizes(glob.glob("/usr/share/man/**/*.gz", recursive=True), gzip_size),
        "share-doc": sizes(glob.glob("/usr/share/doc/**/*", recursive=True)),
        "licenses": sizes(glob.glob("/usr/share/common-licenses/*")),
        "wikipedia": wiki_lengths(),
    }
    return {k: v for k, v in corpora.items() if len(v)}


def bench_zoo(lane_counts: list[int], count: int, out: dict) -> None:
    print("\n### Zoo: corpora of real files (byte sizes as tokens), docs cut at the context\n")
    print("| corpus | files | lanes | context | batches | min speedup | total speedup | min speedup, placement alone "
          "| max ours / bound | won |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, lengths in zoo().items():
        for lanes in lane_counts:
            _, meg = megatron(lanes)
            for ctx in sorted({32768, min(262144, lanes * CAP)}):  # a piece must fit the lanes (8 lanes: 64K)
                pieces = np.concatenate([np.full(int((lengths // ctx).sum()), ctx, np.int64), lengths % ctx])
                pieces = pieces[pieces > 0]
                pieces = pieces[np.random.default_rng(1).permutation(len(pieces))]
                rows = [compare(b, lanes, meg, also_alone=True) for b in batches(pieces, lanes, count)]
                if not rows:
                    continue
                won = sorted({r["won"] for r in rows})
                res = {"corpus": name, "files": len(lengths), "lanes": lanes, "context": ctx, "batches": len(rows),
                       "min_speedup": min(r["speedup"] for r in rows),
                       "total_speedup": sum(r["megatron_ms"] for r in rows) / sum(r["ours_ms"] for r in rows),
                       "min_alone_speedup": min(r["alone_speedup"] for r in rows),
                       "max_ours_over_bound": max(r["ours_over_bound"] for r in rows), "won": won, "rows": rows}
                out.setdefault("zoo", []).append(res)
                print(f"| {name} | {len(lengths):,} | {lanes} | {ctx // 1024}K | {len(rows)} | "
                      f"{res['min_speedup']:.3f} | {res['total_speedup']:.3f} | {res['min_alone_speedup']:.3f} | "
                      f"{res['max_ours_over_bound']:.4f} | {','.join(won)} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="wikipedia,zoo", help="comma-separated: wikipedia, zoo")
    ap.add_argument("--lanes", default="64,512", help="lane counts of the wikipedia section (default 64,512)")
    ap.add_argument("--batches", type=int, default=8, help="wikipedia batches per lane count and context (8)")
    ap.add_argument("--zoo-lanes", default="8,64", help="lane counts of the zoo (default 8,64)")
    ap.add_argument("--zoo-batches", type=int, default=4, help="zoo batches per corpus, lanes and context (4)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure here")
    args = ap.parse_args()
    only = set(args.only.split(","))
    out: dict = {"cost": "hydra-gpt7b-a100", "max_seq_len_per_rank": CAP}
    if "wikipedia" in only:
        bench_wikipedia([int(x) for x in args.lanes.split(",")], args.batches, out)
    if "zoo" in only:
        bench_zoo([int(x) for x in args.zoo_lanes.split(",")], args.zoo_batches, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
