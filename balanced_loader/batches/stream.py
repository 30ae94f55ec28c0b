"""Global batches of sequences, cut from a :class:`Cursor`: one source or a mixture, any schedule.

**A step** (global step ``s``: budget ``B = global_batch_tokens(s)``, limit ``L = max_seq_len(s)``,
shares ``w = weights(s)``) takes sequences (:mod:`balanced_loader.batches.sequences`) from each source
in that source's order until the budget is reached: it closes before the sequence that does not fit. A
sequence holds at most ``L <= B`` tokens, so every step holds between ``B - L`` and ``B`` tokens; only
the last step of a finite run (``epochs=N``) may hold fewer. Steps run on across epoch ends.

**A mixture's step** (shares by tokens) first fills each source ``i`` near its share ``w_i B``, its
carry ``c_i`` (how far ahead of its share the source ended the steps before, ``sum of t_i - w_i T``)
corrected by at most one sequence either way (:meth:`BatchStream._fill_shares`): a source ahead takes
up to ``w_i B - c_i / 2`` but at least ``w_i B - L``; the others up to ``w_i B`` (their room is there:
the shares sum to the budget); a source behind then up to ``min(c_i / 2, (1 - w_i) L)`` more. Then it
tops up one sequence at a time from the source furthest behind its share (smallest ``c_i / 2 + t_i -
w_i T + (1 - w_i) u_i / 2``, ``u_i`` the units of its next sequence), skipping a source the sequence
would put more than ``L`` ahead, until the chosen sequence does not fit. So each source ends within one
sequence of its share of the step, and the carry keeps the run's totals on the weights. Where that is
out of reach (docs as coarse as the budget allows: some carry beyond ``CARRY_LIMIT`` sequences) the
carry is corrected in full and a step may be off by more; a source with no sequence left in a step
leaves its room to the others (the step keeps its size). With ``by="docs"`` shares count sequences and
the whole step is the one-at-a-time rule. A source takes at most one pass of its own in a step (a
source smaller than its share stops at its first doc taken twice); a zero-weight source is not read.

**Epochs.** Epoch ``e`` ends with the step in which every source that still has a positive weight (at
that step or later) has finished one more pass over its docs. With one source, that is the step that
finishes its pass; the next epoch's first step continues inside the next pass, except at the end of a
finite run, where the last step stops at the end of the last pass: every token of a run of ``N``
epochs is delivered exactly ``N`` times.

A :class:`Cursor` names where a step starts (the global step, the epoch, and each source's
:class:`~balanced_loader.batches.sequences.SeqPos`, mark and carry): it is all a resume needs, and no
part of it depends on the world size.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from balanced_loader.batches.cursor import Cursor
from balanced_loader.batches.items import DocStats
from balanced_loader.batches.sequences import Run, SeqPos, SourceSequences
from balanced_loader.data.mixture import MixtureSource
from balanced_loader.plan import BatchItems
from balanced_loader.schedule import Schedule, WeightSchedule, check_shares, schedule, weight_schedule

CARRY_GAIN = 0.5  # the share of a source's carried surplus the next step corrects
CARRY_LIMIT = 1.5  # carries beyond this many sequences: correct them fully, even past one sequence in a step


@dataclass(frozen=True, kw_only=True, slots=True)
class Cut:
    """One global batch."""

    items: BatchItems  # its sequences (each source's in its order, sources in name order)
    start: Cursor  # where it starts
    end: Cursor  # where the next step starts
    stats: DocStats  # the docs its sequences read (a doc counts where its first sequence is)
    mixture_tokens: dict[str, int] | None = None  # a mixture's step: tokens per source

    @property
    def tokens(self) -> int:
        return int(self.items.lengths.sum())


class _Taker:
    """One source's part of one step: sequences taken in its order from ``pos`` (a read-ahead buffer).

    ``ahead``: sequences after ``pos`` already delivered (skipped when read). After the source crosses into
    its next pass in this step, a sequence this step already has from it is *blocked*: skipped now, it
    stays pending (the source's next place is the first pending one, and what it takes after that goes
    into the next ``ahead``), so a step never holds one sequence twice and nothing is lost.
    """

    def __init__(self, seq: SourceSequences, pos: SeqPos, ahead: tuple[SeqPos, ...], limit: int | None,
                 stop_epoch: int | None, chunk: int) -> None:
        self.seq, self.limit, self.stop, self.chunk = seq, limit, stop_epoch, chunk
        self.pos = seq.normal(pos)  # where the buffer starts
        self.ahead = set(ahead)
        self.start_epoch = self.pos.epoch
        self.from_epoch_start = self.pos[1:] == (0, 0, 0) and not ahead
        self.parts: list[Run] = []  # taken, in order
        self.buf: Run | None = None
        self.blocked: np.ndarray | None = None  # [len(buf)] sequences of buf this step may not take
        self.bi = 0  # sequences of buf consumed (taken or passed)
        self.tokens = 0
        self.units = 0  # sequences with tokens taken
        self.done = False  # nothing more this step (the run's end, or a second pass)
        self.pending: SeqPos | None = None  # the first sequence blocked this step
        self.after_pending: list[SeqPos] = []  # taken after it: the next step's ahead
        self._tail: set[tuple[int, int]] | None = None  # (doc, start) taken before the pass ended

    def _fill(self) -> bool:
        """A buffer with a sequence not yet consumed; False when the source has nothing more this step."""
        if self.buf is not None and self.bi < len(self.buf):
            return True
        if self.done:
            return False
        if self.buf is not None:
            self.pos = self.seq.normal(self.buf.end)
            self.buf, self.bi = None, 0
        if (self.stop is not None and self.pos.epoch >= self.stop) or self.pos.epoch > self.start_epoch + 1:
            self.done = True
            return False
        run = self.seq.read(self.pos, self.limit, self.chunk)
        self.chunk = min(self.chunk * 2, 1 << 20)
        if self.ahead:  # delivered in an earlier step: not read again
            got = run.positions()
            keep = np.asarray([p not in self.ahead for p in got], dtype=bool)
            if not keep.all():
                run = run.select(keep)
        blocked = None
        if run.epoch > self.start_epoch and len(run):  # the next pass: never a sequence this step already has
            if self._tail is None:
                if not self.tokens and self.from_epoch_start:
                    raise _NoTokens()
                self._tail = {(d, a) for p in self.parts for d, a in zip(p.doc_ids.tolist(), p.starts.tolist())}
            if self._tail:
                blocked = np.asarray([(d, a) in self._tail for d, a in zip(run.doc_ids.tolist(), run.starts.tolist())],
                                     dtype=bool)
                if not blocked.any():
                    blocked = None
        self.buf, self.blocked = run, blocked
        if not len(run):  # every sequence of this run was delivered already
            return self._fill()
        return True

    def _consume(self, n: int) -> None:
        """Consume the next ``n`` sequences of the buffer: take those not blocked, leave the blocked pending."""
        if not n:
            return
        buf, a = self.buf, self.bi
        assert buf is not None
        piece = buf if a == 0 and n == len(buf) and self.blocked is None else None
        if self.blocked is not None and self.blocked[a:a + n].any():
            blk = self.blocked[a:a + n]
            if self.pending is None:
                self.pending = buf.at(a + int(np.flatnonzero(blk)[0]))
            sel = np.zeros(len(buf), dtype=bool)
            sel[a:a + n] = ~blk
            piece = buf.select(sel)
        elif piece is None:
            piece = buf.slice(a, a + n)
        if self.pending is not None and len(piece):
            self.after_pending += [p for p in piece.positions() if p > self.pending]
        if len(piece):
            self.parts.append(piece)
            self.tokens += int(piece.tokens.sum())
            self.units += int(np.count_nonzero(piece.tokens))
        self.bi += n

    def peek(self) -> int:
        """Tokens of the next sequence this step can take (0: none); sequences without tokens on the way
        (empty or dropped docs) are taken, blocked ones left pending."""
        while self._fill():
            i = self.bi
            t = int(self.buf.tokens[i])  # type: ignore[union-attr]
            if t and (self.blocked is None or not self.blocked[i]):
                return t
            self._consume(1)
        return 0

    def take_one(self, t: int) -> None:
        """Take the sequence :meth:`peek` returned (``t`` tokens)."""
        self._consume(1)

    def take_upto(self, room: float, *, first: bool = False) -> None:
        """Take sequences in order while the tokens taken stay within ``room`` (``first``: the first
        sequence with tokens even if it alone is over: only without a context limit)."""
        while self._fill():
            arr = self.buf.tokens[self.bi:]  # type: ignore[union-attr]
            if self.blocked is not None:
                arr = np.where(self.blocked[self.bi:], 0, arr)
            cum = self.tokens + np.cumsum(arr)
            over = (cum > room) & (arr > 0)
            if first and not self.tokens:
                nz = np.flatnonzero(arr)
                if nz.size:
                    over[int(nz[0])] = False
            j = np.flatnonzero(over)
            self._consume(int(j[0]) if j.size else len(arr))
            if j.size:
                return

    def finish(self) -> tuple[list[Run], SeqPos, tuple[SeqPos, ...]]:
        """The runs taken, the source's place after them and the sequences after that place already taken."""
        here = self.buf.at(self.bi) if self.buf is not None else self.pos
        end = self.pending if self.pending is not None else self.seq.normal(here)
        ahead = set(self.after_pending) | {p for p in self.ahead if p > end}
        return self.parts, end, tuple(sorted(ahead))


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """``parts`` end to end as one int64 array (a single part as it is)."""
    if len(parts) == 1 and parts[0].dtype == np.int64:
        return parts[0]
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, dtype=np.int64)


