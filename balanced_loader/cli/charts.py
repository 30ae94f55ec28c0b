"""PNG charts of the standalone tool (matplotlib's Agg canvas, no pyplot state, no display needed).

Every chart has a title, labelled axes with units, and a legend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

_DPI = 110


def _figure(width: float, height: float, rows: int = 1, cols: int = 1, **kw):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, axes


def _save(fig, path: str) -> str:
    """Render into a temporary file and rename it over ``path`` (never a half-written chart)."""
    import os

    from balanced_loader.outputs.files import atomic_write

    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    with atomic_write(path, "wb") as f:
        fig.savefig(f, dpi=_DPI, format=fmt)
    return path


def _kfmt(x: float, _pos: int | None = None) -> str:
    for unit, k in (("M", 1e6), ("K", 1e3)):
        if x >= k:
            v = x / k
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{x:.0f}"


def length_histogram(lengths: np.ndarray, path: str, *, title: str, lane_cap: int | None = None,
                     marks: Mapping[str, float] | None = None) -> str:
    """Two panels: docs per log-spaced length bin (log-log), and cumulative share of docs and tokens.

    ``lengths`` ``[num_docs]`` (zeros are ignored); ``marks`` labels vertical lines (e.g. p50, p99).
    """
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    ln = np.asarray(lengths, dtype=np.int64)
    ln = ln[ln > 0]
    fig, ax = _figure(11.5, 4.4, 1, 2)
    a, b = ax[0]
    if ln.size == 0:
        for x in (a, b):
            x.text(0.5, 0.5, "no docs", ha="center", va="center", transform=x.transAxes)
    else:
        hi = max(int(ln.max()), 2)
        edges = np.unique(np.round(np.logspace(0, np.log10(hi) + 1e-9, 60)).astype(np.int64))
        edges = np.append(edges, edges[-1] + 1)
        counts, _ = np.histogram(ln, bins=edges)
        tokens, _ = np.histogram(ln, bins=edges, weights=ln.astype(np.float64))
        a.stairs(counts, edges, fill=True, alpha=0.6, color="tab:blue", label="docs per bin")
        a.set_xscale("log")
        a.set_yscale("log")
        a2 = a.twinx()
        a2.stairs(tokens / tokens.sum(), edges, color="tab:orange", linewidth=1.5, label="share of tokens per bin")
        a2.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=1))
        a2.set_ylabel("share of all tokens in the bin")
        a2.set_ylim(bottom=0)
        a.set_xlabel("doc length (tokens, log scale)")
        a.set_ylabel("docs per bin (log scale)")
        a.set_title("Doc length histogram")
        order = np.sort(ln)
        cum_docs = np.arange(1, order.size + 1) / order.size
        cum_tok = np.cumsum(order, dtype=np.float64) / float(order.sum())
        step = max(1, order.size // 4000)
        idx = np.r_[np.arange(0, order.size, step), order.size - 1]
        b.plot(order[idx], cum_docs[idx], color="tab:blue", label="docs at most this long")
        b.plot(order[idx], cum_tok[idx], color="tab:orange", label="tokens in docs at most this long")
        b.set_xscale("log")
        b.set_ylim(0, 1.01)
        b.yaxis.set_major_formatter(PercentFormatter(1.0))
        b.set_xlabel("doc length (tokens, log scale)")
        b.set_ylabel("cumulative share")
        b.set_title("Cumulative share of docs and tokens")
        colors = ["tab:green", "tab:purple", "tab:brown", "tab:gray", "tab:olive"]
        for i, (name, x) in enumerate((marks or {}).items()):
            for axis in (a, b):
                axis.axvline(x, color=colors[i % len(colors)], linestyle=":", linewidth=1.2,
                             label=f"{name} = {_kfmt(x)}" if axis is b else None)
        if lane_cap:
            for axis in (a, b):
                axis.axvline(lane_cap, color="tab:red", linestyle="--", linewidth=1.2,
                             label=f"lane cap {lane_cap:,} tokens" if axis is b else None)
        for axis in (a, b):
            axis.xaxis.set_major_formatter(FuncFormatter(_kfmt))
            axis.grid(True, which="major", alpha=0.3)
        h1, l1 = a.get_legend_handles_labels()
        h2, l2 = a2.get_legend_handles_labels()
        a.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
        b.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def rank_load(busy_ms: Mapping[str, np.ndarray], step_ms: Mapping[str, float], path: str, *, title: str,
              barrier_ms: Mapping[str, np.ndarray] | None = None) -> str:
    """Per-rank busy time of one step, one panel per policy, with that policy's step time as a dashed line;
    ``barrier_ms`` (per policy, ``[world_size]``) stacks each rank's wait at the plan's barriers on top."""
    names = list(busy_ms)
    n = max(len(names), 1)
    fig, ax = _figure(11.0, 1.0 + 1.9 * n, n, 1, sharex=True, sharey=True)
    ymax = max([float(np.max(v)) if len(v) else 0.0 for v in busy_ms.values()]
               + [float(v) for v in step_ms.values()] + [1.0])
    for i, name in enumerate(names):
        a = ax[i][0]
        v = np.asarray(busy_ms[name], dtype=np.float64)  # [world_size]
        color = f"C{i % 10}"
        x = np.arange(len(v) + 1)
        a.stairs(v, x, fill=True, color=color, alpha=0.55, label=f"{name}: busy time per rank")
        wait = np.asarray((barrier_ms or {}).get(name, ()), dtype=np.float64)  # [world_size] or empty
        if wait.size == v.size and wait.any():
            a.stairs(v + wait, x, baseline=v, fill=True, facecolor="none", edgecolor="dimgray", hatch="///",
                     linewidth=0.0, label=f"waiting at barriers ({wait.sum() / max(v.size, 1):,.0f} ms/rank)")
        t = float(step_ms[name])
        a.axhline(t, color=color, linestyle="--", linewidth=1.3, label=f"{name}: step time {t:,.0f} ms")
        mean = float(v.mean()) if v.size else 0.0
        a.axhline(mean, color="black", linestyle=":", linewidth=1.0, label=f"mean busy {mean:,.0f} ms")
        a.set_ylim(0, ymax * 1.35)
        a.set_xlim(0, max(len(v), 1))
        a.set_ylabel("busy time (ms)")
        a.legend(loc="upper right", fontsize=8, ncol=3)
        a.grid(True, axis="y", alpha=0.3)
    ax[-1][0].set_xlabel("rank")
    fig.suptitle(title)
    return _save(fig, path)


def step_times(times_ms: Mapping[str, Sequence[float]], path: str, *, title: str,
               steps: Sequence[int] | None = None) -> str:
    """Modeled step time per policy over steps (one line per policy)."""
    fig, ax = _figure(9.0, 4.6)
    a = ax[0][0]
    for i, (name, t) in enumerate(times_ms.items()):
        t = np.asarray(t, dtype=np.float64)
        x = np.asarray(steps if steps is not None else np.arange(len(t)))
        a.plot(x, t, marker="o", markersize=3.5, color=f"C{i % 10}",
               label=f"{name} (mean {t.mean():,.0f} ms)" if t.size else name)
    from matplotlib.ticker import MaxNLocator

    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.set_xlabel("step")
    a.set_ylabel("modeled step time (ms)")
    a.set_ylim(bottom=0)
    a.grid(True, alpha=0.3)
    a.legend(loc="best", fontsize=9)
    a.set_title(title)
    return _save(fig, path)


def grouped_bars(categories: Sequence[str], series: Mapping[str, Sequence[float]], path: str, *, title: str,
                 ylabel: str, xlabel: str) -> str:
    """Bars grouped by category, one colour per series (used for speedup tables)."""
    fig, ax = _figure(9.0, 4.6)
    a = ax[0][0]
    k = max(len(series), 1)
    width = 0.8 / k
    x = np.arange(len(categories))
    for i, (name, vals) in enumerate(series.items()):
        vals = np.asarray([np.nan if v is None else v for v in vals], dtype=np.float64)
        bars = a.bar(x + (i - (k - 1) / 2) * width, vals, width, label=name, color=f"C{i % 10}")
        a.bar_label(bars, labels=["" if np.isnan(v) else f"{v:.2f}" for v in vals], fontsize=8)
    a.set_xticks(x, list(categories))
    a.set_xlabel(xlabel)
    a.set_ylabel(ylabel)
    a.grid(True, axis="y", alpha=0.3)
    a.legend(loc="best", fontsize=9)
    a.set_title(title)
    return _save(fig, path)


def trace_gantt(trace: Mapping, path: str, *, title: str) -> str:
    """A Gantt chart of a trace file's object (:mod:`balanced_loader.diagnostics.trace`): one row per
    rank track, grouped by process, its ``X`` slices as bars (compute coloured by CP degree, waits
    hatched, other kinds in their own colour), steps as dashed lines, barrier instants as ticks."""
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    events = trace["traceEvents"]
    sort: dict[tuple[str, int, int], int] = {}  # (kind, pid, tid) -> sort index
    names: dict[tuple[int, int], str] = {}
    pnames: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "M":
            if e["name"] == "thread_name":
                names[(e["pid"], e["tid"])] = e["args"]["name"]
            elif e["name"] == "process_name":
                pnames[e["pid"]] = e["args"]["name"]
            elif e["name"].endswith("sort_index"):
                sort[(e["name"], e["pid"], e["tid"])] = e["args"]["sort_index"]
    rows = sorted((k for k in names if k[0] != 0),  # process 0 holds the summary tracks
                  key=lambda k: (sort.get(("process_sort_index", k[0], 0), k[0]),
                                 sort.get(("thread_sort_index", k[0], k[1]), k[1])))
    row = {k: i for i, k in enumerate(rows)}
    bars: dict[str, list[tuple[int, float, float]]] = {}  # legend label -> [(row, start ms, ms)]
    steps, ticks = [], []
    rows_of: dict[tuple, set[int]] = {}  # (step, pool, stage) -> rows that work there
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "X" and key[0] == 0 and e.get("cat") == "step":
            steps.append((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3, e["name"]))
        elif e.get("ph") == "i" and e.get("cat") == "barrier":
            ticks.append((e["ts"] / 1e3, _where(e)))
        elif e.get("ph") == "X" and key in row:
            cat = e.get("cat", "")
            rows_of.setdefault(_where(e), set()).add(row[key])
            label = f"compute, degree {e.get('args', {}).get('degree', 1)}" if cat == "compute" else cat
            bars.setdefault(label, []).append((row[key], e["ts"] / 1e3, e["dur"] / 1e3))
    n = max(len(rows), 1)
    fig, ax = _figure(12.0, 1.6 + min(0.28 * n, 14.0))
    a = ax[0][0]
    fixed = {"wait": "lightgray", "pull": "tab:cyan", "push": "tab:olive", "optimizer": "tab:brown"}
    computes = sorted((k for k in bars if k.startswith("compute")), key=lambda k: int(k.rsplit(" ", 1)[1]))
    handles = []
    end = max([s1 for _, s1, _ in steps] + [t for t, _ in ticks] + [1e-3])
    for i, label in enumerate(computes + sorted(k for k in bars if not k.startswith("compute"))):
        color = f"C{i % 10}" if label.startswith("compute") else fixed.get(label, "tab:pink")
        hatch = "////" if label == "wait" else None
        b = np.asarray(bars[label], dtype=np.float64)  # [n, 3] row, start, length
        x0, x1, y0, y1 = b[:, 1], b[:, 1] + b[:, 2], b[:, 0] - 0.42, b[:, 0] + 0.42
        verts = np.stack([np.c_[x0, y0], np.c_[x0, y1], np.c_[x1, y1], np.c_[x1, y0]], axis=1)  # [n, 4, 2]
        a.add_collection(PolyCollection(verts, facecolors=color, edgecolors="white" if hatch is None else "gray",
                                        linewidths=0.4, hatch=hatch))
        end = max(end, float(x1.max()))
        handles.append(Patch(facecolor=color, edgecolor="gray", hatch=hatch, label=label))
    for s0, s1, label in sorted(steps):
        a.axvline(s1, color="black", linestyle="--", linewidth=0.9)
        a.annotate(label, ((s0 + s1) / 2, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2),
                   textcoords="offset points", ha="center", va="bottom", fontsize=8)
    for t, where in ticks:  # a barrier marks the rows of its pool (and stage), else every row
        ys = sorted(rows_of.get(where, ())) or list(range(len(rows)))
        a.vlines([t] * len(ys), [y - 0.5 for y in ys], [y + 0.5 for y in ys], color="tab:red", linestyle=":",
                 linewidth=1.0)
    if ticks:
        handles.append(Patch(facecolor="none", edgecolor="tab:red", linestyle=":", label="pool barrier"))
    if steps:
        handles.append(Patch(facecolor="none", edgecolor="black", linestyle="--", label="step end"))
    every = max(1, n // 32)
    a.set_yticks(range(0, len(rows), every), [names[k] for k in rows[::every]], fontsize=7)
    for i in range(1, len(rows)):  # a line between processes (pools / stages)
        if rows[i][0] != rows[i - 1][0]:
            a.axhline(i - 0.5, color="black", linewidth=0.8)
    starts: dict[int, int] = {}
    for i, k in enumerate(rows):
        starts.setdefault(k[0], i)
    for pid, i in starts.items():
        a.annotate(pnames.get(pid, ""), (1.0, i - 0.45), xycoords=("axes fraction", "data"), xytext=(4, 0),
                   textcoords="offset points", fontsize=7, va="top")
    a.set_ylim(len(rows) - 0.5, -0.5)
    a.set_xlim(0, end * 1.01)
    a.set_xlabel("time (ms)")
    a.set_ylabel("rank")
    a.grid(True, axis="x", alpha=0.3)
    a.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 if n > 8 else -0.2), fontsize=8,
             ncol=min(len(handles), 6))
    a.set_title(title, pad=14 if steps else 6)
    return _save(fig, path)


def _where(e: Mapping) -> tuple:
    a = e.get("args") or {}
    return a.get("step"), a.get("pool"), a.get("stage", 0)


def mixture_shares(lengths: Mapping[str, np.ndarray], shares: Mapping[str, Sequence[float]],
                   weights: Mapping[str, Sequence[float]], path: str, *, title: str, unit: str = "tokens") -> str:
    """Two panels for a mixture: each source's doc length distribution (cumulative share of docs, log x),
    and each source's share of every step's ``unit`` (stacked bars) with its scheduled weight (the dashed
    line is the top of the source's band when every share equals its weight)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator, PercentFormatter

    fig, ax = _figure(11.5, 4.4, 1, 2)
    a, b = ax[0]
    for i, (name, ln) in enumerate(lengths.items()):
        ln = np.sort(np.asarray(ln, dtype=np.int64)[np.asarray(ln) > 0])
        if ln.size:
            idx = np.r_[np.arange(0, ln.size, max(1, ln.size // 4000)), ln.size - 1]
            a.plot(ln[idx], (idx + 1) / ln.size, color=f"C{i % 10}",
                   label=f"{name}: {ln.size:,} docs, p50 {_kfmt(float(ln[ln.size // 2]))}")
    a.set_xscale("log")
    a.xaxis.set_major_formatter(FuncFormatter(_kfmt))
    a.yaxis.set_major_formatter(PercentFormatter(1.0))
    a.set_ylim(0, 1.01)
    a.set_xlabel("doc length (tokens, log scale)")
    a.set_ylabel("share of the source's docs at most this long")
    a.set_title("Doc lengths per source")
    a.grid(True, alpha=0.3)
    a.legend(loc="lower right", fontsize=8)
    steps = np.arange(len(next(iter(shares.values()), [])))
    base, wbase = np.zeros(len(steps)), np.zeros(len(steps))
    for i, (name, s) in enumerate(shares.items()):
        s = np.asarray(s, dtype=np.float64)  # [steps]
        b.bar(steps, s, bottom=base, width=0.9, color=f"C{i % 10}", alpha=0.7, label=f"{name}: share of {unit}")
        wbase = wbase + np.asarray(weights[name], dtype=np.float64)  # [steps] cumulative weights
        b.plot(steps, wbase, color=f"C{i % 10}", linestyle="--", linewidth=1.2, label=f"{name}: weight")
        base = base + s
    b.xaxis.set_major_locator(MaxNLocator(integer=True))
    b.yaxis.set_major_formatter(PercentFormatter(1.0))
    b.set_ylim(0, 1.0)
    b.set_xlabel("step")
    b.set_ylabel(f"share of the step's {unit} (stacked)")
    b.set_title("Each source's share per step")
    b.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, ncol=max(1, len(shares)))
    fig.suptitle(title)
    return _save(fig, path)


def step_sizes(tokens: Mapping[str, Sequence[int]], budgets: Sequence[int], limits: Sequence[int | None],
               path: str, *, title: str) -> str:
    """Tokens of every global batch (stacked by source for a mixture) against the budget band
    ``[B - max_seq_len, B]`` the loader promises."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, ax = _figure(8.0, 3.8)
    a = ax[0][0]
    steps = np.arange(len(budgets))
    base = np.zeros(len(steps))
    for i, (name, t) in enumerate(tokens.items()):
        t = np.asarray(t, dtype=np.float64)  # [steps]
        a.bar(steps, t, bottom=base, width=0.9, color=f"C{i % 10}", alpha=0.75, label=name)
        base = base + t
    b = np.asarray(budgets, dtype=np.float64)
    lo = b - np.asarray([m or 0 for m in limits], dtype=np.float64)
    a.step(steps, b, where="mid", color="black", linewidth=1.2, label="global_batch_tokens (B)")
    a.step(steps, lo, where="mid", color="black", linestyle="--", linewidth=1.0, label="B - max_seq_len")
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.yaxis.set_major_formatter(FuncFormatter(_kfmt))
    a.set_ylim(0, float(max(b.max(), base.max())) * 1.08)
    a.set_xlabel("step")
    a.set_ylabel("tokens in the step")
    a.set_title(title)
    a.grid(True, axis="y", alpha=0.3)
    a.legend(loc="lower right", fontsize=8)
    return _save(fig, path)
