"""Global batches of a mixture, or of one source under a schedule: :class:`MixtureStream`.

Each source keeps its own lazy epoch order (:class:`~balanced_loader.data.batching.EpochOrder`,
seeded by the loader's seed and the source's name), its own position in it and its own epoch
count: a small source repeats while a large one is read once. Nothing is built over all docs; a
step reads about its own docs plus one shuffle window per source.

**A step** (global step ``s``; budget ``B = global_batch_tokens(s)``, limit ``L = max_seq_len(s)``,
shares ``w = weights(s)``) takes docs one at a time. Each source ``i`` has taken ``t_i`` units
(tokens after the long-doc rule, or docs with ``by="docs"``) of the step's ``T``, and carries
``c_i``, how far ahead of its share it ended the steps before (``sum of t_i - w_i T``). The next
doc comes from the source with the smallest ``c_i / 2 + t_i - w_i T + (1 - w_i) u_i / 2`` (``u_i``
the units of its next doc): the one furthest behind its share after counting half of what it
would add. The step closes when that doc does not fit the budget (a doc over the budget alone is a
step of its own) or is already in the step (a source smaller than its share wrapped around).
So every step holds each source's share within about one doc, and the carry keeps the run's
totals on the weights (the half weight on ``c_i`` spreads a correction over two steps instead of
overshooting in one). Docs are cut between docs, empty and dropped docs skipped and counted, docs
over ``L`` split, truncated or dropped at that step's ``L``; a zero-weight source is not read.

**Epochs.** The mixture's epoch ``e`` ends with the step in which every source that still has a
positive weight (at that step or later) has finished one more pass over its docs. One source (a
schedule without a mixture) closes each step at its epoch end, so a constant schedule gives
exactly the batches of :class:`~balanced_loader.data.batching.EpochBatches`.

A :class:`MixCursor` names where a step starts (the global step, each source's epoch, position
and carry); it is all the state a resume needs, and no part of it depends on the world size.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from balanced_loader.data.batching import Cut, DocStats, EpochOrder, doc_tokens, to_items
from balanced_loader.data.lengths import release_pages
from balanced_loader.data.mixture import MixtureSource
from balanced_loader.data.schedule import Schedule, WeightSchedule, weight_schedule

CARRY_GAIN = 0.5  # the share of a source's carried surplus the next step corrects
_RELEASE_EVERY = 1 << 16  # docs read between page releases of a memory-mapped length array


@dataclass(frozen=True, kw_only=True, slots=True)
class MixCursor:
    """Where a step starts: the global step, the mixture's epoch, and each source's place (``[k]`` each)."""

    step: int
    epoch: int
    step_in_epoch: int
    epochs: tuple[int, ...]  # each source's epoch
    positions: tuple[int, ...]  # each source's position in that epoch's order
    marks: tuple[int, ...]  # each source's epoch when the mixture's epoch began
    carry: tuple[float, ...]  # units each source is ahead of its share over the steps before

    def to_json(self, names: Sequence[str]) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "sources": {n: {"epoch": e, "position": p, "mark": m, "carry": c}
                            for n, e, p, m, c in zip(names, self.epochs, self.positions, self.marks, self.carry)}}

    @staticmethod
    def from_json(d: Any, names: Sequence[str], sizes: Sequence[int]) -> MixCursor:
        """A cursor from :meth:`to_json`, checked against the sources (one ``ValueError`` line)."""
        bad = "malformed loader state: the mixture cursor"
        if not isinstance(d, dict) or not isinstance(d.get("sources"), dict):
            raise ValueError(f"{bad} must be a mapping with 'sources'; pass a dict from BalancedLoader.state_dict()")
        if sorted(d["sources"]) != sorted(names):
            raise ValueError(f"{bad} has sources {sorted(d['sources'])}, this loader {list(names)}")

        def count(v: Any, what: str, hi: int | None = None) -> int:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0 or (
                    hi is not None and v >= hi):
                raise ValueError(f"{bad}: {what} must be an integer in 0..{'' if hi is None else hi - 1}, got {v!r}")
            return int(v)

        per = [d["sources"][n] for n in names]
        for n, p in zip(names, per):
            if not isinstance(p, dict):
                raise ValueError(f"{bad}: source '{n}' must be a mapping")
            c = p.get("carry")
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not np.isfinite(c):
                raise ValueError(f"{bad}: source '{n}' carry must be a finite number, got {c!r}")
        cur = MixCursor(step=count(d.get("step"), "step"), epoch=count(d.get("epoch"), "epoch"),
                        step_in_epoch=count(d.get("step_in_epoch"), "step_in_epoch"),
                        epochs=tuple(count(p.get("epoch"), f"source '{n}' epoch") for n, p in zip(names, per)),
                        positions=tuple(count(p.get("position"), f"source '{n}' position", sz)
                                        for n, p, sz in zip(names, per, sizes)),
                        marks=tuple(count(p.get("mark"), f"source '{n}' mark") for n, p in zip(names, per)),
                        carry=tuple(float(p["carry"]) for p in per))
        if any(m > e for m, e in zip(cur.marks, cur.epochs)) or cur.step_in_epoch > cur.step:
            raise ValueError(f"{bad} is inconsistent (a source's mark is past its epoch, or the step is before "
                             f"the epoch's)")
        return cur


class _Reader:
    """One source's docs along its epoch orders, read ahead in chunks; placed by (epoch, position)."""

    def __init__(self, lengths: Any, bounds: np.ndarray | None, offset: int, *, seed: int, shuffle: bool,
                 window: int, long_docs: str) -> None:
        self.lengths, self.bounds, self.offset = lengths, bounds, offset
        self.n = len(lengths)
        self.seed, self.shuffle, self.window, self.long_docs = seed, shuffle, window, long_docs
        self.epoch = self.pos = 0
        self._order: tuple[int, EpochOrder] | None = None
        self._buf: tuple[int, int, list[int], np.ndarray] = (-1, 0, [], np.zeros(0, dtype=np.int64))
        self._tok: tuple[int, list[int], list[int]] = (-1, [], [])  # (limit, lengths, tokens) of the buffer
        self._chunk = 256
        self._since_release = 0

    def seek(self, epoch: int, pos: int) -> None:
        self.epoch, self.pos = epoch, pos

    def peek(self, limit: int) -> tuple[int, int, int]:
        """``(doc_id, length, tokens at context limit `limit`)`` at the current place."""
        e, at, ids, ln = self._buf
        if e != self.epoch or not at <= self.pos < at + len(ids):
            if self._order is None or self._order[0] != self.epoch:
                self._order = (self.epoch, EpochOrder(self.n, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle,
                                                      shard_bounds=self.bounds, window=self.window))
            got = self._order[1].docs(self.pos, min(self.n, self.pos + self._chunk))  # [chunk]
            self._buf = e, at, ids, ln = (self.epoch, self.pos, got.tolist(),
                                          np.asarray(self.lengths[got], dtype=np.int64))
            self._tok = (-1, [], [])
            self._chunk = min(self._chunk * 2, 8192)
            self._since_release += len(got)
            if self._since_release >= _RELEASE_EVERY:
                release_pages(self.lengths)
                self._since_release = 0
        if self._tok[0] != limit:  # the long-doc rule at this step's limit, for the whole buffer at once
            tok = doc_tokens(ln, np.asarray(ids, dtype=np.int64) + self.offset, limit, self.long_docs)
            self._tok = (limit, ln.tolist(), tok.tolist())
        i = self.pos - at
        return ids[i], self._tok[1][i], self._tok[2][i]

    def advance(self) -> bool:
        """Move past the current doc; True when that ended the epoch."""
        self.pos += 1
        if self.pos == self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            return True
        return False