class _NoTokens(Exception):
    """A whole pass of a source read without a token to train on."""


class BatchStream:
    """The global batches of one source or a mixture (module docstring), cut from a :class:`Cursor`.

    ``sources``: one :class:`SourceSequences` per source; ``offsets``: ``[k + 1]`` first doc id of each
    source in the stream's ids; ``names``: the sources (None: one source, not a mixture: no per-source
    token counts). ``epochs``: the run's epochs (None: endless); with one source the last step stops
    at the end of the last pass.
    """

    def __init__(self, sources: Sequence[SourceSequences], *, offsets: Sequence[int], names: Sequence[str] | None,
                 weights: WeightSchedule, by: str, max_seq_len: Schedule | None, global_batch_tokens: Schedule,
                 epochs: int | None = None) -> None:
        self.sources = list(sources)
        self.k = len(self.sources)
        self.names = tuple(names) if names is not None else None
        self.offsets = [int(o) for o in offsets]
        self.weights, self.by = weights, by
        self.max_seq_len, self.budget = max_seq_len, global_batch_tokens
        self.stop_epoch = epochs if self.names is None else None
        self._chunk = [1024] * self.k
        z = (0,) * self.k
        self._epoch_starts: dict[int, Cursor] = {0: Cursor(step=0, epoch=0, step_in_epoch=0,
                                                           places=(SeqPos(0, 0, 0, 0),) * self.k, marks=z,
                                                           carry=(0.0,) * self.k, ahead=((),) * self.k)}

    def _label(self, i: int) -> str:
        return f"source '{self.names[i]}'" if self.names is not None else "the source"

    def limit_at(self, step: int) -> int | None:
        """The context limit of global ``step`` (None: no limit)."""
        return None if self.max_seq_len is None else int(self.max_seq_len.at(step))

    # ---- one step ------------------------------------------------------------------------
    def cut(self, cur: Cursor) -> Cut:
        """The step starting at ``cur``; its ``end`` is the next step's cursor."""
        step, k = cur.step, self.k
        budget, limit, w = int(self.budget.at(step)), self.limit_at(step), self.weights.at(step)
        if k == 1 and not cur.ahead[0]:
            quick = self._cut_within_read(cur, budget, limit)
            if quick is not None:
                return quick
        takers: list[_Taker | None] = [
            _Taker(self.sources[i], cur.places[i], cur.ahead[i], limit, self.stop_epoch, self._chunk[i])
            if w[i] > 0 else None for i in range(k)]
        try:
            if k == 1:
                takers[0].take_upto(budget, first=limit is None)  # type: ignore[union-attr]
            else:
                self._mix_step(takers, cur, budget, w, first=limit is None, limit=limit)
        except _NoTokens:
            i = next(i for i, t in enumerate(takers) if t is not None and not t.tokens)
            within = f" within max_seq_len {limit}" if self.sources[i].long_docs == "drop" else ""
            raise ValueError(f"{self._label(i)} has no tokens to train on: none of its {self.sources[i].n} docs "
                             f"is non-empty{within}") from None
        ids, starts, lens, stats = [], [], [], DocStats()
        places, ahead, tokens, units = list(cur.places), list(cur.ahead), [0] * k, [0.0] * k
        for i, t in enumerate(takers):
            if t is None:
                continue
            parts, places[i], ahead[i] = t.finish()
            tokens[i], units[i] = t.tokens, float(t.units if self.by == "docs" else t.tokens)
            # next time, read about what this step took (a read-ahead past the step is read again)
            self._chunk[i] = min(max(sum(len(r) for r in parts) * 5 // 4 + 16, 64), 1 << 20)
            for r in parts:
                d, a, n = r.trained(int(self.offsets[i]))
                ids.append(d)
                starts.append(a)
                lens.append(n)
                stats = stats + self.sources[i].stats(r, limit)
        items = BatchItems(doc_ids=_joined(ids), starts=_joined(starts), lengths=_joined(lens))
        end = self._after(cur, tuple(places), tuple(ahead), units, sum(units), w)
        mix_tokens = dict(zip(self.names, tokens)) if self.names is not None else None
        return Cut(items=items, start=cur, end=end, stats=stats, mixture_tokens=mix_tokens)

    def _cut_within_read(self, cur: Cursor, budget: int, limit: int | None) -> Cut | None:
        """One source's step when it ends inside one read (most steps): the general path's result without its
        bookkeeping (None: the step crosses a read, a pass or the run's end; the general path cuts it).

        Why: a step of one source is a prefix of its next read; its per-step cost is the loader's overhead
        on every step of every rank."""
        seq = self.sources[0]
        pos = seq.normal(cur.places[0])
        if self.stop_epoch is not None and pos.epoch >= self.stop_epoch:
            return None
        run = seq.read(pos, limit, self._chunk[0])
        cum = np.cumsum(run.tokens)  # [n]
        j = int(np.searchsorted(cum, budget, side="right"))  # sequences consumed: the first over the budget stops
        if j >= len(run) or (limit is None and (j == 0 or not cum[j - 1])):  # no limit: a lone first may be over
            return None
        part = run.slice(0, j)
        self._chunk[0] = min(max(j * 5 // 4 + 16, 64), 1 << 20)
        d, a, n = part.trained()
        items = BatchItems(doc_ids=d, starts=a, lengths=n)
        total = int(cum[j - 1]) if j else 0
        end = self._after(cur, (seq.normal(run.at(j)),), ((),), [float(total)], float(total), (1.0,))
        return Cut(items=items, start=cur, end=end, stats=seq.stats(part, limit), mixture_tokens=None)

    @staticmethod
    def _fill_shares(takers: list[_Taker | None], cur: Cursor, budget: int, w: tuple[float, ...], reach: float
                     ) -> int:
        """A mixture step's first fill (by tokens): each source near its share ``w_i B``, its carry corrected
        by at most one sequence (``reach``) either way, so that no source ends more than one sequence from
        its share of the step. Returns the tokens taken.

        1. sources ahead over the steps before (carry > 0) take up to ``w_i B`` less part of their carry,
           but at least ``w_i B - reach`` (then one more sequence still fits in ``w_i B``);
        2. the others take up to ``w_i B``: each has that room left, since the shares sum to the budget;
        3. sources behind (carry < 0) then take up to part of their carry more, at most ``(1 - w_i)``
           sequences' worth, within the budget."""
        total = 0
        if max(abs(c) for c in cur.carry) > CARRY_LIMIT * reach:
            # shares out of reach within one sequence per step (docs as coarse as the budget allows): the full
            # carry correction, so the run stays on its weights; a step may then be more than a sequence off
            for i, t in enumerate(takers):
                room = min(w[i] * budget - CARRY_GAIN * cur.carry[i], budget - total)
                if t is not None and room >= 1:
                    t.take_upto(room)
                    total += t.tokens
            return total
        ahead = [i for i, t in enumerate(takers) if t is not None and cur.carry[i] > 0]
        rest = [i for i, t in enumerate(takers) if t is not None and cur.carry[i] <= 0]
        for i in ahead:
            t, share = takers[i], w[i] * budget
            t.take_upto(share - min(CARRY_GAIN * cur.carry[i], reach))  # type: ignore[union-attr]
            while t.tokens < share - reach:  # type: ignore[union-attr]
                tk = t.peek()  # type: ignore[union-attr]
                if not tk or t.tokens + tk > share:  # type: ignore[union-attr]
                    break
                t.take_one(tk)  # type: ignore[union-attr]
            total += t.tokens  # type: ignore[union-attr]
        for i in rest:
            t = takers[i]
            if w[i] * budget >= 1:
                t.take_upto(min(w[i] * budget, budget - total))  # type: ignore[union-attr]
                total += t.tokens  # type: ignore[union-attr]
        for i in rest:
            t = takers[i]
            extra = min(-CARRY_GAIN * cur.carry[i], (1.0 - w[i]) * reach)
            if extra >= 1 and total < budget:
                before = t.tokens  # type: ignore[union-attr]
                t.take_upto(min(w[i] * budget + extra, before + budget - total))  # type: ignore[union-attr]
                total += t.tokens - before  # type: ignore[union-attr]
        return total

    def _mix_step(self, takers: list[_Taker | None], cur: Cursor, budget: int, w: tuple[float, ...], *,
                  first: bool, limit: int | None = None) -> None:
        """A mixture's step: each source up to its target (by tokens), then one sequence at a time from the
        source furthest behind its share of what the step holds so far (module docstring)."""
        by_docs = self.by == "docs"
        total = 0
        reach = float(budget if limit is None else limit)  # how far a source may run ahead of its share in a step
        if not by_docs:
            total = self._fill_shares(takers, cur, budget, w, reach)
        units = float(sum((t.units if by_docs else t.tokens) for t in takers if t is not None))

        def key(i: int, t: _Taker, tk: int) -> tuple[float, int, int]:
            # the score without its -w_i * units term, which is the same for every source of one weight
            return (CARRY_GAIN * cur.carry[i] + (t.units if by_docs else t.tokens)
                    + (1.0 - w[i]) * (1.0 if by_docs else tk) / 2, i, tk)

        # one heap per distinct weight: the smallest score of a heap is its top, so a pick scans the weights,
        # not the sources (exactly the scan's choice, ties to the lower source index)
        heaps: dict[float, list[tuple[float, int, int]]] = {}
        # the one-sequence-ahead guard holds while every source has sequences left in this step: a source
        # that ran out (smaller than its share) leaves its room to the others, so the step keeps its size
        guard = not by_docs
        for i, t in enumerate(takers):
            tk = t.peek() if t is not None else 0
            if tk:
                heaps.setdefault(w[i], []).append(key(i, t, tk))
            elif t is not None:
                guard = False
        for h in heaps.values():
            heapq.heapify(h)
        while heaps:
            wi, h = min(heaps.items(), key=lambda kv: (kv[1][0][0] - kv[0] * units, kv[1][0][1]))
            _, i, tk = h[0]
            if (total or not first) and total + tk > budget:
                return
            t = takers[i]
            if guard and t.tokens + tk - w[i] * (total + tk) > reach:  # would run over a sequence ahead
                heapq.heappop(h)
                if not h:
                    del heaps[wi]
                continue
            t.take_one(tk)  # type: ignore[union-attr]
            total += tk
            units += 1.0 if by_docs else tk
            nxt = t.peek()  # type: ignore[union-attr]
            if nxt:
                heapq.heapreplace(heaps[wi], key(i, t, nxt))  # type: ignore[arg-type]
            else:
                guard = False
                heapq.heappop(heaps[wi])
                if not heaps[wi]:
                    del heaps[wi]

    def _after(self, cur: Cursor, places: tuple[SeqPos, ...], ahead: tuple[tuple[SeqPos, ...], ...],
               units: list[float], total: float, w: tuple[float, ...]) -> Cursor:
        """The cursor after a step that took ``units`` per source of ``total``."""
        carry = tuple(c + u - x * total for c, u, x in zip(cur.carry, units, w))
        active = self.weights.active(cur.step) if self.k > 1 else (True,)
        done = all(p.epoch > m for p, m, a in zip(places, cur.marks, active) if a)
        end = Cursor(step=cur.step + 1, epoch=cur.epoch + done, step_in_epoch=0 if done else cur.step_in_epoch + 1,
                     places=places, marks=tuple(p.epoch for p in places) if done else cur.marks, carry=carry,
                     ahead=ahead)
        if done:
            self._epoch_starts.setdefault(end.epoch, end)
        return end

    # ---- epochs --------------------------------------------------------------------------
    def epoch_start(self, epoch: int) -> Cursor:
        """The cursor of epoch ``epoch``'s first step (a streaming pass over earlier epochs if not yet seen)."""
        while epoch not in self._epoch_starts:
            e = max(x for x in self._epoch_starts if x < epoch)
            self.epoch(e).summary()
        return self._epoch_starts[epoch]

    def epoch(self, epoch: int) -> StreamEpoch:
        return StreamEpoch(self, epoch)

    @property
    def cursor_names(self) -> tuple[str, ...]:
        """The source names a cursor's JSON uses."""
        return self.names if self.names is not None else ("data",)

    def load(self, d: Any, *, epoch: int, step_in_epoch: int, step: int, finished: bool) -> Cursor | None:
        """The cursor of a loader state's ``position`` (``{"cursor", "epoch_start"}``), checked against the
        state's step and these sources, and replayed from the epoch's first step: a cursor that is not
        where that step of that epoch begins is refused. None: a finished loader."""
        fix = "pass a dict from BalancedLoader.state_dict(), unchanged, to a loader of the same source and config"
        if not isinstance(d, dict) or "epoch_start" not in d or "cursor" not in d:
            raise ValueError("malformed loader state: its position must be a mapping with 'cursor' and "
                             f"'epoch_start'; {fix}")
        names = self.cursor_names
        start = Cursor.from_json(d["epoch_start"], names, self.sources)
        cur = None if d["cursor"] is None else Cursor.from_json(d["cursor"], names, self.sources)
        if (cur is None) != finished or start.epoch != epoch or start.step_in_epoch or start.step > step or (
                cur is not None and (cur.epoch, cur.step_in_epoch, cur.step) != (epoch, step_in_epoch, step)):
            raise ValueError(f"malformed loader state: its batch cursor does not match epoch {epoch}, step "
                             f"{step_in_epoch} of the epoch, global step {step}; {fix}")
        self._check_epoch_start(start, fix)
        if cur is not None:
            self._replay(start, cur, fix)
        self._epoch_starts[epoch] = start
        return cur

    def _check_epoch_start(self, start: Cursor, fix: str) -> None:
        """``start`` must be where its epoch begins. Past epoch 0 that is found by streaming the earlier epochs
        (lengths only, as :meth:`_replay` does inside the epoch): a mixture's epoch begins wherever its last
        source crossed, so a moved place, epoch or carry at a later epoch's start (and at its first step,
        where the cursor is that start) is otherwise a consistent-looking state."""
        at = self._epoch_starts[max(e for e in self._epoch_starts if e <= start.epoch)]
        while at.epoch < start.epoch and at.step < start.step:  # never past the state's step: no endless replay
            at = self.cut(at).end  # an epoch's end records the next epoch's start (_after)
        want = self._epoch_starts.get(start.epoch, at)
        if start != want:
            diff = [name for name, a, b in zip(self.cursor_names, want.places, start.places) if a != b]
            what = (f"source(s) {', '.join(diff)} are not where it begins" if diff else
                    "its step, carry or marks differ from the replayed ones" if start.step != want.step or
                    start.carry != want.carry or start.marks != want.marks else "its read-ahead differs")
            raise ValueError(f"loader state: epoch {start.epoch} does not begin where its cursor says ({what}); "
                             f"{fix}")

    def _replay(self, start: Cursor, cur: Cursor, fix: str) -> None:
        """``cur`` must be where its step begins, cut from the epoch's first step (lengths only)."""
        at, n = start, cur.step_in_epoch
        for s in range(n):  # steps 0 .. n - 1 of the epoch, none of them its last
            c = self.cut(at)
            if c.end.epoch != start.epoch:
                raise ValueError(f"loader state cursor (epoch {start.epoch}, step {n}): the epoch has only "
                                 f"{s + 1} step(s); {fix}")
            at = c.end
        if at != cur:
            diff = [name for name, a, b in zip(self.cursor_names, at.places, cur.places) if a != b]
            what = (f"source(s) {', '.join(diff)} are not where step {n} begins (a cursor moved inside a step "
                    f"would replay or skip data)" if diff else "its carry or marks differ from the replayed ones")
            raise ValueError(f"loader state cursor (epoch {start.epoch}, step {n}, global step {cur.step}): {what}; "
                             f"{fix}")


class StreamEpoch:
    """One epoch of a :class:`BatchStream` as the loader's epoch cache reads it: ``first``, ``cut``,
    ``is_end`` and ``summary``."""

    def __init__(self, stream: BatchStream, epoch: int) -> None:
        self.stream, self.epoch = stream, epoch

    @property
    def first(self) -> Cursor:
        return self.stream.epoch_start(self.epoch)

    def cut(self, start: Cursor) -> Cut:
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


def source_seed(seed: int, name: str) -> int:
    """The epoch-order seed of mixture source ``name``: its own stream of orders for each loader seed."""
    return int(seed) + (zlib.crc32(name.encode()) << 64)


def stream_for(source: Any, *, seed: int, shuffle: bool, window: int, max_seq_len: Schedule | None,
               global_batch_tokens: Schedule, long_docs: str, epochs: int | None = None,
               empty_docs: str = "skip") -> BatchStream:
    """The :class:`BatchStream` of a :class:`~balanced_loader.data.mixture.MixtureSource` (each source
    seeded by :func:`source_seed`) or of one source (the loader's own seed and order)."""
    piece = None if max_seq_len is None else int(max_seq_len.largest)

    def seqs(src: Any, s: int) -> SourceSequences:
        return SourceSequences(src.lengths, shard_bounds=src.shard_bounds, seed=s, shuffle=shuffle, window=window,
                               long_docs=long_docs, piece=piece, empty_docs=empty_docs)

    common = dict(max_seq_len=max_seq_len, global_batch_tokens=global_batch_tokens, epochs=epochs)
    if isinstance(source, MixtureSource):
        check_shares(source.weights, global_batch_tokens)  # a share under one token per step: an endless epoch
        return BatchStream([seqs(s, source_seed(seed, n)) for s, n in zip(source.sources, source.names)],
                           offsets=source.offsets, names=source.names, weights=source.weights, by=source.by, **common)
    return BatchStream([seqs(source, seed)], offsets=[0, source.num_docs], names=None,
                       weights=weight_schedule({"data": 1.0}, ["data"]), by="tokens", **common)


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthArray:
    """A bare length array (and its shard bounds) as the source :func:`stream_for` reads."""

    lengths: Any
    shard_bounds: np.ndarray | None

    @property
    def num_docs(self) -> int:
        return len(self.lengths)


def global_batches(lengths: Any, *, max_seq_len: int | None, long_docs: str = "split",
                   global_batch_tokens: int | None = None, shuffle: bool = False, seed: int = 0,
                   shard_bounds: np.ndarray | None = None, max_steps: int | None = None,
                   window: int = 1 << 16, empty_docs: str = "skip") -> tuple[list[BatchItems], DocStats]:
    """The global batches of one epoch of a length array (the first ``max_steps``), as the loader cuts
    them, and the stats of the docs they read. ``global_batch_tokens=None``: the epoch is one batch."""
    ln = lengths if isinstance(lengths, np.ndarray) else np.asarray(lengths, dtype=np.int64)
    if ln.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {ln.shape}")
    if not len(ln):
        return [], DocStats()
    if global_batch_tokens is not None and global_batch_tokens < 1:
        raise ValueError(f"global_batch_tokens must be >= 1, got {global_batch_tokens}")
    budget = (schedule(global_batch_tokens, "global_batch_tokens") if global_batch_tokens is not None
              else Schedule(name="global_batch_tokens", points=((0, 1 << 62),)))  # no budget: one batch
    limit = None if max_seq_len is None else schedule(max_seq_len, "max_seq_len")
    stream = stream_for(LengthArray(lengths=ln, shard_bounds=shard_bounds), seed=seed, shuffle=shuffle, window=window,
                        max_seq_len=limit, global_batch_tokens=budget, long_docs=long_docs, epochs=1,
                        empty_docs=empty_docs)
    out: list[BatchItems] = []
    stats, cur = DocStats(), stream.epoch_start(0)
    while max_steps is None or len(out) < max_steps:
        c = stream.cut(cur)  # the run's one epoch ends the last pass: never a pass without tokens
        stats = stats + c.stats
        if len(c.items):
            out.append(c.items)
        if c.end.epoch > 0:
            break
        cur = c.end
    return out, stats
