"""Length analysis of a dataset: statistics, the CP degrees its docs need, and which policy fits.

Pure functions of a ``[num_docs]`` length array (and optionally a cost model); the
``balanced-loader analyze`` command prints them and draws the histogram.

* **percentiles** use the ``lower`` method (an actual doc length, never interpolated).
* **memory-fit degree** of a doc of ``s`` tokens: the smallest power of two ``d`` with
  ``s <= d * max_tokens_per_lane`` (what Megatron-Core dynamic CP gives it).
* **attention share**: ``sum q*s^2 / sum (q*s^2 + l*s)`` over all docs, the part of the
  compute that grows quadratically and so cannot be balanced by counting tokens.
* **cost per token spread**: ``(q*p + l) / (q*p50 + l)`` for ``p`` the p99.9 length, how much
  more one token of a long doc costs than one of a typical doc.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from balanced_loader.cost import fit_levels

if TYPE_CHECKING:
    from balanced_loader.cost import CostModel, ShapeCost

PERCENTILES = (50, 90, 95, 99, 99.9)
THRESHOLDS = (4096, 8192, 16384, 32768, 65536, 131072, 262144)


def _pct_name(p: float) -> str:
    return f"p{p:g}"


def length_stats(lengths: np.ndarray, *, thresholds: tuple[int, ...] = THRESHOLDS, top: int = 10) -> dict[str, Any]:
    """Count, tokens, mean, percentiles, share of docs and tokens above thresholds, longest docs.

    Empty docs (length 0) are counted separately and left out of every other figure.
    """
    ln_all = np.asarray(lengths, dtype=np.int64)  # [num_docs]
    nonempty = ln_all > 0
    ln = ln_all[nonempty]
    n = int(ln.size)
    tokens = int(ln.sum())
    out: dict[str, Any] = {"docs": n, "empty_docs": int((~nonempty).sum()), "tokens": tokens}
    if n == 0:
        out.update(mean=0.0, min=0, max=0, percentiles={}, above=[], longest=[])
        return out
    pct = np.percentile(ln, PERCENTILES, method="lower")
    out["mean"] = tokens / n
    out["min"] = int(ln.min())
    out["max"] = int(ln.max())
    out["percentiles"] = {_pct_name(p): int(v) for p, v in zip(PERCENTILES, pct)}
    srt = np.sort(ln)
    csum = np.concatenate([[0], np.cumsum(srt, dtype=np.int64)])  # [n + 1]
    above = []
    for t in thresholds:
        i = int(np.searchsorted(srt, t, side="right"))  # docs <= t
        above.append({"threshold": int(t), "docs": n - i, "docs_share": (n - i) / n,
                      "tokens_share": float(tokens - csum[i]) / tokens})
    out["above"] = above
    ids = np.flatnonzero(nonempty)
    k = min(top, n)
    top_idx = np.argpartition(-ln, k - 1)[:k] if k < n else np.arange(n)
    top_idx = top_idx[np.argsort(-ln[top_idx], kind="stable")]
    out["longest"] = [{"doc_id": int(ids[i]), "length": int(ln[i])} for i in top_idx]
    return out


def memory_fit_degrees(lengths: np.ndarray, cap: int) -> np.ndarray:
    """``[num_docs]`` smallest power of two ``d`` with ``length <= d * cap`` (1 for empty docs)."""
    return np.left_shift(1, fit_levels(lengths, cap))


def degree_table(lengths: np.ndarray, shape: ShapeCost) -> list[dict[str, Any]]:
    """Per memory-fit degree: docs, their share of docs, tokens and compute (``q*s^2 + l*s``)."""
    ln = np.asarray(lengths, dtype=np.int64)
    ln = ln[ln > 0]
    if ln.size == 0:
        return []
    deg = memory_fit_degrees(ln, shape.max_tokens_per_lane)
    work = shape.compute_ms(ln.astype(np.float64))  # [num_docs]
    tot_tok, tot_work = float(ln.sum()), float(work.sum())
    rows = []
    for d in np.unique(deg):
        m = deg == d
        rows.append({"degree": int(d), "docs": int(m.sum()), "docs_share": float(m.mean()),
                     "tokens_share": float(ln[m].sum()) / tot_tok, "compute_share": float(work[m].sum()) / tot_work,
                     "longest": int(ln[m].max())})
    return rows


@dataclass(frozen=True, kw_only=True, slots=True)
class Advice:
    lane_cap: int
    shape: tuple[int, int]  # (tp, pp) whose cap is used
    max_degree: int  # memory-fit degree of the longest doc
    attention_share: float
    cost_spread: float  # cost of a p99.9 token over a p50 token
    policy: str  # the policy to start from
    alternatives: tuple[str, ...]
    compare: tuple[str, ...]  # policies worth comparing, baseline first
    max_seq_len: int | None  # suggested context limit (None: keep every doc whole)
    lines: tuple[str, ...]  # human-readable advice

    def to_json(self) -> dict[str, Any]:
        return {"lane_cap": self.lane_cap, "shape": {"tp": self.shape[0], "pp": self.shape[1]},
                "max_degree": self.max_degree, "attention_share": self.attention_share,
                "cost_spread": self.cost_spread, "policy": self.policy,
                "alternatives": list(self.alternatives), "compare": list(self.compare),
                "max_seq_len": self.max_seq_len, "lines": list(self.lines)}


def advice_shape(cost: CostModel, tp: int | None = None, pp: int | None = None) -> ShapeCost:
    """The shape whose lane cap the advice uses: the given one, else tp=pp=1, else the smallest usable."""
    if tp is not None or pp is not None:
        sc = cost.shape(tp or 1, pp or 1)
        if not sc.usable:
            raise ValueError(f"shape tp={sc.tp} pp={sc.pp} is unusable in this cost model (max_tokens_per_lane 0)")
        return sc
    if cost.base.usable:
        return cost.base
    usable = cost.shapes()
    if not usable:
        raise ValueError("the cost model has no usable shape (every max_tokens_per_lane is 0)")
    return usable[0]


def advise(lengths: np.ndarray, cost: CostModel, *, world_size: int | None = None,
           tp: int | None = None, pp: int | None = None) -> Advice:
    """Which lane cap and CP degrees the data needs and which policy fits, with the reasons."""
    sc = advice_shape(cost, tp, pp)
    ln = np.asarray(lengths, dtype=np.int64)
    ln = ln[ln > 0]
    cap = sc.max_tokens_per_lane
    lines: list[str] = []
    shape_txt = f"tp={sc.tp} pp={sc.pp}"
    if ln.size == 0:
        return Advice(lane_cap=cap, shape=(sc.tp, sc.pp), max_degree=1, attention_share=0.0, cost_spread=1.0,
                      policy="greedy", alternatives=(), compare=("greedy",), max_seq_len=None,
                      lines=("no docs: nothing to balance",))
    lf = ln.astype(np.float64)
    quad = sc.quadratic_ms * float(np.dot(lf, lf))
    lin = sc.linear_ms * float(lf.sum())
    attn = quad / (quad + lin) if quad + lin > 0 else 0.0
    p50, p99, p999 = (int(x) for x in np.percentile(ln, (50, 99, 99.9), method="lower"))
    base = sc.quadratic_ms * p50 + sc.linear_ms
    spread = (sc.quadratic_ms * p999 + sc.linear_ms) / base if base > 0 else 1.0
    deg = memory_fit_degrees(ln, cap)
    dmax = int(deg.max())
    fit1 = deg == 1
    tok_multi = float(ln[~fit1].sum()) / float(ln.sum())
    lines.append(f"lane cap {cap:,} tokens ({shape_txt}): {fit1.mean():.2%} of docs fit one lane; the "
                 f"{int((~fit1).sum()):,} longer docs hold {tok_multi:.1%} of the tokens and need context parallelism.")
    lines.append(f"to keep 99% of docs on one lane a lane must hold {p99:,} tokens, for 99.9% {p999:,}.")
    max_seq_len = None
    if dmax > 1:
        lines.append(f"CP degrees needed (memory-fit powers of two): 1..{dmax}; the longest doc "
                     f"({int(ln.max()):,} tokens) needs {dmax} lanes.")
        total = float(ln.sum())
        d = 1
        while d < dmax and float(ln[deg > d].sum()) > 0.01 * total:
            d *= 2
        if d < dmax:
            over = deg > d
            n_over = int(over.sum())
            max_seq_len = cap * d
            lines.append(f"a context limit of {cap * d:,} tokens (--max-seq-len) caps the degree at {d} and splits "
                         f"only {n_over:,} doc{'' if n_over == 1 else 's'} ({float(ln[over].sum()) / total:.2%} of "
                         f"the tokens).")
    else:
        lines.append("no doc needs context parallelism at this lane cap.")
    lanes = None
    if world_size is not None:
        if world_size % sc.gpus:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp = {sc.gpus}")
        lanes = world_size // sc.gpus
        if dmax > lanes:
            lines.append(f"the longest docs need more than the {lanes} lanes of {world_size} ranks: set a "
                         f"context limit of at most {cap * lanes:,} tokens (long docs are split) or add ranks.")
    lines.append(f"attention is {attn:.1%} of the compute; a p99.9 token costs {spread:.2f}x a median token, "
                 f"so balancing tokens {'is close to' if spread < 1.3 else 'is not'} balancing time.")
    alternatives: list[str] = []
    if dmax == 1:
        if attn < 0.1 and spread < 1.3:
            policy = "token-kk"
            lines.append("policy: token-kk. Every doc fits one lane and cost is close to linear in tokens, so "
                         "Karmarkar-Karp balancing across data-parallel lanes captures most of the gain.")
            alternatives.append("greedy")
        else:
            policy = "hydra"
            lines.append("policy: hydra. Docs fit one lane, but long docs cost much more per token; hydra "
                         "spreads the most expensive docs over several lanes so no lane straggles. "
                         "token-kk (per-lane balancing only) is the simpler alternative.")
            alternatives.append("token-kk")
    else:
        policy = "hydra"
        lines.append(f"policy: hydra. Docs need CP degrees up to {dmax}; memory-fit degrees (mcore-dcp) leave "
                     f"lanes holding long-doc shards with up to {spread:.1f}x the work per token, while hydra "
                     f"chooses degrees and placement for one load target per step.")
        alternatives.append("mcore-dcp (baseline)")
        gpn = cost.gpus_per_node
        if dmax * sc.tp > gpn:
            lines.append(f"the widest groups cross nodes ({dmax} lanes x tp {sc.tp} > {gpn} GPUs per node, "
                         f"{sc.bandwidth(dmax):g} vs {sc.bandwidth(2):g} GB/s): flexsp picks heterogeneous "
                         f"SP groups per microbatch to keep most all-to-all inside a node.")
            alternatives.append("flexsp")
    shapes = cost.shapes()
    if len(shapes) > 1:
        lines.append(f"the cost model lists {len(shapes)} usable (tp, pp) shapes: hydraulis can give long and "
                     f"short docs different pipeline shapes in the same step.")
        alternatives.append("hydraulis")
    compare = ("maxlen", "mcore-dcp", policy) if dmax > 1 else ("maxlen", "token-kk", "hydra")
    return Advice(lane_cap=cap, shape=(sc.tp, sc.pp), max_degree=dmax, attention_share=attn, cost_spread=spread,
                  policy=policy, alternatives=tuple(alternatives), compare=compare, max_seq_len=max_seq_len,
                  lines=tuple(lines))


def step_report(batches: list, *, budgets: list[int], limits: list[int | None], mixture: list | None = None,
                finite: bool = True) -> dict[str, Any]:
    """What each global batch holds: tokens per step (min / median / max, against ``[B - max_seq_len, B]``),
    the largest share of one doc in a step, and per source (a mixture) its share of each step.

    ``batches``: each step's :class:`~balanced_loader.plan.BatchItems`; ``budgets``/``limits``: each step's
    ``global_batch_tokens`` and ``max_seq_len``; ``mixture``: each step's tokens per source; ``finite``: the
    last step ends the input (it may be short).
    """
    sizes = np.asarray([int(b.lengths.sum()) for b in batches], dtype=np.int64)  # [steps]
    if not len(sizes):
        return {"steps": 0}
    lo = np.asarray([b - (m or 0) for b, m in zip(budgets, limits)], dtype=np.int64)
    inside = (sizes >= lo) & (sizes <= np.asarray(budgets))
    if finite:
        inside[-1] = sizes[-1] <= budgets[-1]
    best = (0.0, -1, -1)  # (share, doc, step)
    for k, b in enumerate(batches):
        if len(b):
            ids, inv = np.unique(b.doc_ids, return_inverse=True)
            per = np.bincount(inv, weights=b.lengths)  # [docs] tokens of each doc in the step
            j = int(np.argmax(per))
            share = float(per[j]) / max(1, int(sizes[k]))
            if share > best[0]:
                best = (share, int(ids[j]), k)
    out: dict[str, Any] = {
        "steps": len(sizes), "tokens": {"min": int(sizes.min()), "median": int(np.median(sizes)),
                                        "max": int(sizes.max())},
        "budget": {"min": int(min(budgets)), "max": int(max(budgets))},
        "outside_budget": int((~inside).sum()),
        "largest_doc_share": {"share": round(best[0], 4), "doc": best[1], "step": best[2]},
    }
    if mixture:
        per_source = {}
        for n in mixture[0]:
            s = np.asarray([m[n] / max(1, int(t)) for m, t in zip(mixture, sizes)])
            per_source[n] = {"min": round(float(s.min()), 4), "median": round(float(np.median(s)), 4),
                             "max": round(float(s.max()), 4)}
        out["per_source_share"] = per_source
    return out


def format_steps(rep: dict[str, Any]) -> str:
    """The step report as text lines."""
    if not rep.get("steps"):
        return "steps: none"
    t, b, d = rep["tokens"], rep["budget"], rep["largest_doc_share"]
    budget = f"{b['min']:,}" if b["min"] == b["max"] else f"{b['min']:,}-{b['max']:,}"
    out = [f"steps {rep['steps']:,} of {budget} tokens: min {t['min']:,}  median {t['median']:,}  max {t['max']:,}; "
           f"{rep['outside_budget']} outside [budget - max_seq_len, budget]; largest share of one doc in a step "
           f"{d['share']:.1%} (doc {d['doc']}, step {d['step']})"]
    for n, s in rep.get("per_source_share", {}).items():
        out.append(f"  {n}: share of a step min {s['min']:.1%}  median {s['median']:.1%}  max {s['max']:.1%}")
    return "\n".join(out)