def source_seed(seed: int, name: str) -> int:
    """The epoch-order seed of mixture source ``name``: its own stream of orders for each loader seed."""
    return int(seed) + (zlib.crc32(name.encode()) << 64)


class MixtureStream:
    """The global batches of a mixture (or of one source under a schedule), cut from a :class:`MixCursor`.

    ``lengths``/``bounds``/``seeds``: per source, ``[num_docs]`` lengths, shard bounds (or None) and
    epoch-order seed; ``offsets``: ``[k + 1]`` first doc id of each source in the mixture's ids;
    ``names``: the sources (None: one source, not a mixture: no per-source token counts, and a
    step closes at the source's epoch end).
    """

    def __init__(self, lengths: Sequence[Any], bounds: Sequence[np.ndarray | None], seeds: Sequence[int], *,
                 offsets: np.ndarray, names: Sequence[str] | None, weights: WeightSchedule, by: str,
                 max_seq_len: Schedule | None, global_batch_tokens: Schedule, long_docs: str, shuffle: bool,
                 window: int) -> None:
        self.k = len(lengths)
        self.names = tuple(names) if names is not None else None
        self.sizes = tuple(len(x) for x in lengths)
        self.offsets = [int(o) for o in offsets]
        self.readers = [_Reader(x, b, o, seed=s, shuffle=shuffle, window=window, long_docs=long_docs)
                        for x, b, o, s in zip(lengths, bounds, self.offsets, seeds)]
        self.weights, self.by = weights, by
        self.max_seq_len, self.budget, self.long_docs = max_seq_len, global_batch_tokens, long_docs
        z = (0,) * self.k
        self._epoch_starts: dict[int, MixCursor] = {
            0: MixCursor(step=0, epoch=0, step_in_epoch=0, epochs=z, positions=z, marks=z, carry=(0.0,) * self.k)}

    # ---- one step ------------------------------------------------------------------------
    def _label(self, i: int) -> str:
        return f"source '{self.names[i]}'" if self.names is not None else "the source"

    def cut(self, cur: MixCursor) -> Cut:
        """The step starting at ``cur``; its ``end`` is the next step's cursor."""
        step, k, single = cur.step, self.k, self.names is None
        budget, limit, w = self.budget.at(step), self.limit_at(step), self.weights.at(step)
        by_docs = self.by == "docs"
        for r, e, p in zip(self.readers, cur.epochs, cur.positions):
            r.seek(e, p)
        ids: list[int] = []  # the step's docs in the order taken (empty and dropped ones included), mixture ids
        lens: list[int] = []
        taken: list[set[int]] = [set() for _ in range(k)]
        units = [0.0] * k
        tokens = [0] * k
        total_units, total_tokens = 0.0, 0
        nxt: list[tuple[int, int, int] | None] = [None] * k  # each source's next doc with tokens
        live = [x > 0 for x in w]
        epoch_end = False

        def fill(i: int) -> bool:
            """Peek source i's next doc with tokens (skipping, and keeping in the step, docs without);
            False when one source's epoch ended first (then the step closes)."""
            r, skipped = self.readers[i], 0
            while True:
                doc, ln, tk = r.peek(limit)
                if tk > 0:
                    nxt[i] = (doc, ln, tk)
                    return True
                ids.append(self.offsets[i] + doc)
                lens.append(ln)
                skipped += 1
                if skipped > r.n:
                    within = f" within max_seq_len {limit}" if self.long_docs == "drop" else ""
                    raise ValueError(f"{self._label(i)} has no tokens to train on: none of its {r.n} docs is "
                                     f"non-empty{within}")
                if r.advance() and single:
                    return False

        while True:
            best, best_score = -1, 0.0
            for i in range(k):
                if not live[i]:
                    continue
                if nxt[i] is None and not fill(i):
                    epoch_end = True
                    break
                u = 1.0 if by_docs else float(nxt[i][2])  # type: ignore[index]
                score = CARRY_GAIN * cur.carry[i] + units[i] - w[i] * total_units + (1.0 - w[i]) * u / 2
                if best < 0 or score < best_score:
                    best, best_score = i, score
            if epoch_end:
                break
            doc, ln, tk = nxt[best]  # type: ignore[misc]
            if total_tokens and (total_tokens + tk > budget or doc in taken[best]):
                break
            ids.append(self.offsets[best] + doc)
            lens.append(ln)
            taken[best].add(doc)
            units[best] += 1.0 if by_docs else tk
            total_units += 1.0 if by_docs else tk
            tokens[best] += tk
            total_tokens += tk
            nxt[best] = None
            if self.readers[best].advance() and single:
                break
        items, stats = to_items(np.asarray(lens, dtype=np.int64), np.asarray(ids, dtype=np.int64), limit,
                                self.long_docs)
        end = self._after(cur, units, total_units, w)
        mix_tokens = dict(zip(self.names, tokens)) if self.names is not None else None
        return Cut(items=items, start=cur, end=end, stats=stats, mixture_tokens=mix_tokens)

    def _after(self, cur: MixCursor, units: list[float], total: float, w: tuple[float, ...]) -> MixCursor:
        """The cursor after a step that took ``units`` per source of ``total``."""
        epochs = tuple(r.epoch for r in self.readers)
        positions = tuple(r.pos for r in self.readers)
        carry = tuple(c + u - x * total for c, u, x in zip(cur.carry, units, w))
        active = self.weights.active(cur.step)
        done = all(e > m for e, m, a in zip(epochs, cur.marks, active) if a)
        end = MixCursor(step=cur.step + 1, epoch=cur.epoch + done, step_in_epoch=0 if done else cur.step_in_epoch + 1,
                        epochs=epochs, positions=positions, marks=epochs if done else cur.marks, carry=carry)
        if done:
            self._epoch_starts.setdefault(end.epoch, end)
        return end

    # ---- epochs --------------------------------------------------------------------------
    def epoch_start(self, epoch: int) -> MixCursor:
        """The cursor of the mixture epoch's first step (a streaming pass over earlier epochs if not yet seen)."""
        while epoch not in self._epoch_starts:
            e = max(x for x in self._epoch_starts if x < epoch)
            self.epoch(e).summary()
        return self._epoch_starts[epoch]

    def epoch(self, epoch: int) -> MixtureEpoch:
        return MixtureEpoch(self, epoch)

    @property
    def cursor_names(self) -> tuple[str, ...]:
        """The source names a cursor's JSON uses."""
        return self.names if self.names is not None else ("data",)

    def load(self, d: Any, *, epoch: int, step_in_epoch: int, step: int, finished: bool) -> MixCursor | None:
        """The cursor of a loader state's ``position`` (``{"cursor", "epoch_start"}``), checked against the
        state's step and these sources; the epoch's first cursor is remembered. None: a finished loader."""
        if not isinstance(d, dict) or "epoch_start" not in d or "cursor" not in d:
            raise ValueError("malformed loader state: a mixture's or schedule's position must be a mapping with "
                             "'cursor' and 'epoch_start'; pass a dict from BalancedLoader.state_dict()")
        start = MixCursor.from_json(d["epoch_start"], self.cursor_names, self.sizes)
        cur = None if d["cursor"] is None else MixCursor.from_json(d["cursor"], self.cursor_names, self.sizes)
        if (cur is None) != finished or start.epoch != epoch or start.step_in_epoch or start.step > step or (
                cur is not None and (cur.epoch, cur.step_in_epoch, cur.step) != (epoch, step_in_epoch, step)):
            raise ValueError(f"malformed loader state: its mixture cursor does not match epoch {epoch}, step "
                             f"{step_in_epoch} of the epoch, global step {step}")
        self._epoch_starts[epoch] = start
        return cur

    def limit_at(self, step: int) -> int | None:
        """The context limit of global ``step`` (None: no limit)."""
        return None if self.max_seq_len is None else int(self.max_seq_len.at(step))


