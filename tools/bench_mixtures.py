"""The mixture and schedule figures of issue 21, measured on real shard folders (docs/results/mixtures.md).

Three shard folders are built (once, under ``--dir``) from the CPython standard library's ``.py``
files with the byte tokenizer: ``tests`` (files under a test folder), ``packages`` (the other
package files) and ``modules`` (top-level modules). Then, with ``BalancedLoader`` on 4 ranks,
policy hydra, cost ``hydra-gpt7b-a100``, 131,072 tokens per step, ``max_seq_len`` 4096:

1. shares: weights tests/packages/modules 0.6/0.3/0.1 by tokens (``long_docs=truncate``, so no doc
   is longer than ``max_seq_len``), every step of the mixture's first two epochs: each source's
   tokens against its share of the step (in units of ``max_seq_len``), and its share of the run;
   the per-source tokens are counted from the plans' segments and must equal ``mixture_tokens``;
2. repeats: per source, the spread (max - min) of how often each doc with tokens was delivered, after
   every step (empty docs are skipped, never delivered);
3. a weight schedule from (0.6, 0.3, 0.1) at step 10 to (0.2, 0.2, 0.6) at step 20, 30 steps;
4. a ``max_seq_len`` schedule from 512 at step 0 to 4096 at step 20 (``long_docs=split``), 25 steps:
   the longest segment of each step against that step's limit;
5. resume: the state after step 7 at world size 4, loaded at world size 2: the next 20 global
   batches (every segment, step by step) against an uninterrupted world-size-4 run;
6. bad input: ``balanced-loader plan --mix ...`` with each mistake: exit code and stderr.

    python tools/bench_mixtures.py --dir /tmp/mixbench
    python tools/bench_mixtures.py --adversarial 60     # synthetic worst cases of the per-step share
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from balanced_loader.data.mixture import mix
from balanced_loader.loader import BalancedLoader
from balanced_loader.schedule import schedule

WEIGHTS = {"tests": 0.6, "packages": 0.3, "modules": 0.1}
COST = "hydra-gpt7b-a100"
L = 4096
BUDGET = 131072


def build(folder: str) -> dict[str, str]:
    from balanced_loader.build.builder import build_from_files
    from balanced_loader.build.corpus import stdlib_py_files, stdlib_root
    from balanced_loader.data.index import INDEX_FILE

    groups: dict[str, list[str]] = {k: [] for k in WEIGHTS}
    root = stdlib_root()
    for f in stdlib_py_files():
        parts = os.path.relpath(f, root).split(os.sep)
        key = "tests" if any(p.startswith("test") or p in ("idlelib", "lib2to3") for p in parts[:-1]) else (
            "modules" if len(parts) == 1 else "packages")
        groups[key].append(f)
    out = {}
    for name, files in groups.items():
        out[name] = os.path.join(folder, name)
        if not os.path.exists(os.path.join(out[name], INDEX_FILE)):
            build_from_files(files, out[name], max_shard_bytes=4 << 20)
    return out


def loader(source, *, world=4, rank=0, **kw):
    args = {"policy": "hydra", "cost": COST, "world_size": world, "rank": rank, "global_batch_tokens": BUDGET,
            "seed": 0, "max_seq_len": L, "long_docs": "truncate", "epochs": None, "prefetch_steps": 2,
            "validate": True}
    args.update(kw)
    return BalancedLoader(source, **args)


def segments(plan):
    return sorted((int(d), int(s), int(n)) for p in plan.pools for mb in p.microbatches for g in mb
                  for d, s, n in g.segments)


def per_source_tokens(m, plan) -> dict[str, int]:
    out = dict.fromkeys(m.names, 0)
    for d, _, n in segments(plan):
        out[m.split_id(d)[0]] += n
    return out


def deviation(m, batch, limit) -> float:
    """The largest |tokens - share * step tokens| over the sources, in units of ``limit``."""
    w = dict(zip(m.names, m.weights.at(batch.step)))
    total = sum(batch.mixture_tokens.values())
    return max(abs(batch.mixture_tokens[n] - w[n] * total) for n in m.names) / limit


def shares_and_repeats(folders) -> dict:
    m = mix(folders, weights=WEIGHTS)
    ld = loader(m, epochs=2)
    counts = {n: np.zeros(s.num_docs, dtype=np.int64) for n, s in zip(m.names, m.sources)}
    live = {n: np.asarray(s.lengths) > 0 for n, s in zip(m.names, m.sources)}  # empty docs are never delivered
    worst, spread, totals, steps = 0.0, 0, dict.fromkeys(m.names, 0), 0
    for b in ld:
        assert per_source_tokens(m, b.plan) == b.mixture_tokens, b.step  # the plan holds what the loader says
        worst = max(worst, deviation(m, b, L))
        for n in m.names:
            totals[n] += b.mixture_tokens[n]
        for d in {d for d, _, _ in segments(b.plan)}:
            name, local = m.split_id(d)
            counts[name][local] += 1
        spread = max(spread, max(int(c[live[n]].max() - c[live[n]].min()) for n, c in counts.items()))
        steps += 1
    grand = sum(totals.values())
    share = {n: totals[n] / grand for n in m.names}
    return {"steps": steps, "worst_step_deviation_in_max_seq_len": round(worst, 4),
            "run_share": {n: round(v, 5) for n, v in share.items()},
            "run_share_error_abs": round(max(abs(share[n] - WEIGHTS[n]) for n in m.names), 5),
            "run_share_error_rel": round(max(abs(share[n] - WEIGHTS[n]) / WEIGHTS[n] for n in m.names), 5),
            "repeat_spread_max": spread,
            "deliveries": {n: [int(c[live[n]].min()), int(c[live[n]].max())] for n, c in counts.items()},
            "empty_docs": {n: int((~live[n]).sum()) for n in m.names},
            "docs": {n: int(s.num_docs) for n, s in zip(m.names, m.sources)}}


def weight_schedule_run(folders) -> dict:
    w = [(10, WEIGHTS), (20, {"tests": 0.2, "packages": 0.2, "modules": 0.6})]
    m = mix(folders, weights=w)
    ld = loader(m)
    worst = [deviation(m, b, L) for _, b in zip(range(30), ld)]
    ld.close()
    return {"steps": len(worst), "worst_step_deviation_in_max_seq_len": round(max(worst), 4),
            "worst_in_ramp_steps_10_to_20": round(max(worst[10:21]), 4)}


def seq_len_schedule_run(folders) -> dict:
    sched = [(0, 512), (20, 4096)]
    sc = schedule(sched, "max_seq_len")
    m = mix(folders, weights=WEIGHTS)
    ld = loader(m, max_seq_len=sched, long_docs="split")
    ratio, last = 0.0, None
    for _, b in zip(range(25), ld):
        longest = max(n for _, _, n in segments(b.plan))
        ratio = max(ratio, longest / sc.at(b.step))
        last = (b.step, sc.at(b.step), longest)
    ld.close()
    return {"steps": 25, "worst_longest_segment_over_step_limit": round(ratio, 4),
            "last_step_limit_and_longest": list(last)}


def resume_run(folders) -> dict:
    m = mix(folders, weights=[(0, WEIGHTS), (12, {"tests": 0.2, "packages": 0.2, "modules": 0.6})])
    sched = {"max_seq_len": [(0, 1024), (10, 4096)], "global_batch_tokens": [(0, 65536), (8, BUDGET)]}
    ref = loader(m, **sched)
    want = [segments(b.plan) for _, b in zip(range(27), ref)][7:]
    ref.close()
    first = loader(m, **sched)
    for _, _b in zip(range(7), first):
        pass
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    again = loader(m, world=2, rank=1, **sched)
    again.load_state_dict(state)
    got = [segments(b.plan) for _, b in zip(range(20), again)]
    again.close()
    return {"steps_compared": len(got), "identical_steps": sum(a == b for a, b in zip(got, want)),
            "segments_compared": sum(len(s) for s in want)}


BAD = [
    ("negative weight", ["--mix", "tests={tests}:-0.6", "packages={packages}:0.3"]),
    ("all-zero weights", ["--mix", "tests={tests}:0", "packages={packages}:0"]),
    ("unsorted schedule steps", ["--mix", "tests={tests}:0.6@20,0.2@10", "packages={packages}:0.3"]),
    ("unsorted max_seq_len schedule", ["--mix", "tests={tests}:1", "packages={packages}:1",
                                       "--max-seq-len", "4096@20,512@0"]),
    ("weight for a source that does not exist", ["--mix", "tests={tests}:1", "maths=/no/such/folder:0.1"]),
    ("empty source", ["--mix", "tests={tests}:1", "empty={empty}:0.1"]),
]


def bad_input(folders, folder) -> list[dict]:
    empty = os.path.join(folder, "empty.npy")
    np.save(empty, np.zeros(0, dtype=np.int64))
    out = []
    for what, argv in BAD:
        argv = [a.format(empty=empty, **folders) for a in argv]
        p = subprocess.run([sys.executable, "-m", "balanced_loader", "plan", *argv, "--global-batch-tokens", "8192",
                            "--world-size", "4", "--cost", COST, "--policy", "hydra", "--steps", "1"],
                           capture_output=True, text=True)
        out.append({"input": what, "exit": p.returncode, "stderr_lines": p.stderr.count("\n"),
                    "stderr": p.stderr.strip()})
    return out


def adversarial(trials: int) -> dict:
    """Seeded synthetic mixtures of 2-4 sources (uniform, lognormal, only 1- or max-length docs, only
    max-length docs), budgets of 2-16 ``max_seq_len``, random weights, 150 steps each: how far a
    step's worst source strays from its share, in units of ``max_seq_len``."""
    from balanced_loader.batches.stream import stream_for

    worst, runs = [], []
    for seed in range(trials):
        rng = np.random.default_rng(seed)
        k, lim = int(rng.integers(2, 5)), int(rng.choice([512, 1024, 4096]))
        budget = int(lim * rng.choice([2, 4, 8, 16]))
        srcs = {}
        for i in range(k):
            kind, n = int(rng.integers(0, 4)), int(rng.integers(50, 3000))
            lognormal = np.minimum(rng.lognormal(np.log(lim / 8), 1.3, n).astype(int) + 1, lim)
            srcs[f"s{i}"] = [rng.integers(1, lim + 1, n), lognormal, rng.choice([1, lim], n), np.full(n, lim)][kind]
        w = rng.dirichlet(np.ones(k)) + 0.02
        m = mix(srcs, weights=dict(zip(sorted(srcs), w / w.sum())))
        st = stream_for(m, seed=seed, shuffle=True, window=256, max_seq_len=schedule(lim, "L"),
                        global_batch_tokens=schedule(budget, "B"), long_docs="split")
        cur, dev, tot = st.epoch_start(0), 0.0, np.zeros(k)
        share = np.asarray(m.weights.at(0))
        for _ in range(150):
            c = st.cut(cur)
            cur = c.end
            t = np.asarray([c.mixture_tokens[n] for n in m.names], dtype=np.float64)
            dev, tot = max(dev, float(np.abs(t - share * t.sum()).max()) / lim), tot + t
        worst.append(dev)
        runs.append(float(np.abs(tot / tot.sum() - share).max()))
    return {"trials": trials, "worst_step_deviation_in_max_seq_len": round(max(worst), 4),
            "p95_step_deviation": round(float(np.percentile(worst, 95)), 4),
            "trials_over_one_max_seq_len": int(sum(d > 1 for d in worst)),
            "worst_run_share_error_abs": round(max(runs), 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/mixbench", help="where the shard folders are built (once)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--adversarial", type=int, metavar="TRIALS",
                    help="instead: the per-step share on TRIALS synthetic worst-case mixtures")
    args = ap.parse_args()
    if args.adversarial:
        print(json.dumps(adversarial(args.adversarial), indent=1))
        return
    os.makedirs(args.dir, exist_ok=True)
    folders = build(args.dir)
    res = {"shares": shares_and_repeats(folders), "weight_schedule": weight_schedule_run(folders),
           "max_seq_len_schedule": seq_len_schedule_run(folders), "resume_4_to_2": resume_run(folders),
           "bad_input": bad_input(folders, args.dir)}
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
