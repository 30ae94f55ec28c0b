"""From a length index to global batches: epoch order, long/empty docs, token-budget batches.

All pure functions of (lengths, seed, epoch, config), never of the world size: every rank, the
``plan``/``compare`` commands and the loader compute the same batches. The epoch order
(:class:`EpochOrder`) is evaluated lazily by position and batches are cut as they are consumed
(:class:`EpochBatches`), so memory does not grow with the number of docs; ``batch_bounds`` and
``epoch_order`` are the whole-array forms, for small inputs and as the reference in tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from balanced_loader.data.lengths import release_pages
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


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A 64-bit hash of ``x ^ key`` (the splitmix64 finalizer); uint64 array arithmetic wraps."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A seeded bijection of ``[0, n)``, evaluated on any positions without building it.

    A balanced Feistel network over ``2h`` bits (``2**(2h) < 4n``) permutes ``[0, 2**(2h))``;
    cycle-walking (re-encrypting until the value is below ``n``) restricts it to ``[0, n)``
    (fewer than 4 rounds of walking in expectation). Vectorised over arrays of positions.
    """

    ROUNDS = 6

    def __init__(self, n: int, key: list[int]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        self.half = (max(2, (self.n - 1).bit_length()) + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence(key).generate_state(self.ROUNDS, dtype=np.uint64)  # [rounds]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:  # (L, R) -> (R, L ^ F(R))
            left, right = right, left ^ (_mix(right, k) & self.mask)
        return (left << h) | right

    def _decrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys[::-1]:  # (L', R') -> (R' ^ F(L'), L')
            left, right = right ^ (_mix(left, k) & self.mask), left
        return (left << h) | right

    def _walk(self, pos: np.ndarray, step: Any) -> np.ndarray:
        x = np.asarray(pos, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"positions must lie in [0, {self.n})")
        y = step(x.astype(np.uint64))
        bad = np.flatnonzero(y >= self.n)
        while bad.size:  # cycle-walking: the cycle through x returns to [0, n)
            y[bad] = step(y[bad])
            bad = bad[y[bad] >= self.n]
        return y.astype(np.int64)

    def __call__(self, pos: np.ndarray) -> np.ndarray:
        """``perm[pos]`` for an array of positions (``[k]`` int64)."""
        return self._walk(pos, self._encrypt)

    def inverse(self, values: np.ndarray) -> np.ndarray:
        """The positions holding ``values`` (``[k]`` int64)."""
        return self._walk(values, self._decrypt)


_ORDER_TAG, _WINDOW_TAG = 0x5EED, 0x3A1D


class EpochOrder:
    """The doc order of one epoch, a pure function of (seed, epoch), evaluated lazily by position.

    Docs are laid out as contiguous blocks of doc_ids in a permuted block order, then shuffled
    inside consecutive windows of ``window`` positions. The blocks are the shards
    (``shard_bounds``, ``[num_shards + 1]`` doc offsets, permuted with a seeded generator) or,
    without shards, runs of ``max(1, window // 16)`` doc_ids permuted by a
    :class:`FeistelPermutation`, so a window mixes docs from 16 places of the file while every
    read stays a contiguous run (each touched run maps its page-cache folio, up to 2 MB, into
    resident memory: few runs per window keep that small). ``docs(a, b)`` costs ``O(window + b - a)`` time and
    memory, whatever the number of docs; ``shuffle=False`` is the file order.
    """

    def __init__(self, num_docs: int, *, seed: int, epoch: int, shuffle: bool = True,
                 shard_bounds: np.ndarray | None = None, window: int = 1 << 16) -> None:
        if window < 1:
            raise ValueError(f"shuffle window must be >= 1, got {window}")
        self.num_docs = int(num_docs)
        self.shuffle = bool(shuffle) and self.num_docs > 1
        self.window = int(window)
        self._key = [int(seed), int(epoch)]
        self._cache: tuple[int, np.ndarray] | None = None  # (window index, its doc_ids)
        if not self.shuffle:
            return
        if shard_bounds is not None:
            bounds = np.asarray(shard_bounds, dtype=np.int64)  # [num_shards + 1]
            if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != self.num_docs or (np.diff(bounds) < 0).any():
                raise ValueError(f"shard_bounds must rise from 0 to num_docs {self.num_docs}")
            perm = np.random.default_rng([*self._key, _ORDER_TAG]).permutation(len(bounds) - 1)  # [num_shards]
            self._shard_lo = bounds[perm]  # [num_shards] first doc_id of the shard in each slot
            self._slot_start = np.concatenate([[0], np.cumsum(np.diff(bounds)[perm])])  # [num_shards + 1]
            self._blocks: FeistelPermutation | None = None
            return
        self.block = max(1, self.window // 16)
        nb = -(-self.num_docs // self.block)
        self._blocks = FeistelPermutation(nb, [*self._key, _ORDER_TAG])
        # only the last block is short (r docs); its slot S shifts the slots after it by block - r
        self._short_len = self.num_docs - (nb - 1) * self.block
        self._short_slot = int(self._blocks.inverse(np.asarray([nb - 1]))[0])

    def _unshuffled(self, a: int, b: int) -> np.ndarray:
        """doc_ids at positions ``[a, b)`` of the block order, before the window shuffle (``[b - a]``)."""
        p = np.arange(a, b, dtype=np.int64)
        if self._blocks is None:  # shards: slot starts are explicit
            slot = np.searchsorted(self._slot_start, p, side="right") - 1
            return self._shard_lo[slot] + (p - self._slot_start[slot])
        bs, s = self.block, self._short_slot
        tail = s * bs + self._short_len  # end of the short block's slot
        slot = np.where(p < tail, p // bs, s + 1 + (p - tail) // bs)  # [b - a] nondecreasing
        offset = p - np.where(slot <= s, slot * bs, tail + (slot - s - 1) * bs)
        first = int(slot[0]) if len(slot) else 0
        blocks = self._blocks(np.arange(first, int(slot[-1]) + 1 if len(slot) else first))  # one call per block
        return blocks[slot - first] * bs + offset

    def _window(self, w: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != w:
            a, b = w * self.window, min(self.num_docs, (w + 1) * self.window)
            rng = np.random.default_rng([*self._key, w, _WINDOW_TAG])
            self._cache = (w, self._unshuffled(a, b)[rng.permutation(b - a)])
        return self._cache[1]

    def docs(self, a: int, b: int) -> np.ndarray:
        """doc_ids at epoch positions ``[a, b)`` (``[b - a]`` int64)."""
        a, b = max(0, int(a)), min(self.num_docs, int(b))
        if b <= a:
            return np.zeros(0, dtype=np.int64)
        if not self.shuffle:
            return np.arange(a, b, dtype=np.int64)
        parts = []
        for w in range(a // self.window, (b - 1) // self.window + 1):
            lo = w * self.window
            parts.append(self._window(w)[max(a, lo) - lo:min(b, lo + self.window) - lo])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def epoch_order(num_docs: int, *, seed: int, epoch: int, shuffle: bool = True,
                shard_bounds: np.ndarray | None = None, window: int = 1 << 16) -> np.ndarray:
    """The whole order of an :class:`EpochOrder` as one ``[num_docs]`` array (small inputs, tests, tools)."""
    return EpochOrder(num_docs, seed=seed, epoch=epoch, shuffle=shuffle, shard_bounds=shard_bounds,
                      window=window).docs(0, num_docs)


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


def doc_tokens(ln: np.ndarray, ids: np.ndarray, max_seq_len: int | None, long_docs: str) -> np.ndarray:
    """``[n]`` tokens each doc (``ln``, ``ids``: ``[n]``) brings to a batch after the long-doc rule
    (0: empty or dropped); a negative length is a ``ValueError`` naming the doc."""
    if ln.size and int(ln.min()) < 0:
        i = int(np.flatnonzero(ln < 0)[0])
        raise ValueError(f"doc {int(ids[i])} has a negative length {int(ln[i])}")
    if max_seq_len is None or long_docs in ("split", "error"):
        return ln
    if long_docs == "truncate":
        return np.minimum(ln, max_seq_len)
    return np.where(ln > max_seq_len, 0, ln)  # drop


@dataclass(frozen=True, kw_only=True, slots=True)
class Cut:
    """One global batch cut from an epoch's order."""

    items: BatchItems  # its sequences, in order (empty only when no doc with tokens is left)
    start: Any  # epoch position of its first doc (a mixture or a schedule: its MixCursor)
    end: Any  # epoch position of the next batch's first doc (num_docs at the end of the epoch; or the next MixCursor)
    stats: DocStats  # the docs of [start, end), empty and dropped ones included
    mixture_tokens: dict[str, int] | None = None  # a mixture's step: tokens per source (after the long-doc rule)


_RELEASE_EVERY = 1 << 16  # docs read between page releases of a memory-mapped length index (about a window)


class EpochBatches:
    """The global batches of one epoch, cut as they are consumed (a streaming cursor).

    A batch is named by the epoch position of its first doc; :meth:`cut` reads the docs from
    there, in :class:`EpochOrder`, until the next doc with tokens would exceed
    ``global_batch_tokens``, and returns the batch and the position after it. Nothing is
    built over all docs: ``lengths`` (``[num_docs]``, memory-mapped is fine) is read only at
    the positions a batch covers. Batches are cut between docs (a split doc's segments stay in
    one batch; a doc larger than the budget is a batch of its own; docs with no tokens left,
    empty or dropped, never close a batch), so a batch boundary is a plain position. The
    batches depend on lengths, order and these settings only, never on the world size.
    ``empty_docs="error"`` rejects a doc of length 0 instead of skipping it.
    """

    def __init__(self, lengths: Any, *, epoch: int = 0, seed: int = 0, shuffle: bool = False,
                 shard_bounds: np.ndarray | None = None, window: int = 1 << 16, max_seq_len: int | None = None,
                 long_docs: str = "split", global_batch_tokens: int | None = None, empty_docs: str = "skip") -> None:
        if long_docs not in LONG_DOC_MODES:
            raise ValueError(f"long_docs must be one of {', '.join(LONG_DOC_MODES)}, got '{long_docs}'")
        if global_batch_tokens is not None and global_batch_tokens < 1:
            raise ValueError(f"global_batch_tokens must be >= 1, got {global_batch_tokens}")
        if max_seq_len is not None and max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if empty_docs not in ("skip", "error"):
            raise ValueError(f"empty_docs must be 'skip' or 'error', got '{empty_docs}'")
        self.lengths = lengths if isinstance(lengths, np.ndarray) else np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {self.lengths.shape}")
        self.num_docs = len(self.lengths)
        self.order = EpochOrder(self.num_docs, seed=seed, epoch=epoch, shuffle=shuffle,
                                shard_bounds=shard_bounds, window=window)
        self.max_seq_len, self.long_docs = max_seq_len, long_docs
        self.budget, self.empty_docs = global_batch_tokens, empty_docs
        self._chunk = 4096  # docs read at a time; follows the batch size
        self._since_release = 0

    first = 0  # the epoch position of the epoch's first batch

    def is_end(self, c: Cut) -> bool:
        """Whether ``c`` is the epoch's last batch."""
        return c.end >= self.num_docs

    def _read(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """doc_ids and lengths at positions ``[a, b)`` (``[b - a]`` int64 each)."""
        ids = self.order.docs(a, b)
        ln = np.asarray(self.lengths[ids], dtype=np.int64)
        self._since_release += len(ids)
        if self._since_release >= _RELEASE_EVERY:
            release_pages(self.lengths)
            self._since_release = 0
        return ids, ln

    def _tokens(self, ln: np.ndarray, ids: np.ndarray) -> np.ndarray:
        if self.empty_docs == "error" and ln.size and int(ln.min()) == 0:
            d = int(ids[int(np.flatnonzero(ln == 0)[0])])
            raise EmptyDocError(d)
        return doc_tokens(ln, ids, self.max_seq_len, self.long_docs)

    def cut(self, start: int) -> Cut:
        """The batch whose first doc is at epoch position ``start``."""
        n, pos = self.num_docs, int(start)
        if not 0 <= pos <= n:
            raise ValueError(f"batch start {pos} is outside the epoch of {n} docs")
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        total, have_doc, chunk = 0, False, self._chunk
        while pos < n:
            b = n if self.budget is None else min(n, pos + chunk)
            ids, ln = self._read(pos, b)
            tok = self._tokens(ln, ids)
            if self.budget is None:
                parts.append((ids, ln))
                pos = b
                continue
            cum = total + np.cumsum(tok)  # [b - pos]
            lo = 0
            if not have_doc:  # the first doc with tokens is always taken, however long
                nz = np.flatnonzero(tok)
                if nz.size:
                    lo, have_doc = int(nz[0]) + 1, True
                else:
                    lo = len(tok)
            over = np.flatnonzero((cum[lo:] > self.budget) & (tok[lo:] > 0))
            if over.size:  # the batch closes before the first doc with tokens that does not fit
                j = lo + int(over[0])
                parts.append((ids[:j], ln[:j]))
                pos += j
                break
            parts.append((ids, ln))
            total = int(cum[-1]) if len(cum) else total
            pos = b
            chunk = min(chunk * 2, 1 << 20)
        if self.budget is not None:  # next time, read about one batch at once
            self._chunk = int(np.clip((pos - int(start)) * 5 // 4 + 64, 1024, 1 << 20))
        ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        ln = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        items, stats = to_items(ln, ids, self.max_seq_len, self.long_docs)
        return Cut(items=items, start=int(start), end=pos, stats=stats)

    def batches(self, start: int = 0) -> Iterator[Cut]:
        """The batches from epoch position ``start`` (a batch start) to the end of the epoch."""
        pos = int(start)
        while True:
            c = self.cut(pos)
            if len(c.items):  # empty only for an epoch without tokens
                yield c
            if c.end >= self.num_docs:
                return
            pos = c.end

    def summary(self) -> tuple[int, DocStats]:
        """Steps and doc stats of the whole epoch: one streaming pass (time grows with the docs, memory does not)."""
        steps, stats, pos = 0, DocStats(), 0
        while True:
            c = self.cut(pos)
            stats = stats + c.stats
            if len(c.items):
                steps += 1
            if c.end >= self.num_docs:
                break
            pos = c.end
        release_pages(self.lengths)
        return steps, stats


def global_batches(lengths: Any, *, max_seq_len: int | None, long_docs: str = "split",
                   global_batch_tokens: int | None = None, shuffle: bool = False, seed: int = 0,
                   shard_bounds: np.ndarray | None = None, max_steps: int | None = None,
                   window: int = 1 << 16, empty_docs: str = "skip") -> tuple[list[BatchItems], DocStats]:
    """The first ``max_steps`` global batches of epoch 0, as the loader cuts them, and the stats of the docs read.

    Only the docs those batches cover are read (``lengths`` may be memory-mapped), so the
    stats cover the whole input only when every batch is taken.
    """
    eb = EpochBatches(lengths, epoch=0, seed=seed, shuffle=shuffle, shard_bounds=shard_bounds, window=window,
                      max_seq_len=max_seq_len, long_docs=long_docs, global_batch_tokens=global_batch_tokens,
                      empty_docs=empty_docs)
    out: list[BatchItems] = []
    stats, pos = DocStats(), 0
    while max_steps is None or len(out) < max_steps:
        c = eb.cut(pos)
        stats = stats + c.stats
        if len(c.items):
            out.append(c.items)
        if c.end >= eb.num_docs:
            break
        pos = c.end
    return out, stats


def validation_lengths(lengths: np.ndarray, max_seq_len: int | None, long_docs: str) -> np.ndarray:
    """Lengths (by doc_id) that planned docs must cover: truncated docs end at ``max_seq_len``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if long_docs == "truncate" and max_seq_len is not None:
        return np.minimum(lengths, max_seq_len)
    return lengths
