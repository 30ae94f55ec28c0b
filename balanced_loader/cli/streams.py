"""Mixtures and schedules on the command line, for ``plan``, ``compare`` and ``analyze``.

* ``--mix NAME=PATH:WEIGHT [NAME=PATH:WEIGHT ...]`` (replaces ``--lengths``/``--source``): PATH is a
  shard folder (local or a URL), a ``.jsonl`` or a length file; WEIGHT a number or a schedule
  ``W@STEP,W@STEP,...``; ``--mix-by tokens|docs``;
* ``--max-seq-len`` and ``--global-batch-tokens`` take ``N`` or a schedule ``N@STEP,N@STEP,...``.

With either, the input's global batches come from a
:class:`~balanced_loader.batches.stream.BatchStream`, exactly as the loader cuts them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any


def _open_one(path: str, cache_dir: str | None) -> Any:
    from balanced_loader.data.lengths import LENGTH_SUFFIXES, read_lengths
    from balanced_loader.data.open import open_source
    from balanced_loader.data.sources import LengthSource

    if path.endswith(LENGTH_SUFFIXES) and os.path.isfile(path):  # memory-mapped; values checked as batches read them
        return LengthSource(read_lengths(path, check=False), name=f"lengths file {path}", checked=True)
    return open_source(path, cache_dir=cache_dir)


def open_input(args: argparse.Namespace) -> Any:
    """The source of ``--mix``, ``--lengths`` or ``--source``."""
    from balanced_loader.data.mixture import mix

    cache_dir = getattr(args, "cache_dir", None)
    if getattr(args, "mix", None):
        names = [n for n, _, _ in args.mix]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"--mix: source name '{dup[0]}' is given twice")
        weights = None if any(w is None for _, _, w in args.mix) else {n: w for n, _, w in args.mix}
        return mix({n: _open_one(p, cache_dir) for n, p, _ in args.mix}, weights=weights, by=args.mix_by)
    if args.lengths:
        return _open_one(args.lengths, None)
    spec = args.source[0] if len(args.source) == 1 else list(args.source)
    from balanced_loader.data.open import open_source

    return open_source(spec, cache_dir=cache_dir)


def wants_stream(args: argparse.Namespace) -> bool:
    """Whether the input is a mixture or a setting is a schedule (then :func:`stream_batches` cuts it)."""
    return bool(getattr(args, "mix", None)) or any(
        isinstance(getattr(args, k, None), list) for k in ("max_seq_len", "global_batch_tokens"))


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamBatches:
    """The first steps of a mixture or a schedule, as the loader cuts them."""

    source: Any  # the opened source (a MixtureSource for --mix)
    cuts: list  # [steps] Cut, in step order
    label: str
    long_docs: str
    limits: list  # [steps] max_seq_len of each step (None: no limit)
    budgets: list  # [steps] global_batch_tokens of each step

    @property
    def batches(self) -> list:
        return [c.items for c in self.cuts]

    @property
    def stats(self) -> Any:
        from balanced_loader.batches.items import DocStats

        out = DocStats()
        for c in self.cuts:
            out = out + c.stats
        return out


def stream_batches(args: argparse.Namespace, *, max_seq_len: Any, steps: int | None) -> StreamBatches:
    """The first ``steps`` global batches (None: to the end of the first epoch) of ``args``'s input."""
    from balanced_loader.batches.stream import stream_for
    from balanced_loader.schedule import schedule

    if args.global_batch_tokens is None:
        raise ValueError("a mixture (--mix) or a schedule is cut into steps: give --global-batch-tokens N "
                         "(or a schedule N@STEP,...)")
    source = open_input(args)
    limit = None if max_seq_len is None else schedule(max_seq_len, "--max-seq-len")
    stream = stream_for(source, seed=args.seed, shuffle=args.shuffle, window=args.shuffle_window, max_seq_len=limit,
                        global_batch_tokens=schedule(args.global_batch_tokens, "--global-batch-tokens"),
                        long_docs=args.long_docs, epochs=1 if steps is None else None)
    cuts, cur = [], stream.epoch_start(0)
    while steps is None or len(cuts) < steps:
        try:
            c = stream.cut(cur)
        except ValueError as e:  # a bad length is found when its batch is cut: name the input
            raise ValueError(f"{source.describe()}: {e}") from None
        cuts.append(c)
        if steps is None and c.end.epoch > 0:
            break
        cur = c.end
    return StreamBatches(source=source, cuts=cuts, label=source.describe(), long_docs=args.long_docs,
                         limits=[stream.limit_at(c.start.step) for c in cuts],
                         budgets=[int(stream.budget.at(c.start.step)) for c in cuts])


def shares(mixture_tokens: dict[str, int] | None) -> str:
    """``web 60.1% code 29.9% ...`` for a step's per-source tokens ('' when not a mixture)."""
    if not mixture_tokens:
        return ""
    total = sum(mixture_tokens.values()) or 1
    return " ".join(f"{n} {t / total:.1%}" for n, t in mixture_tokens.items())
