"""Mixtures: several sources read at set proportions as one source (:func:`mix`, :class:`MixtureSource`).

The mixture's doc ids are its sources' doc ids laid end to end in name order: source ``j`` (in
sorted name order) holds ids ``offsets[j] .. offsets[j + 1] - 1``, and ``split_id(doc_id)`` gives
``(name, local_id)``. Nothing is built over all docs: ``lengths`` is a :class:`ConcatLengths` view
that reads through to the sources' own (memory-mapped) length arrays, and each source keeps its own
epoch order (see :mod:`balanced_loader.batches.stream`, which cuts the global batches).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from balanced_loader.data.open import open_source
from balanced_loader.data.sources import Source
from balanced_loader.schedule import WeightSchedule, weight_schedule

MIX_BY = ("tokens", "docs")


class ConcatLengths:
    """``[num_docs]`` lengths of several arrays end to end, read through on indexing (never concatenated).

    Supports ``len()``, an integer, an integer array (``[n]``) and a slice as index, and
    ``np.asarray`` (which does build the whole array: only for small inputs).
    """

    dtype = np.dtype(np.int64)
    ndim = 1

    def __init__(self, parts: Iterable[Any]) -> None:
        self.parts = tuple(parts)
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)  # [k + 1]
        self._starts = self.offsets[:-1].tolist()  # [k]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(part, local id)`` of each global id (``[n]`` each)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            bad = int(ids[(ids < 0) | (ids >= len(self))][0])
            raise IndexError(f"doc_id {bad} is outside 0..{len(self) - 1}")
        part = np.searchsorted(self.offsets, ids, side="right") - 1
        return part, ids - self.offsets[part]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return self[np.arange(*key.indices(len(self)), dtype=np.int64)]
        if isinstance(key, (int, np.integer)):  # one doc: the hot path of plan validation
            d = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= d < len(self):
                raise IndexError(f"doc_id {int(key)} is outside 0..{len(self) - 1}")
            j = bisect.bisect_right(self._starts, d) - 1
            return np.int64(self.parts[j][d - self._starts[j]])
        part, local = self.locate(key)
        out = np.zeros(len(local), dtype=np.int64)  # [n]
        for j in np.unique(part):
            m = part == j
            out[m] = np.asarray(self.parts[int(j)][local[m]], dtype=np.int64)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.concatenate([np.asarray(p, dtype=np.int64) for p in self.parts]) if self.parts else \
            np.zeros(0, dtype=np.int64)
        return out if dtype is None else out.astype(dtype)


class ClippedLengths:
    """``min(lengths[d], cap)`` on indexing, for an array or a :class:`ConcatLengths` (the lengths a
    truncating step's plan covers), without building a clipped copy."""

    def __init__(self, lengths: Any, cap: int) -> None:
        self.lengths, self.cap = lengths, int(cap)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, key: Any) -> Any:
        return np.minimum(self.lengths[key], self.cap)


