"""Where a step starts: the :class:`Cursor` of a batch stream (global step, epoch, each source's place).

A cursor is all a resume needs and no part of it depends on the world size; its JSON form is the
``position`` of a loader state, checked on load for form and against the sources here, and replayed
against the stream by :meth:`~balanced_loader.batches.stream.BatchStream.load`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from balanced_loader.batches.sequences import SeqPos, SourceSequences

_FIELDS = ("epoch", "window", "unit", "offset")


@dataclass(frozen=True, kw_only=True, slots=True)
class Cursor:
    """Where a step starts: the global step, the epoch, and each source's place (``[k]`` each)."""

    step: int
    epoch: int
    step_in_epoch: int
    places: tuple[SeqPos, ...]  # each source's next sequence
    marks: tuple[int, ...]  # each source's epoch when the stream's epoch began
    carry: tuple[float, ...]  # units each source is ahead of its share over the steps before
    ahead: tuple[tuple[SeqPos, ...], ...]  # each source's sequences after its place already delivered

    def to_json(self, names: Sequence[str]) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "sources": {n: {**dict(zip(_FIELDS, map(int, p))), "mark": m, "carry": c,
                                **({"ahead": [list(map(int, x)) for x in a]} if a else {})}
                            for n, p, m, c, a in zip(names, self.places, self.marks, self.carry, self.ahead)}}

    @staticmethod
    def from_json(d: Any, names: Sequence[str], sources: Sequence[SourceSequences]) -> Cursor:
        """A cursor from :meth:`to_json`, checked for form and against the sources (one ``ValueError``)."""
        bad = "malformed loader state: the batch cursor"
        if not isinstance(d, dict) or not isinstance(d.get("sources"), dict):
            raise ValueError(f"{bad} must be a mapping with 'sources'; pass a dict from BalancedLoader.state_dict()")
        if sorted(d["sources"]) != sorted(names):
            raise ValueError(f"{bad} has sources {sorted(d['sources'])}, this loader {list(names)}")

        def count(v: Any, what: str) -> int:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not 0 <= v < 1 << 62:
                raise ValueError(f"{bad}: {what} must be an integer >= 0, got {v!r}")
            return int(v)

        per = [d["sources"][n] for n in names]
        places, carry, ahead = [], [], []
        for n, p, src in zip(names, per, sources):
            if not isinstance(p, dict):
                raise ValueError(f"{bad}: source '{n}' must be a mapping")
            pos = SeqPos(*(count(p.get(f), f"source '{n}' {f}") for f in _FIELDS))
            got = p.get("ahead", [])
            if not isinstance(got, list) or not all(isinstance(x, list) and len(x) == 4 for x in got) or \
                    len(got) > 1 << 24:
                raise ValueError(f"{bad}: source '{n}' ahead must be a list of [epoch, window, unit, offset]")
            later = [SeqPos(*(count(v, f"source '{n}' ahead") for v in x)) for x in got]
            for q in [pos, *later]:
                why = src.check(q)
                if why is not None:
                    raise ValueError(f"{bad}: source '{n}' position {tuple(q)} is not a place of that source ({why})")
            if any(q <= pos for q in later) or len(set(later)) != len(later):
                raise ValueError(f"{bad}: source '{n}' ahead must list distinct places after its position")
            places.append(pos)
            ahead.append(tuple(sorted(later)))
            c = p.get("carry")
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not np.isfinite(c):
                raise ValueError(f"{bad}: source '{n}' carry must be a finite number, got {c!r}")
            carry.append(float(c))
        cur = Cursor(step=count(d.get("step"), "step"), epoch=count(d.get("epoch"), "epoch"),
                     step_in_epoch=count(d.get("step_in_epoch"), "step_in_epoch"), places=tuple(places),
                     marks=tuple(count(p.get("mark"), f"source '{n}' mark") for n, p in zip(names, per)),
                     carry=tuple(carry), ahead=tuple(ahead))
        if any(m > p.epoch for m, p in zip(cur.marks, cur.places)) or cur.step_in_epoch > cur.step:
            raise ValueError(f"{bad} is inconsistent (a source's mark is past its epoch, or the step is before "
                             f"the epoch's)")
        return cur
