"""The sequences of one source along its epochs, read lazily from a position (:class:`SourceSequences`).

A **sequence** is a doc of at most ``max_seq_len`` tokens, or one ``max_seq_len`` piece of a longer doc
(``long_docs="split"``): the unit of a global batch. The pieces of a long doc are independent sequences
that may train in different steps.

**Units.** Each epoch's doc order (:class:`~balanced_loader.batches.order.EpochOrder`) is read in
windows of ``window`` doc positions. In a window every doc is one *unit*, except under ``split``, where a
doc of ``n`` tokens is ``ceil(n / piece)`` units ``[k * piece, (k + 1) * piece)`` (``piece``: the largest
``max_seq_len`` of the run; an empty doc is one unit of 0 tokens). With ``shuffle``, the units of a window
that holds a split doc are permuted by a seeded :class:`~balanced_loader.batches.order.FeistelPermutation`
(evaluated by position, so nothing is built over the window's units): the pieces of a long doc are spread
over the window like docs. A window without split docs keeps its doc order, so a corpus without long docs
is read exactly as docs.

**Limits per step.** At a step whose ``max_seq_len`` ``L`` is below ``piece`` (a schedule), a unit is
read as consecutive sequences of at most ``L`` tokens; ``truncate`` keeps a doc's first ``L`` tokens,
``drop`` skips a doc over ``L`` and ``error`` refuses it. Empty and dropped docs are sequences of 0
tokens: they are read (and counted in :class:`~balanced_loader.batches.items.DocStats`) but never close a
batch.

**Positions.** :class:`SeqPos` ``(epoch, window, unit, offset)`` names the next sequence: ``offset``
tokens of the unit are already read (only under a schedule). Windows and units are counted per epoch,
so a position is a few integers, whatever the size of the source; the end of epoch ``e`` is
``(e + 1, 0, 0, 0)``. Memory per source: one window's doc ids, lengths and unit counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from balanced_loader.batches.items import LONG_DOC_MODES, DocStats, EmptyDocError
from balanced_loader.batches.order import EpochOrder, FeistelPermutation
from balanced_loader.data.lengths import release_pages

UNIT_TAG = 0x5E90
_RELEASE_EVERY = 1 << 16  # docs read between page releases of a memory-mapped length array (about a window)


class SeqPos(NamedTuple):
    """Where the next sequence of a source is: its epoch, the window and unit in that epoch, and the
    tokens of that unit already read. Tuples compare in reading order."""

    epoch: int
    window: int
    unit: int
    offset: int


@dataclass(frozen=True, kw_only=True, slots=True)
class _Window:
    """One window of one epoch, as units: ``[m]`` arrays over its docs, ``[m + 1]`` unit offsets."""

    epoch: int
    index: int
    ids: np.ndarray  # [m] doc ids in window order
    lengths: np.ndarray  # [m] their lengths
    first: np.ndarray  # [m + 1] first unit of each doc (cumulative unit counts)
    perm: FeistelPermutation | None  # unit position -> unit (None: in order)

    @property
    def num_units(self) -> int:
        return int(self.first[-1])


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """Consecutive sequences of one source inside one window (``[n]`` arrays, local doc ids)."""

    doc_ids: np.ndarray  # [n]
    starts: np.ndarray  # [n] first token of each sequence in its doc
    tokens: np.ndarray  # [n] tokens it trains (0: an empty or dropped doc)
    doc_len: np.ndarray  # [n] its doc's whole length
    units: np.ndarray  # [n] its unit in the window
    offsets: np.ndarray  # [n] tokens of its unit before it
    epoch: int
    window: int
    end: SeqPos  # the position after the last sequence

    def __len__(self) -> int:
        return len(self.doc_ids)

    def at(self, i: int) -> SeqPos:
        """The position of sequence ``i`` (``len(self)``: :attr:`end`)."""
        if i >= len(self.doc_ids):
            return self.end
        return SeqPos(self.epoch, self.window, int(self.units[i]), int(self.offsets[i]))

    def select(self, keep: np.ndarray) -> Run:
        """The sequences where ``keep`` (``[n]`` bool) holds; positions stay explicit, :attr:`end` the same."""
        return Run(doc_ids=self.doc_ids[keep], starts=self.starts[keep], tokens=self.tokens[keep],
                   doc_len=self.doc_len[keep], units=self.units[keep], offsets=self.offsets[keep], epoch=self.epoch,
                   window=self.window, end=self.end)

    def slice(self, a: int, b: int) -> Run:
        """Sequences ``a .. b - 1`` (views; :attr:`end` the same)."""
        return Run(doc_ids=self.doc_ids[a:b], starts=self.starts[a:b], tokens=self.tokens[a:b],
                   doc_len=self.doc_len[a:b], units=self.units[a:b], offsets=self.offsets[a:b], epoch=self.epoch,
                   window=self.window, end=self.end)

    def trained(self, offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(doc ids + offset, starts, tokens)`` of the sequences with tokens (``[m]`` each; views when every
        sequence has tokens): what a step plans of this run."""
        if self.tokens.all():
            return (self.doc_ids + offset if offset else self.doc_ids), self.starts, self.tokens
        keep = self.tokens > 0
        return self.doc_ids[keep] + offset, self.starts[keep], self.tokens[keep]

    def positions(self) -> list[SeqPos]:
        """Every sequence's position (``[n]``)."""
        return [SeqPos(self.epoch, self.window, u, o) for u, o in zip(self.units.tolist(), self.offsets.tolist())]

    def head(self, i: int) -> Run:
        """The first ``i`` sequences (its end: the position of sequence ``i``)."""
        if i >= len(self.doc_ids):
            return self
        return Run(doc_ids=self.doc_ids[:i], starts=self.starts[:i], tokens=self.tokens[:i],
                   doc_len=self.doc_len[:i], units=self.units[:i], offsets=self.offsets[:i], epoch=self.epoch,
                   window=self.window, end=self.at(i))


