"""One epoch's global batches as the loader's cursor reaches them (:class:`EpochCuts`).

``batches`` is an epoch of a :class:`~balanced_loader.batches.stream.BatchStream`
(:class:`~balanced_loader.batches.stream.StreamEpoch`): ``first`` (the cursor of the epoch's first
step), ``cut(start) -> Cut``, ``is_end(cut)`` and ``summary()``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from balanced_loader.batches.items import DocStats
from balanced_loader.batches.stream import Cut


class EpochCuts:
    """One epoch's batches, cut as the cursor reaches them; remembers where the next steps begin."""

    def __init__(self, epoch: int, batches: Any) -> None:
        self.epoch = epoch
        self.batches = batches
        self.starts: dict[int, Any] = {0: batches.first}  # step_in_epoch -> where its batch starts
        self._cuts: OrderedDict[int, Cut] = OrderedDict()  # the last few steps cut
        self.num_steps: int | None = None  # known once the last step is cut, or after summary()
        self.stats: DocStats | None = None  # the whole epoch's, after summary()
        self.seen = DocStats()  # stats of the steps cut in order from seen_from (for the epoch log)
        self.seen_from: int | None = None
        self._seen_next = 0
        self.logged = False  # the epoch's counts were logged

    def is_end(self, c: Cut) -> bool:
        """Whether ``c`` is the epoch's last batch."""
        return self.batches.is_end(c)

    def cut(self, s: int) -> Cut:
        c = self._cuts.get(s)
        if c is not None:
            return c
        if s not in self.starts:  # cut forward from the nearest known start (after the epoch was evicted)
            k = max((k for k in self.starts if k < s), default=None)
            assert k is not None, f"epoch {self.epoch}: no known step before step {s}"
            for j in range(k, s):
                self.cut(j)
        c = self.batches.cut(self.starts[s])
        self._cuts[s] = c
        while len(self._cuts) > 8:
            self._cuts.popitem(last=False)
        if not self.batches.is_end(c):
            self.starts[s + 1] = c.end
        elif len(c.items):
            self.num_steps = s + 1
        if self.seen_from is None:
            self.seen_from = self._seen_next = s
        if s == self._seen_next:
            self.seen = self.seen + c.stats
            self._seen_next += 1
        return c

    def forget_before(self, s: int) -> None:
        """Drop the starts of steps before ``s`` (the cursor has passed them)."""
        for k in [k for k in self.starts if k < s]:
            del self.starts[k]

    def summary(self) -> tuple[int, DocStats]:
        if self.stats is None:
            self.num_steps, self.stats = self.batches.summary()
        assert self.num_steps is not None
        return self.num_steps, self.stats