class MixtureSource(Source):
    """Several named sources as one: their docs end to end in name order, mixed by ``weights`` per step.

    Build it with :func:`mix`. ``weights`` is a :class:`~balanced_loader.schedule.WeightSchedule`
    (shares of each step's tokens, or docs with ``by="docs"``); the loader, ``plan``, ``compare``
    and ``analyze`` read a mixture like any source.
    """

    def __init__(self, sources: Mapping[str, Source], weights: WeightSchedule, by: str = "tokens") -> None:
        self.names = tuple(sorted(sources))
        self.sources = tuple(sources[n] for n in self.names)
        if weights.names != self.names:
            raise ValueError(f"weights are for sources {list(weights.names)}, the mixture has {list(self.names)}")
        self.weights = weights
        self.by = by
        self.lengths = ConcatLengths(s.lengths for s in self.sources)  # type: ignore[assignment]
        self.offsets = self.lengths.offsets  # [k + 1]

    @property
    def has_tokens(self) -> bool:
        return all(s.has_tokens for s in self.sources)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.num_tokens) for s in self.sources)

    @property
    def bytes_read(self) -> int:  # type: ignore[override]
        return sum(s.bytes_read for s in self.sources)

    def index(self, name: str) -> int:
        """The position of source ``name`` in name order."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"{name!r} is not a source of this mixture (sources: {', '.join(self.names)})") from None

    def split_id(self, doc_id: int) -> tuple[str, int]:
        """``(source name, doc_id inside that source)`` of a mixture doc id."""
        d = self._check_doc(doc_id)
        j = int(np.searchsorted(self.offsets, d, side="right")) - 1
        return self.names[j], d - int(self.offsets[j])

    def join_id(self, name: str, local_id: int) -> int:
        """The mixture doc id of doc ``local_id`` of source ``name`` (the inverse of :meth:`split_id`)."""
        j = self.index(name)
        if not 0 <= int(local_id) < self.sources[j].num_docs:
            raise ValueError(f"doc {local_id} is outside 0..{self.sources[j].num_docs - 1} of source '{name}'")
        return int(self.offsets[j]) + int(local_id)

    def describe(self) -> str:
        w = self.weights.to_json()
        parts = ", ".join(f"{n}={s.describe()}" + (f" ({w[n]:g})" if self.weights.constant else "")
                          for n, s in zip(self.names, self.sources))
        return f"mixture by {self.by} of {parts}" + ("" if self.weights.constant else " (scheduled weights)")

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        name, local = self.split_id(doc_id)
        return self.sources[self.index(name)].read(local, start, length)

    def prefetch(self, reads: Iterable[tuple[int, int, int]]) -> None:
        per: dict[int, list[tuple[int, int, int]]] = {}
        for d, start, length in reads:
            name, local = self.split_id(d)
            per.setdefault(self.index(name), []).append((local, start, length))
        for j, rs in per.items():
            self.sources[j].prefetch(rs)

    def close(self) -> None:
        for s in self.sources:
            s.close()

    def fingerprint(self) -> str:
        """A hash of the names and each source's length fingerprint (doc order included)."""
        h = hashlib.blake2b(digest_size=16)
        for n, s in zip(self.names, self.sources):
            h.update(f"{len(n)}:{n}:{s.fingerprint()};".encode())
        return h.hexdigest()


def mix(sources: Mapping[str, Any], weights: Any = None, *, by: str = "tokens", **open_kw: Any) -> MixtureSource:
    """A source that mixes ``sources`` (``{name: anything open_source takes}``) at set proportions.

    ``weights``: ``{name: w}``, ``{name: w or [(step, w), ...]}``, or ``[(step, {name: w}), ...]``
    (piecewise linear in the global step, constant after the last point; normalized at every
    step); ``None`` weighs each source by its size (its tokens, or docs with ``by="docs"``).
    ``by="tokens"``: every global batch holds each source's share of the step's tokens;
    ``by="docs"``: of its docs. ``open_kw`` go to :func:`~balanced_loader.data.open.open_source`.

    ``sources`` may also be Megatron's data-path form, ``"0.3 PREFIX_A 0.7 PREFIX_B"`` (or prefixes only,
    each weighing its size): the sources are named by their prefixes' base names
    (:func:`balanced_loader.data.megatron.data_path_sources`).
    """
    if isinstance(sources, str):
        from balanced_loader.data.megatron import data_path_sources

        if weights is not None:
            raise ValueError("a data-path string carries its own weights ('0.3 PREFIX_A 0.7 PREFIX_B'); "
                             "pass weights=None")
        sources, weights = data_path_sources(sources)
    if by not in MIX_BY:
        raise ValueError(f"by must be one of {', '.join(MIX_BY)}, got {by!r}")
    if not isinstance(sources, Mapping) or not sources:
        raise ValueError("mix needs a mapping {name: source} with at least one source")
    opened: dict[str, Source] = {}
    for name, spec in sources.items():
        if not isinstance(name, str) or not name or any(c in name for c in "=:,@ "):
            raise ValueError(f"source name {name!r} must be a non-empty string without '=', ':', ',', '@' or spaces")
        src = open_source(spec, **open_kw)
        if isinstance(src, MixtureSource):
            raise ValueError(f"source '{name}' is itself a mixture; list its sources in one mix() instead")
        if src.num_docs == 0:
            raise ValueError(f"source '{name}' ({src.describe()}) is empty: it has no docs")
        opened[name] = src
    names = sorted(opened)
    default = None
    if weights is None:
        default = [float(opened[n].num_tokens if by == "tokens" else opened[n].num_docs) for n in names]
    return MixtureSource(opened, weight_schedule(weights, names, default=default), by=by)