class SourceSequences:
    """One source's sequences along its epochs (module docstring), read from any :class:`SeqPos`.

    ``lengths``: ``[num_docs]`` (memory-mapped is fine: only the windows read are touched);
    ``shard_bounds``: ``[num_shards + 1]`` or None; ``piece``: the length units are cut to under
    ``split`` (None: no limit).
    """

    def __init__(self, lengths: Any, *, shard_bounds: np.ndarray | None, seed: int, shuffle: bool, window: int,
                 long_docs: str, piece: int | None, empty_docs: str = "skip") -> None:
        if long_docs not in LONG_DOC_MODES:
            raise ValueError(f"long_docs must be one of {', '.join(LONG_DOC_MODES)}, got '{long_docs}'")
        if window < 1:
            raise ValueError(f"shuffle window must be >= 1, got {window}")
        if piece is not None and piece < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {piece}")
        if empty_docs not in ("skip", "error"):
            raise ValueError(f"empty_docs must be 'skip' or 'error', got '{empty_docs}'")
        self.lengths = lengths
        self.n = len(lengths)
        if self.n < 1:
            raise ValueError("a source needs at least one doc")
        self.shard_bounds, self.seed, self.shuffle, self.window = shard_bounds, int(seed), bool(shuffle), int(window)
        self.long_docs, self.empty_docs = long_docs, empty_docs
        self.piece = piece if long_docs == "split" else None
        self.num_windows = -(-self.n // self.window)
        self._order: tuple[int, EpochOrder] | None = None  # (epoch, its order)
        self._win: list[_Window] = []  # the last two windows read
        self._last: tuple[tuple, Run] | None = None  # the last read: a source that took nothing reads it again
        self._block: tuple[tuple, int, Run] | None = None  # ((epoch, window, limit), first unit, its run)
        self._since_release = 0

    # ---- windows -------------------------------------------------------------------------
    def _window(self, epoch: int, w: int) -> _Window:
        for x in self._win:
            if x.epoch == epoch and x.index == w:
                return x
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, EpochOrder(self.n, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                                             shard_bounds=self.shard_bounds, window=self.window))
        a, b = w * self.window, min(self.n, (w + 1) * self.window)
        ids = self._order[1].docs(a, b)  # [m]
        ln = np.asarray(self.lengths[ids], dtype=np.int64)  # [m]
        if ln.size and int(ln.min()) < 0:
            i = int(np.flatnonzero(ln < 0)[0])
            raise ValueError(f"doc {int(ids[i])} has a negative length {int(ln[i])}")
        if self.empty_docs == "error" and ln.size and int(ln.min()) == 0:
            raise EmptyDocError(int(ids[int(np.flatnonzero(ln == 0)[0])]))
        self._since_release += len(ids)
        if self._since_release >= _RELEASE_EVERY:
            release_pages(self.lengths)
            self._since_release = 0
        units = np.ones(len(ids), dtype=np.int64) if self.piece is None else np.maximum(1, -(-ln // self.piece))
        first = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(units, out=first[1:])
        s = int(first[-1])
        perm = FeistelPermutation(s, [self.seed, epoch, w, UNIT_TAG]) if self.shuffle and s > len(ids) else None
        win = _Window(epoch=epoch, index=w, ids=ids, lengths=ln, first=first, perm=perm)
        self._win = [win, *self._win[:1]]
        return win

    def normal(self, pos: SeqPos) -> SeqPos:
        """``pos`` with a finished unit, window or epoch carried into the next one."""
        e, w, u, o = pos
        win = self._window(e, w)
        if u >= win.num_units:
            return SeqPos(e + 1, 0, 0, 0) if w + 1 >= self.num_windows else SeqPos(e, w + 1, 0, 0)
        return pos

    def check(self, pos: SeqPos) -> str | None:
        """Why ``pos`` is not a position of this source (None: it is one)."""
        e, w, u, o = pos
        if min(pos) < 0:
            return "negative"
        if w >= self.num_windows:
            return f"window {w} is past the epoch's {self.num_windows}"
        win = self._window(e, w)
        if u >= win.num_units:
            return f"unit {u} is past window {w}'s {win.num_units}"
        if o:
            ustart, ulen, _ = self._units(win, np.asarray([u]))
            if self.piece is None or o >= int(ulen[0]):
                return f"offset {o} is not inside unit {u}"
        return None

    def _units(self, win: _Window, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(doc index in window, first token, tokens)`` of unit positions ``q`` (``[k]`` each)."""
        u = q if win.perm is None else win.perm(q)
        # a window of one unit per doc: unit u is doc u
        d = u if win.num_units == len(win.ids) else np.searchsorted(win.first, u, side="right") - 1  # [k]
        if self.piece is None:
            return d, np.zeros(len(d), dtype=np.int64), win.lengths[d]
        start = (u - win.first[d]) * self.piece
        return d, start, np.minimum(win.lengths[d] - start, self.piece)

    # ---- reading -------------------------------------------------------------------------
    def read(self, pos: SeqPos, limit: int | None, max_units: int) -> Run:
        """The sequences of up to ``max_units`` units from ``pos`` (normalized), inside its window, at context
        limit ``limit`` (None: no limit); a doc over ``limit`` with ``long_docs="error"`` is a ValueError."""
        pos, max_units = self.normal(pos), max(1, int(max_units))
        key = (pos, limit, max_units)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        run = self._from_block(pos, limit, max_units)
        if run is None:
            run = self._read(pos, limit, max_units)
        self._last = (key, run)
        return run

    def _from_block(self, pos: SeqPos, limit: int | None, max_units: int) -> Run | None:
        """The read as a slice of a cached block of units (None: not a one-sequence-per-unit read).

        Why: a step reads a few hundred units; computing each read's arrays afresh costs a dozen small numpy
        calls, while a block read once (a few times the read, at most the window's size in memory) serves
        many steps by slicing. Only where every unit is one sequence (no schedule limit below the piece)."""
        e, w, u0, o0 = pos
        if o0 or (limit is not None and self.long_docs == "error"):  # a block would refuse a doc past the read
            return None
        blk = self._block
        if blk is None or blk[0] != (e, w, limit) or not blk[1] <= u0 < blk[1] + len(blk[2]):
            win = self._window(e, w)
            size = min(win.num_units - u0, max(8 * max_units, 4096))
            run = self._read(pos, limit, size)
            if len(run) != size:  # a unit read as several sequences (a schedule's smaller limit)
                self._block = None
                return None
            blk = self._block = ((e, w, limit), u0, run)
        (_, _, _), b0, run = blk
        a, b = u0 - b0, min(u0 - b0 + max_units, len(run))
        if a == 0 and b == len(run):
            return run
        return replace(run.slice(a, b), end=run.at(b))

    def _read(self, pos: SeqPos, limit: int | None, max_units: int) -> Run:
        e, w, u0, o0 = pos
        win = self._window(e, w)
        u1 = min(win.num_units, u0 + max(1, int(max_units)))
        q = np.arange(u0, u1, dtype=np.int64)  # [k] unit positions
        d, ustart, ulen = self._units(win, q)
        dlen = win.lengths[d]
        ids = win.ids[d]
        offs = np.zeros(len(q), dtype=np.int64)
        offs[0] = o0
        mode = self.long_docs
        if limit is not None and mode == "error" and dlen.size and int(dlen.max()) > limit:
            i = int(np.flatnonzero(dlen > limit)[0])
            raise ValueError(f"doc {int(ids[i])} has {int(dlen[i])} tokens, over the context limit {limit}; "
                             f"set long_docs to split, truncate or drop")
        if mode == "split" and limit is not None and int((ulen - offs).max(initial=0)) > limit:
            # a schedule's step below the piece size: each unit from its offset as sequences of `limit` tokens
            rest = ulen - offs
            nsub = np.maximum(1, -(-rest // limit))  # [k]
            q_rep = np.repeat(np.arange(len(q)), nsub)
            k = np.arange(len(q_rep), dtype=np.int64) - np.repeat(np.cumsum(nsub) - nsub, nsub)  # sub-piece index
            sub_off = offs[q_rep] + k * limit  # [n] offset in the unit
            return Run(doc_ids=ids[q_rep], starts=ustart[q_rep] + sub_off,
                       tokens=np.minimum(ulen[q_rep] - sub_off, limit), doc_len=dlen[q_rep], units=q[q_rep],
                       offsets=sub_off, epoch=e, window=w, end=SeqPos(e, w, u1, 0))
        if mode == "split" or limit is None:
            tokens = ulen - offs
        elif mode == "truncate":
            tokens = np.minimum(dlen, limit)
        elif mode == "drop":
            tokens = np.where(dlen > limit, 0, dlen)
        else:  # error, every doc within the limit
            tokens = dlen
        return Run(doc_ids=ids, starts=ustart + offs, tokens=tokens, doc_len=dlen, units=q, offsets=offs,
                   epoch=e, window=w, end=SeqPos(e, w, u1, 0))

    def stats(self, run: Run, limit: int | None) -> DocStats:
        """What the sequences of ``run`` did with their docs: a doc counts where its first sequence is."""
        if not len(run):
            return DocStats()
        first = run.starts == 0
        dl = run.doc_len
        empty = len(dl) - int(np.count_nonzero(dl))
        docs = int(np.count_nonzero(first)) - empty  # an empty doc is one sequence starting at 0
        tokens = int(run.tokens.sum())
        if limit is None or int(dl.max()) <= limit:
            return DocStats(docs=docs, tokens=tokens, empty=empty)
        long = dl > limit
        if self.long_docs == "split":
            return DocStats(docs=docs, tokens=tokens, empty=empty, split=int(np.count_nonzero(first & long)))
        n_long = int(np.count_nonzero(long))
        if self.long_docs == "truncate":
            return DocStats(docs=docs, tokens=tokens, empty=empty, truncated=n_long,
                            tokens_cut=int((dl[long] - limit).sum()))
        return DocStats(docs=docs, tokens=tokens, empty=empty, dropped=n_long, tokens_cut=int(dl[long].sum()))