class MixtureEpoch:
    """One mixture epoch as :class:`~balanced_loader.data.epochs.EpochCuts` reads it: ``first``,
    ``cut``, ``is_end`` and ``summary``."""

    def __init__(self, stream: MixtureStream, epoch: int) -> None:
        self.stream, self.epoch = stream, epoch

    @property
    def first(self) -> MixCursor:
        return self.stream.epoch_start(self.epoch)

    def cut(self, start: MixCursor) -> Cut:
        return self.stream.cut(start)

    def is_end(self, c: Cut) -> bool:
        return c.end.epoch != self.epoch

    def summary(self) -> tuple[int, DocStats]:
        """Steps and doc stats of the epoch: one streaming pass from its first step."""
        steps, stats, cur = 0, DocStats(), self.first
        while True:
            c = self.cut(cur)
            steps += 1
            stats = stats + c.stats
            if self.is_end(c):
                return steps, stats
            cur = c.end


def stream_for(source: Any, *, seed: int, shuffle: bool, window: int, max_seq_len: Schedule | None,
               global_batch_tokens: Schedule, long_docs: str) -> MixtureStream:
    """The :class:`MixtureStream` of a :class:`~balanced_loader.data.mixture.MixtureSource` (each source
    seeded by :func:`source_seed`), or of one source under a schedule (the loader's own seed and order)."""
    common = dict(max_seq_len=max_seq_len, global_batch_tokens=global_batch_tokens, long_docs=long_docs,
                  shuffle=shuffle, window=window)
    if isinstance(source, MixtureSource):
        return MixtureStream([s.lengths for s in source.sources], [s.shard_bounds for s in source.sources],
                             [source_seed(seed, n) for n in source.names], offsets=source.offsets,
                             names=source.names, weights=source.weights, by=source.by, **common)
    return MixtureStream([source.lengths], [source.shard_bounds], [seed], offsets=np.asarray([0, source.num_docs]),
                         names=None, weights=weight_schedule({"data": 1.0}, ["data"]), by="tokens", **common)
