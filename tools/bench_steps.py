"""Step sizes and mixes on a corpus zoo of this machine's files (issue 33's acceptance figures).

For each corpus (byte-level lengths of real files: ``balanced_loader.build.zoo``), shuffled and not, a
``BalancedLoader`` (hydra, 4 ranks, ``--global-batch-tokens`` 65,536, ``--max-seq-len`` 4,096, default
``long_docs="split"``) runs ``--steps`` steps; reported: tokens per step (min / median / max), the steps
outside ``[B - max_seq_len, B]`` (the last step of a finite run excepted), the largest share of one doc
in a step, the median planning time per step. Then a mixture of three corpora 0.6 / 0.3 / 0.1 by tokens
(one with multi-MB docs), constant and scheduled (0.6/0.3/0.1 at step 10 to 0.2/0.2/0.6 at step 20):
each step's largest |tokens - share| in units of max_seq_len, steps missing a source whose share is at
least one max_seq_len, and the run's shares against the (interpolated) weights.

    python tools/bench_steps.py --out docs/results/records/steps.json
    python tools/bench_steps.py --many-sources 1000 10000     # seconds per step of a mixture of K sources
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import balanced_loader as bl
from balanced_loader.build import zoo
from balanced_loader.outputs.records import Figure, make_record, write_record


def one_source(name: str, ln: np.ndarray, *, shuffle: bool, steps: int, budget: int, limit: int,
               world: int) -> dict:
    ld = bl.BalancedLoader(ln, policy="hydra", cost="hydra-gpt7b-a100", world_size=world, rank=0,
                           global_batch_tokens=budget, max_seq_len=limit, shuffle=shuffle, epochs=1, seed=0,
                           validate=True)
    sizes, share, plan_ms = [], 0.0, []
    for _, b in zip(range(steps), ld):
        seq = b.sequences
        sizes.append(int(seq.lengths.sum()))
        ids, inv = np.unique(seq.doc_ids, return_inverse=True)
        share = max(share, float(np.bincount(inv, weights=seq.lengths).max()) / sizes[-1])
        plan_ms.append(b.plan.plan_seconds * 1e3)
    finished = len(sizes) < steps  # the run ended: its last step may be short
    ld.close()
    s = np.asarray(sizes)
    body = s[:-1] if finished else s
    return {"corpus": name, "docs": len(ln), "longest": int(ln.max()), "longest_x_L": round(int(ln.max()) / limit, 1),
            "shuffle": shuffle, "steps": len(s), "min": int(s.min()), "median": int(np.median(s)), "max": int(s.max()),
            "outside": int(((body < budget - limit) | (body > budget)).sum() + (s[-1] > budget)),
            "largest_doc_share": round(share, 4), "plan_ms_median": round(statistics.median(plan_ms), 2)}


def mixture(srcs: dict, weights, *, steps: int, budget: int, limit: int, world: int, shuffle: bool) -> dict:
    m = bl.mix(srcs, weights=weights)
    ld = bl.BalancedLoader(m, policy="hydra", cost="hydra-gpt7b-a100", world_size=world, rank=0,
                           global_batch_tokens=budget, max_seq_len=limit, shuffle=shuffle, epochs=None, seed=0)
    dev, missing, sizes = 0.0, 0, []
    got, want = np.zeros(len(m.names)), np.zeros(len(m.names))
    for _, b in zip(range(steps), ld):
        t = np.asarray([b.mixture_tokens[n] for n in m.names], dtype=np.float64)
        w = np.asarray(m.weights.at(b.step))
        dev = max(dev, float(np.abs(t - w * t.sum()).max()) / limit)
        missing += int(any(t[i] == 0 for i in range(len(t)) if w[i] * t.sum() >= limit))
        sizes.append(int(t.sum()))
        got, want = got + t, want + w * t.sum()
    ld.close()
    err = np.abs(got / got.sum() - want / want.sum())
    return {"sources": {n: len(srcs[n]) for n in m.names}, "weights": m.weights.to_json(), "shuffle": shuffle,
            "steps": steps, "worst_step_deviation_in_L": round(dev, 3), "steps_missing_a_source": missing,
            "run_share_error_max": round(float(err.max()), 5),
            "run_shares": dict(zip(m.names, (round(float(x), 4) for x in got / got.sum()))),
            "min_tokens": min(sizes), "max_tokens": max(sizes)}


def many_sources(k: int, steps: int = 6) -> dict:
    """A mixture of ``k`` seeded sources of 50 docs (equal weights), 1M-token steps: seconds per step."""
    from balanced_loader.batches.stream import stream_for
    from balanced_loader.schedule import schedule

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    m = bl.mix({f"s{i:05d}": rng.integers(1, 2000, 50) for i in range(k)}, weights=None)
    made = time.perf_counter() - t0
    st = stream_for(m, seed=0, shuffle=True, window=1 << 16, max_seq_len=schedule(4096, "L"),
                    global_batch_tokens=schedule(1 << 20, "B"), long_docs="split")
    cur, times = st.epoch_start(0), []
    for _ in range(steps):
        t = time.perf_counter()
        c = st.cut(cur)
        cur = c.end
        times.append(time.perf_counter() - t)
    return {"sources": k, "mix_s": round(made, 2), "first_step_s": round(times[0], 2),
            "step_s_median_after": round(statistics.median(times[1:]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", default="gcloud,vimdoc,man,lines,c_headers,license_texts")
    ap.add_argument("--mix", default="gcloud,man,lines", help="three corpora, weights 0.6 / 0.3 / 0.1")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mix-steps", type=int, default=60)
    ap.add_argument("--global-batch-tokens", type=int, default=65536)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--out", help="write the record (docs/results/records/steps.json) here")
    ap.add_argument("--many-sources", type=int, nargs="*", help="only: seconds per step of mixtures of K sources")
    a = ap.parse_args()
    if a.many_sources:
        for k in a.many_sources:
            print(json.dumps(many_sources(k)), flush=True)
        return
    kw = dict(budget=a.global_batch_tokens, limit=a.max_seq_len, world=a.world_size)
    rows = []
    for name in a.corpora.split(","):
        ln = zoo.lengths(name)
        if len(ln) < 20:
            print(f"{name}: not on this machine, skipped", file=sys.stderr)
            continue
        for shuffle in (False, True):
            r = one_source(name, ln, shuffle=shuffle, steps=a.steps, **kw)
            rows.append(r)
            print(json.dumps(r), flush=True)
    names = a.mix.split(",")
    srcs = {n: zoo.lengths(n) for n in names}
    w0 = dict(zip(names, (0.6, 0.3, 0.1)))
    sched = [(10, w0), (20, dict(zip(names, (0.2, 0.2, 0.6))))]
    mixes = []
    for shuffle in (True, False):
        for w in (w0, sched):
            r = mixture(srcs, w, steps=a.mix_steps, shuffle=shuffle, **kw)
            mixes.append(r)
            print(json.dumps(r), flush=True)
    B, L = a.global_batch_tokens, a.max_seq_len
    steps = sum(r["steps"] for r in rows)
    setting = (f"{len(rows) // 2} zoo corpora ({', '.join(sorted({r['corpus'] for r in rows}))}) x shuffled / file "
               f"order, {a.steps} steps each, hydra on {a.world_size} ranks, B {B:,}, max_seq_len {L:,}")
    mixing = (f"{' / '.join(names)} at 0.6 / 0.3 / 0.1 by tokens and a schedule to 0.2 / 0.2 / 0.6, shuffled and "
              f"not, {a.mix_steps} steps each")
    shuffled = [r["largest_doc_share"] for r in rows if r["shuffle"]]
    figures = [
        Figure(id="steps.outside_budget", area="data", target="0",
               figure=f"steps outside [B - max_seq_len, B] (the last of a run excepted): {setting}",
               value=f"**{sum(r['outside'] for r in rows)}** of {steps} (tokens per step "
                     f"{min(r['min'] for r in rows):,}-{max(r['max'] for r in rows):,})"),
        Figure(id="steps.largest_doc_share", area="data", target="report",
               figure=f"largest share of one doc in a step, shuffled (file order: 100% where a doc is longer "
                      f"than a step): {setting}",
               value=f"{min(shuffled):.1%}-{max(shuffled):.1%} by corpus"),
        Figure(id="steps.mixture_step_deviation", area="data", target="<= 1 max_seq_len",
               figure=f"mixture: largest abs(tokens - share) of a source in a step, {mixing}",
               value=f"**{max(r['worst_step_deviation_in_L'] for r in mixes):.3f}** max_seq_len; steps missing a "
                     f"source of share >= max_seq_len: {sum(r['steps_missing_a_source'] for r in mixes)}"),
        Figure(id="steps.mixture_run_shares", area="data", target="within 0.5%",
               figure=f"mixture: run shares against the (interpolated) weights, {mixing}",
               value=f"max abs error **{max(r['run_share_error_max'] for r in mixes):.5f}**"),
    ]
    rec = make_record("steps", figures, command="python tools/bench_steps.py --out docs/results/records/steps.json",
                      details={"settings": vars(a), "sources": rows, "mixtures": mixes})
    if a.out:
        write_record(a.out, rec)
    print(json.dumps(rec["figures"], indent=1))


if __name__ == "__main__":
    main()
