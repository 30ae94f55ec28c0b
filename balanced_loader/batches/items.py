"""Docs as sequences, whole-array forms: the long-doc rule (:func:`to_items`), doc counts
(:class:`DocStats`) and greedy token-budget cuts (:func:`batch_bounds`).

A **sequence** is a doc of at most ``max_seq_len`` tokens, or one ``max_seq_len`` piece of a longer doc
(``long_docs="split"``); it is the unit of a global batch. The streaming cursor
(:mod:`balanced_loader.batches.sequences`) applies the same rules lazily; these forms are for small
inputs, tools and as the reference in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balanced_loader.plan import BatchItems


class EmptyDocError(ValueError):
    """A doc of length 0 where empty docs are errors (``plan --lengths``); ``doc`` names it so the
    caller can add where it is (a length file's line)."""

    def __init__(self, doc: int) -> None:
        super().__init__(f"lengths must be positive; doc {doc} has length 0")
        self.doc = doc


LONG_DOC_MODES = ("split", "truncate", "drop", "error")


@dataclass(frozen=True, kw_only=True, slots=True)
class DocStats:
    """What happened to unusual docs in one pass over a set of docs (never silent)."""

    docs: int = 0
    tokens: int = 0
    empty: int = 0  # docs of length 0, skipped
    split: int = 0  # docs cut into several segments
    truncated: int = 0
    dropped: int = 0
    tokens_cut: int = 0  # tokens lost to truncate/drop

    def __add__(self, other: DocStats) -> DocStats:
        return DocStats(**{k: getattr(self, k) + getattr(other, k) for k in self.__slots__})

    def to_json(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in self.__slots__}


def to_items(lengths: np.ndarray, doc_ids: np.ndarray, max_len: int | None,
             long_docs: str = "split") -> tuple[BatchItems, DocStats]:
    """Turn docs into planned sequences: empty docs skipped, docs over ``max_len`` handled by ``long_docs``.

    ``lengths`` and ``doc_ids`` are ``[n]``, in the order the docs should be planned. ``split``
    cuts a doc into segments of ``max_len`` tokens (the last one shorter) that train as
    independent sequences; ``truncate`` keeps the first ``max_len`` tokens; ``drop`` skips the
    doc; ``error`` raises naming it.
    """
    if long_docs not in LONG_DOC_MODES:
        raise ValueError(f"long_docs must be one of {', '.join(LONG_DOC_MODES)}, got '{long_docs}'")
    lengths = np.asarray(lengths, dtype=np.int64)
    doc_ids = np.asarray(doc_ids, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"doc {int(doc_ids[bad])} has a negative length {int(lengths[bad])}")
    nonempty = lengths > 0
    empty = int((~nonempty).sum())
    lengths, doc_ids = lengths[nonempty], doc_ids[nonempty]
    total = int(lengths.sum())
    if max_len is None or lengths.size == 0 or int(lengths.max()) <= max_len:
        starts = np.zeros(len(lengths), dtype=np.int64)
        return (BatchItems(doc_ids=doc_ids, starts=starts, lengths=lengths),
                DocStats(docs=len(lengths), tokens=total, empty=empty))
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    long = lengths > max_len
    n_long = int(long.sum())
    if long_docs == "error":
        i = int(np.flatnonzero(long)[0])
        raise ValueError(f"doc {int(doc_ids[i])} has {int(lengths[i])} tokens, over the context limit "
                         f"{max_len}; set long_docs to split, truncate or drop")
    if long_docs == "drop":
        keep = ~long
        cut = int(lengths[long].sum())
        return (BatchItems(doc_ids=doc_ids[keep], starts=np.zeros(int(keep.sum()), dtype=np.int64),
                           lengths=lengths[keep]),
                DocStats(docs=len(lengths), tokens=total - cut, empty=empty, dropped=n_long, tokens_cut=cut))
    if long_docs == "truncate":
        cut = int((lengths[long] - max_len).sum())
        return (BatchItems(doc_ids=doc_ids, starts=np.zeros(len(lengths), dtype=np.int64),
                           lengths=np.minimum(lengths, max_len)),
                DocStats(docs=len(lengths), tokens=total - cut, empty=empty, truncated=n_long, tokens_cut=cut))
    pieces = -(-lengths // max_len)  # [n] segments per doc
    rep_ids = np.repeat(doc_ids, pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = np.arange(len(rep_ids), dtype=np.int64) - first  # segment index inside its doc
    starts = k * max_len
    seg_len = np.minimum(np.repeat(lengths, pieces) - starts, max_len)
    return (BatchItems(doc_ids=rep_ids, starts=starts, lengths=seg_len),
            DocStats(docs=len(lengths), tokens=total, empty=empty, split=n_long))


def batch_bounds(item_lengths: np.ndarray, budget: int | None) -> np.ndarray:
    """Cut consecutive sequences into global batches of at most ``budget`` tokens (greedy).

    Returns ``[num_steps + 1]`` offsets into the items. A batch closes before the sequence that
    would exceed the budget; a sequence larger than the budget (only without a context limit) is a
    batch of its own; zero-length items never close a batch. The last batch may be partial
    (nothing is dropped). ``budget=None``: one batch.
    """
    n = len(item_lengths)
    if budget is None or n == 0:
        return np.asarray([0, n] if n else [0], dtype=np.int64)
    if budget < 1:
        raise ValueError(f"global_batch_tokens must be >= 1, got {budget}")
    lengths = np.asarray(item_lengths, dtype=np.int64)
    out = [0]
    csum = np.cumsum(lengths)  # [n]
    i, base = 0, 0
    while i < n:
        j = max(int(np.searchsorted(csum, base + budget, side="right")), i + 1)
        out.append(j)
        base = int(csum[j - 1])
        i = j
    return np.asarray(out, dtype=np.int64)
