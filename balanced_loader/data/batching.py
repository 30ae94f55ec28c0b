"""From a length index to global batches: epoch order, long/empty docs, token-budget batches.

All pure functions of (lengths, seed, epoch, config): every rank computes the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balanced_loader.plan import BatchItems

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


def epoch_order(num_docs: int, *, seed: int, epoch: int, shuffle: bool = True,
                shard_bounds: np.ndarray | None = None, window: int = 1 << 16) -> np.ndarray:
    """Doc order of one epoch (``[num_docs]`` doc_ids), a pure function of (seed, epoch).

    Without ``shard_bounds`` (``[num_shards + 1]`` doc offsets) the order is a full
    permutation. With them, shards are permuted and docs shuffled inside consecutive windows
    of ``window`` docs, so a streaming reader touches few shards at a time.
    """
    if not shuffle:
        return np.arange(num_docs, dtype=np.int64)
    rng = np.random.default_rng([int(seed), int(epoch), 0x5EED])
    if shard_bounds is None:
        return rng.permutation(num_docs).astype(np.int64)
    bounds = np.asarray(shard_bounds, dtype=np.int64)
    assert bounds[0] == 0 and bounds[-1] == num_docs
    shards = rng.permutation(len(bounds) - 1)
    order = np.concatenate([np.arange(bounds[s], bounds[s + 1], dtype=np.int64) for s in shards]
                           or [np.zeros(0, dtype=np.int64)])
    for a in range(0, num_docs, window):
        rng.shuffle(order[a:a + window])
    return order


def batch_bounds(item_lengths: np.ndarray, budget: int | None, starts: np.ndarray | None = None) -> np.ndarray:
    """Cut consecutive items into global batches of at most ``budget`` tokens.

    Returns ``[num_steps + 1]`` offsets into the items. A batch closes before the doc that
    would exceed the budget; a doc larger than the budget is a batch of its own. With
    ``starts`` (``[n]``, from :func:`to_items`), batches are cut only where a doc begins
    (``start == 0``), so a split doc's segments stay in one step (contract 1 tiles each doc
    within its step). The last batch may be partial (nothing is dropped). ``budget=None``:
    one batch.
    """
    n = len(item_lengths)
    if budget is None or n == 0:
        return np.asarray([0, n] if n else [0], dtype=np.int64)
    if budget < 1:
        raise ValueError(f"global_batch_tokens must be >= 1, got {budget}")
    item_lengths = np.asarray(item_lengths, dtype=np.int64)
    if starts is None:
        return _batch_bounds_py(item_lengths, int(budget))
    first = np.flatnonzero(np.asarray(starts) == 0)  # [num_docs] first item of each doc
    assert len(first) and first[0] == 0, "items must begin with the first segment of a doc"
    doc_tokens = np.add.reduceat(item_lengths, first)  # [num_docs]
    doc_bounds = _batch_bounds_py(doc_tokens, int(budget))
    return np.append(first, n)[doc_bounds].astype(np.int64)


def _batch_bounds_py(lengths: np.ndarray, budget: int) -> np.ndarray:
    out = [0]
    csum = np.cumsum(lengths)  # [n]
    i, n, base = 0, len(lengths), 0
    while i < n:
        j = max(int(np.searchsorted(csum, base + budget, side="right")), i + 1)
        out.append(j)
        base = int(csum[j - 1])
        i = j
    return np.asarray(out, dtype=np.int64)


def global_batches(lengths: np.ndarray, *, max_seq_len: int | None, long_docs: str = "split",
                   global_batch_tokens: int | None = None, shuffle: bool = False, seed: int = 0,
                   shard_bounds: np.ndarray | None = None, max_steps: int | None = None,
                   ) -> tuple[list[BatchItems], DocStats]:
    """The global batches of epoch 0 (at most ``max_steps``), as the loader and ``plan`` cut them."""
    lengths = np.asarray(lengths, dtype=np.int64)  # [num_docs]
    order = epoch_order(len(lengths), seed=seed, epoch=0, shuffle=shuffle, shard_bounds=shard_bounds)
    items, stats = to_items(lengths[order], order, max_seq_len, long_docs)
    bounds = batch_bounds(items.lengths, global_batch_tokens, items.starts)  # [num_steps + 1] over items
    n = len(bounds) - 1 if max_steps is None else min(len(bounds) - 1, max_steps)
    out = []
    for i in range(n):
        a, b = int(bounds[i]), int(bounds[i + 1])
        out.append(BatchItems(doc_ids=items.doc_ids[a:b], starts=items.starts[a:b], lengths=items.lengths[a:b]))
    return out, stats


def validation_lengths(lengths: np.ndarray, max_seq_len: int | None, long_docs: str) -> np.ndarray:
    """Lengths (by doc_id) that planned docs must cover: truncated docs end at ``max_seq_len``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if long_docs == "truncate" and max_seq_len is not None:
        return np.minimum(lengths, max_seq_len)
    return lengths
