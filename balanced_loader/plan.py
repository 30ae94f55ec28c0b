"""Contract 1: the step plan (JSON format ``balanced-loader/plan`` version 1).

A :class:`StepPlan` says, for one optimizer step, which pools (rank sets of one
``(tp, pp)`` shape) exist, and for each pool which groups of lanes run which
segments in which microbatch. Planning is pure; these types are plain data.

Why one module: it is contract 1 as code, the leaf every stage imports (nothing of ours below it):
the plan's types, their JSON form and their checks (``StepPlan.validate``, ``pool_grid``, the
sequences a step must tile) read the same fields, and a reader of the contract finds it in one place.
That is why it runs past 600 lines: splitting the checks or the JSON form from the types would put one
contract in two rooms, each needing the other's fields (the columnar groups, ``SegmentColumns`` /
``ColumnGroup``, are the same ``Group`` stored for a planner's million segments, not a concept of their own).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

PLAN_FORMAT = "balanced-loader/plan"
PLAN_VERSION = 1

Segment = tuple[int, int, int]  # (doc_id, start, length)


class LaneCaps(Protocol):
    """What :meth:`StepPlan.validate` needs of a cost model: the token cap of a lane of each shape
    (``CostModel`` is one; this module imports nothing of ours)."""

    def lane_cap(self, tp: int, pp: int) -> int:
        """``max_tokens_per_lane`` of shape ``(tp, pp)``; 0 marks an unusable shape."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """Lanes that work together on some segments in one microbatch."""

    lanes: tuple[int, ...]  # [degree] lane indices inside the pool
    segments: tuple[Segment, ...]  # [num_segments] (doc_id, start, length)

    @property
    def degree(self) -> int:
        return len(self.lanes)

    @property
    def tokens(self) -> int:
        return sum(s[2] for s in self.segments)

    def to_json(self) -> dict[str, Any]:
        return {"lanes": list(self.lanes), "segments": [list(s) for s in self.segments]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Group:
        return Group(
            lanes=tuple(int(x) for x in d["lanes"]),
            segments=tuple((int(a), int(b), int(c)) for a, b, c in d["segments"]),
        )


def make_groups(lanes: Iterable[tuple[int, ...]], segments: Iterable[tuple[Segment, ...]]) -> list[Group]:
    """``[Group(lanes=l, segments=s) for l, s in zip(lanes, segments)]``, built without the frozen
    dataclass ``__init__`` (a planner builds ~100K groups per step at 16K lanes, and that call was
    a third of the cost). The inputs must already be tuples of ints, as ``Group`` requires."""
    new = object.__new__
    set_lanes = Group.lanes.__set__  # slot descriptors: a frozen dataclass forbids plain setattr
    set_segments = Group.segments.__set__
    out = []
    for ln, seg in zip(lanes, segments):
        g = new(Group)
        set_lanes(g, ln)
        set_segments(g, seg)
        out.append(g)
    return out


class SegmentColumns:
    """The segments of many groups end to end, as arrays (what a planner computes): ``doc_ids``,
    ``starts``, ``lengths`` ``[S]`` int64. :func:`column_groups` makes groups that read ranges of it."""

    __slots__ = ("doc_ids", "starts", "lengths", "_tuples")

    def __init__(self, doc_ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        self.doc_ids, self.starts, self.lengths = doc_ids, starts, lengths  # [S] int64 each
        self._tuples: list[Segment] | None = None

    def tuples(self) -> list[Segment]:
        """Every segment as a ``(doc_id, start, length)`` tuple, made once (one C-level pass)."""
        if self._tuples is None:
            self._tuples = list(zip(self.doc_ids.tolist(), self.starts.tolist(), self.lengths.tolist()))
        return self._tuples


_GROUP_SEGMENTS = Group.segments  # the slot of Group's field (a subclass property shadows it)


def _plain_group(lanes: tuple[int, ...], segments: tuple[Segment, ...]) -> Group:
    return Group(lanes=lanes, segments=segments)


class ColumnGroup(Group):
    """A :class:`Group` whose segments are the range ``[lo, hi)`` of shared :class:`SegmentColumns`,
    made into tuples when first read. Why: a planner at 16K lanes builds ~100K groups of ~1M
    segments per step, and most readers (contract-2 timing, a rank's own microbatches) need either
    the arrays or a few groups, not a million tuples. Equal to, hashed and pickled as the plain
    ``Group`` of the same lanes and segments."""

    __slots__ = ("_cols", "_lo", "_hi")

    @property
    def segments(self) -> tuple[Segment, ...]:  # type: ignore[override]
        try:
            return _GROUP_SEGMENTS.__get__(self, Group)
        except AttributeError:
            segs = tuple(self._cols.tuples()[self._lo:self._hi])
            _GROUP_SEGMENTS.__set__(self, segs)
            return segs

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Group):
            return self.lanes == other.lanes and self.segments == other.segments
        return NotImplemented

    __hash__ = Group.__hash__

    def __reduce__(self):
        return _plain_group, (self.lanes, self.segments)


def column_groups(lanes: Sequence[tuple[int, ...]], bounds: Sequence[int], columns: SegmentColumns) -> list[Group]:
    """Groups ``g`` of ``lanes[g]`` and segments ``columns[bounds[g]:bounds[g + 1]]`` (``bounds``: ``[G + 1]``
    ascending from 0 to ``S``), built without ``__init__`` as :func:`make_groups` does."""
    new = object.__new__
    set_lanes = Group.lanes.__set__
    set_cols, set_lo, set_hi = ColumnGroup._cols.__set__, ColumnGroup._lo.__set__, ColumnGroup._hi.__set__
    out = []
    for ln, lo, hi in zip(lanes, bounds[:-1], bounds[1:]):
        g = new(ColumnGroup)
        set_lanes(g, ln)
        set_cols(g, columns)
        set_lo(g, lo)
        set_hi(g, hi)
        out.append(g)
    return out


def segment_lengths(groups: Sequence[Group]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(lengths [S], segments per group [G])`` straight from the columns when ``groups`` are
    :class:`ColumnGroup`\\ s reading one columns object end to end in order; else ``None``."""
    if not groups or type(groups[0]) is not ColumnGroup:
        return None
    cols, at = groups[0]._cols, groups[0]._lo
    los = []
    for g in groups:
        if type(g) is not ColumnGroup or g._cols is not cols or g._lo != at:
            return None
        los.append(at)
        at = g._hi
    nseg = np.diff(np.append(np.asarray(los, dtype=np.int64), at))  # [G]
    return cols.lengths[groups[0]._lo:at], nseg


@dataclass(frozen=True, kw_only=True, slots=True)
class Pool:
    """Ranks sharing one ``(tp, pp)`` shape for this step, as a grid ``[pp][lanes][tp]``.

    The one home of the rank grid: :meth:`rank`, :meth:`lane_ranks`, :meth:`group_ranks` (a pool
    with ``microbatches=()`` is a bare grid).
    """

    tp: int
    pp: int
    ranks: tuple[tuple[int, ...], ...]  # [pp][num_lanes * tp]; lane l, tp index t -> ranks[s][l*tp+t]
    microbatches: tuple[tuple[Group, ...], ...]  # [num_microbatches][groups]
    # [num_barriers] sorted microbatch indices k: before microbatch k every lane of the pool waits until all
    # its lanes are free (a barrier over the pool's ranks; Megatron-Core's hybrid CP has one after each round)
    barriers: tuple[int, ...] = ()

    @property
    def num_lanes(self) -> int:
        return len(self.ranks[0]) // self.tp if self.ranks else 0

    @property
    def num_ranks(self) -> int:
        return sum(len(r) for r in self.ranks)

    def rank(self, stage: int, lane: int, tp_index: int = 0) -> int:
        return self.ranks[stage][lane * self.tp + tp_index]

    def lane_ranks(self, lane: int, stage: int = 0) -> tuple[int, ...]:
        """The ``tp`` ranks of one lane at one stage (its TP group)."""
        return self.ranks[stage][lane * self.tp : (lane + 1) * self.tp]

    def group_ranks(self, lanes: Sequence[int], stage: int = 0, tp_index: int = 0) -> tuple[int, ...]:
        """Ranks of a group of lanes at one stage and tp index, in the group's lane order (its CP group)."""
        return tuple(self.rank(stage, lane, tp_index) for lane in lanes)

    def check_lanes(self, where: str) -> None:
        """ValueError unless every group has lanes in range and the groups of a microbatch use disjoint lanes."""
        nl = self.num_lanes
        for k, mb in enumerate(self.microbatches):
            used: set[int] = set()
            for gi, g in enumerate(mb):
                gw = f"{where}, microbatch {k}, group {gi}"
                if not g.lanes:
                    raise ValueError(f"{gw}: a group needs at least one lane")
                for lane in g.lanes:
                    if not 0 <= lane < nl:
                        raise ValueError(f"{gw}: lane {lane} is outside 0..{nl - 1}")
                    if lane in used:
                        raise ValueError(f"{gw}: lane {lane} is in two groups of one microbatch")
                    used.add(lane)

    def check_barriers(self, where: str) -> None:
        """ValueError unless the barriers are sorted, unique and each ``0 < k < num_microbatches``."""
        nm = len(self.microbatches)
        prev = 0
        for k in self.barriers:
            if not 0 < k < nm:
                raise ValueError(f"{where}: barrier before microbatch {k} is outside 1..{nm - 1} "
                                 f"(a barrier must fall between two of the pool's {nm} microbatches)")
            if k <= prev:
                raise ValueError(f"{where}: barriers must be sorted and unique, got {list(self.barriers)}")
            prev = k

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "tp": self.tp,
            "pp": self.pp,
            "ranks": [list(r) for r in self.ranks],
            "microbatches": [[g.to_json() for g in mb] for mb in self.microbatches],
        }
        if self.barriers:  # only when present: plans without barriers keep their bytes and fingerprints
            d["barriers"] = list(self.barriers)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Pool:
        return Pool(
            tp=int(d["tp"]),
            pp=int(d["pp"]),
            ranks=tuple(tuple(int(x) for x in r) for r in d["ranks"]),
            microbatches=tuple(tuple(Group.from_json(g) for g in mb) for mb in d["microbatches"]),
            barriers=tuple(int(k) for k in d.get("barriers", ())),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """The plan of one optimizer step."""

    step: int
    world_size: int
    pools: tuple[Pool, ...]
    plan_seconds: float = 0.0
    predicted_ms: float = 0.0
    notes: tuple[str, ...] = ()  # e.g. "solver time-out: greedy fallback"

    # ---- derived views -------------------------------------------------
    def doc_ids(self) -> np.ndarray:
        """Sorted unique doc_ids of this step."""  # [num_docs]
        ids = [s[0] for p in self.pools for mb in p.microbatches for g in mb for s in g.segments]
        return np.unique(np.asarray(ids, dtype=np.int64))

    @property
    def tokens(self) -> int:
        return sum(g.tokens for p in self.pools for mb in p.microbatches for g in mb)

    @property
    def num_groups(self) -> int:
        return sum(len(mb) for p in self.pools for mb in p.microbatches)

    def with_timing(self, *, plan_seconds: float | None = None, predicted_ms: float | None = None,
                    notes: tuple[str, ...] | None = None) -> StepPlan:
        return StepPlan(
            step=self.step,
            world_size=self.world_size,
            pools=self.pools,
            plan_seconds=self.plan_seconds if plan_seconds is None else plan_seconds,
            predicted_ms=self.predicted_ms if predicted_ms is None else predicted_ms,
            notes=self.notes if notes is None else notes,
        )

    def with_step(self, step: int) -> StepPlan:
        return StepPlan(step=step, world_size=self.world_size, pools=self.pools,
                        plan_seconds=self.plan_seconds, predicted_ms=self.predicted_ms, notes=self.notes)

    # ---- serialization -------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "step": self.step,
            "plan_seconds": round(float(self.plan_seconds), 6),
            "predicted_ms": round(float(self.predicted_ms), 4),
            "pools": [p.to_json() for p in self.pools],
        }
        if self.notes:
            d["notes"] = list(self.notes)
        return d

    @staticmethod
    def from_json(d: dict[str, Any], world_size: int) -> StepPlan:
        return StepPlan(
            step=int(d["step"]),
            world_size=int(world_size),
            pools=tuple(Pool.from_json(p) for p in d["pools"]),
            plan_seconds=float(d.get("plan_seconds", 0.0)),
            predicted_ms=float(d.get("predicted_ms", 0.0)),
            notes=tuple(d.get("notes", ())),
        )

    def fingerprint(self) -> str:
        """Hash of what every rank must agree on (step, world, pools); timings excluded."""
        body = json.dumps(
            {"step": self.step, "world_size": self.world_size, "pools": [p.to_json() for p in self.pools]},
            separators=(",", ":"),
            sort_keys=True,
        )
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    # ---- validation ----------------------------------------------------
    def validate(self, lengths: Sequence[int] | np.ndarray | BatchItems | None = None, caps: LaneCaps | None = None,
                 doc_ids: Iterable[int] | None = None) -> None:
        """Check every contract-1 invariant; raise ``ValueError`` naming step, pool, microbatch and doc.

        ``lengths``: the step's sequences as :class:`BatchItems` (the segments must tile each of them
        exactly, and nothing else: what the loader checks), or lengths indexed by doc_id (every doc's
        segments tile ``[0, length)``: a step of whole docs), or ``None`` (each doc's segments must
        still tile ``[0, end)`` without gaps or overlaps, but its length is not known). ``doc_ids``
        (optional, with lengths) is the exact set of docs this step must hold. ``caps`` (optional, e.g.
        the ``CostModel``) enables the shape and memory-cap checks. The runtime calls
        ``plan.validate(caps=cost)`` before executing a plan.
        """
        where = f"step {self.step}"
        if self.world_size < 1:
            raise ValueError(f"{where}: world_size must be >= 1, got {self.world_size}")
        pool_grid(self.world_size, self.pools, where=f"{where}, ")
        pieces: dict[int, list[tuple[int, int, str]]] = {}
        for pi, pool in enumerate(self.pools):
            pw = f"{where}, pool {pi} (tp={pool.tp}, pp={pool.pp})"
            cap = None
            lane_caps = None  # [lanes] per-lane caps of a cluster with device classes (contract 2)
            if caps is not None:
                cap = caps.lane_cap(pool.tp, pool.pp)
                if cap <= 0:
                    raise ValueError(f"{pw}: shape is marked unusable (max_tokens_per_lane: 0)")
                per_lane = getattr(caps, "pool_lane_caps", None)
                if per_lane is not None:
                    lane_caps = per_lane(pool.tp, pool.pp, pool.ranks, self.world_size)
            pool.check_lanes(pw)
            pool.check_barriers(pw)
            for k, mb in enumerate(pool.microbatches):
                for gi, g in enumerate(mb):
                    gw = f"{pw}, microbatch {k}, group {gi}"
                    if not g.segments:
                        raise ValueError(f"{gw}: a group needs at least one segment")
                    for doc, start, length in g.segments:
                        if length <= 0 or start < 0:
                            raise ValueError(f"{gw}, doc {doc}: segment ({doc}, {start}, {length}) is empty")
                        pieces.setdefault(doc, []).append((start, length, gw))
                    if lane_caps is not None and len(g.lanes) and max(g.lanes) < len(lane_caps):
                        cap = int(min(lane_caps[x] for x in g.lanes))  # memory holds on every lane of its class
                    if cap is not None and g.tokens > cap * g.degree:
                        raise ValueError(
                            f"{gw}: {g.tokens} tokens on {g.degree} lane(s) exceed max_tokens_per_lane "
                            f"{cap} (x{g.degree}); use a larger degree or a larger shape"
                        )
        if isinstance(lengths, BatchItems):
            _check_sequences(where, pieces, lengths)
            return
        # anything indexable by doc_id is read as is (a mixture's lengths are read through, never copied)
        lengths_arr = lengths if lengths is None or hasattr(lengths, "__getitem__") else np.asarray(lengths)
        for doc, segs in pieces.items():
            if doc < 0 or (lengths_arr is not None and doc >= len(lengths_arr)):
                raise ValueError(f"{segs[0][2]}: doc {doc} is not in the length index")
            segs.sort()
            pos = 0
            for start, length, gw in segs:
                if start != pos:
                    what = "overlaps" if start < pos else "leaves a gap before"
                    raise ValueError(f"{gw}: doc {doc} segment at {start} {what} token {pos}")
                pos = start + length
            if lengths_arr is not None and pos != int(lengths_arr[doc]):
                raise ValueError(f"{where}: doc {doc} covers {pos} of its {int(lengths_arr[doc])} tokens")
        if doc_ids is not None:
            expected = {int(d) for d in doc_ids}
            got = set(pieces)
            if expected != got:
                miss = sorted(expected - got)[:8]
                extra = sorted(got - expected)[:8]
                raise ValueError(f"{where}: docs missing from the plan {miss}, docs not in the batch {extra}")


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchItems:
    """The sequences of one global batch, each planned as an independent training sequence.

    A normal doc is one item with ``start == 0``; a doc split at the context limit is
    several items with the same doc_id.
    """

    doc_ids: np.ndarray  # [n] int64
    starts: np.ndarray  # [n] int64
    lengths: np.ndarray  # [n] int64

    def __post_init__(self) -> None:
        n = len(self.doc_ids)
        assert len(self.starts) == n and len(self.lengths) == n

    @staticmethod
    def from_lengths(lengths: Any, doc_ids: Any = None) -> BatchItems:
        ln = np.asarray(lengths, dtype=np.int64).reshape(-1)
        ids = np.arange(len(ln), dtype=np.int64) if doc_ids is None else np.asarray(doc_ids, dtype=np.int64)
        if ln.size and ln.min() <= 0:
            bad = int(np.flatnonzero(ln <= 0)[0])
            raise ValueError(f"lengths must be positive: doc {int(ids[bad])} has length {int(ln[bad])}")
        return BatchItems(doc_ids=ids, starts=np.zeros(len(ln), dtype=np.int64), lengths=ln)

    def __len__(self) -> int:
        return len(self.lengths)

    def segment(self, i: int) -> tuple[int, int, int]:
        return (int(self.doc_ids[i]), int(self.starts[i]), int(self.lengths[i]))

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A plan file: several steps under one policy and world size."""

    policy: str
    world_size: int
    steps: tuple[StepPlan, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "policy": self.policy,
            "world_size": self.world_size,
            "steps": [s.to_json() for s in self.steps],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @staticmethod
    def from_json(d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise ValueError(f"not a plan file: expected \"format\": \"{PLAN_FORMAT}\"")
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {d.get('version')} is not supported (this reader knows {PLAN_VERSION})")
        ws = d.get("world_size")
        max_world = 1 << 20  # 1,048,576 ranks: a larger world is a corrupt file, not a cluster
        if isinstance(ws, bool) or not isinstance(ws, int) or not 1 <= ws <= max_world:
            raise ValueError(f"malformed plan file: world_size must be an integer in 1..{max_world:,}, "
                             f"got {str(ws)[:40]}")
        try:
            plan = Plan(policy=str(d["policy"]), world_size=ws,
                        steps=tuple(StepPlan.from_json(s, ws) for s in d["steps"]))
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
            raise ValueError(f"malformed plan file: {type(e).__name__}: {str(e)[:200]}") from None
        # every number in range before numpy sees it (an int64 overflow would be a traceback later)
        big = 1 << 40  # tokens of a doc or a segment
        for prev, sp in zip(plan.steps, plan.steps[1:]):  # a step given twice would be simulated or run twice
            if sp.step <= prev.step:
                raise ValueError(f"malformed plan file: step numbers must increase, but step {sp.step} comes after "
                                 f"step {prev.step}")
        for sp in plan.steps:
            where = f"malformed plan file: step {sp.step}"
            if not 0 <= sp.step < 1 << 62:
                raise ValueError(f"malformed plan file: step number {sp.step} is out of range")
            if not (0 <= sp.plan_seconds < float("inf") and 0 <= sp.predicted_ms < float("inf")):  # nan fails too
                raise ValueError(f"{where}: plan_seconds and predicted_ms must be finite and >= 0")
            for pool in sp.pools:
                if not (1 <= pool.tp <= ws and 1 <= pool.pp <= ws):
                    raise ValueError(f"{where}: pool tp={pool.tp} pp={pool.pp} is outside 1..{ws}")
                if any(not 0 <= r < ws for row in pool.ranks for r in row):
                    raise ValueError(f"{where}: a pool rank is outside 0..{ws - 1}")
                for mb in pool.microbatches:
                    for g in mb:
                        if any(not 0 <= lane < ws for lane in g.lanes):
                            raise ValueError(f"{where}: a group lane is outside 0..{ws - 1}")
                        for doc, start, length in g.segments:
                            if not (-1 <= doc < 1 << 62 and 0 <= start <= big and 0 <= length <= big):
                                raise ValueError(f"{where}: segment ({doc}, {start}, {length}) is out of range "
                                                 f"(doc_id -1..2**62, start and length 0..2**40)")
        return plan

    @staticmethod
    def load(path: str) -> Plan:
        return Plan.from_json(read_plan_json(path))


def read_plan_json(path: str) -> Any:
    """The parsed JSON of a plan file (not yet checked); one ``ValueError`` line when unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read plan file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"plan file {path} is not text (expected the JSON of 'balanced-loader plan --out')") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"plan file {path} is not JSON: {e}") from None


def pool_grid(world_size: int, pools: Sequence[Pool], *, where: str = "") -> list[tuple[int, int, int, int]]:
    """Check that ``pools``' rank grids tile ``0 .. world_size - 1`` (contract 1: every stage lists the
    same positive multiple of tp ranks, ranks in the world, disjoint, covering it) and give each rank's
    ``(pool, stage, lane, tp_index)`` (``[world_size]``). The one grid check of the plan and the runtime's
    topology; ``where`` prefixes every message."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{where}world_size must be a positive integer, got {world_size!r}")
    if not pools:
        raise ValueError(f"{where}a step needs at least one pool")
    coords: list[tuple[int, int, int, int] | None] = [None] * world_size
    for pi, p in enumerate(pools):
        at = f"{where}pool {pi} (tp={p.tp}, pp={p.pp})"
        if p.tp < 1 or p.pp < 1:
            raise ValueError(f"{at}: tp and pp must be >= 1")
        if len(p.ranks) != p.pp:
            raise ValueError(f"{at}: ranks lists {len(p.ranks)} stage(s); it needs pp={p.pp}")
        width = len(p.ranks[0])
        if width == 0 or width % p.tp:
            raise ValueError(f"{at}: stage 0 has {width} ranks, not a positive multiple of tp={p.tp}")
        for s, row in enumerate(p.ranks):
            if len(row) != width:
                raise ValueError(f"{at}: stage {s} has {len(row)} ranks, stage 0 has {width}; every stage needs "
                                 f"the same number of lanes")
            for j, r in enumerate(row):
                if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < world_size:
                    raise ValueError(f"{at}: rank {r!r} at stage {s} is outside the world 0..{world_size - 1}")
                c = coords[r]
                if c is not None:
                    raise ValueError(f"{at}: rank {r} is used twice (also pool {c[0]}, stage {c[1]}); pools' ranks "
                                     f"must be disjoint")
                coords[r] = (pi, s, j // p.tp, j % p.tp)
    missing = [r for r, c in enumerate(coords) if c is None]
    if missing:
        raise ValueError(f"{where}pools do not cover the world of {world_size} ranks; missing ranks {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    return coords  # type: ignore[return-value]


def single_pool_ranks(world_size: int, tp: int = 1, pp: int = 1, offset: int = 0) -> tuple[tuple[int, ...], ...]:
    """Rank grid of a pool covering ``world_size`` consecutive ranks from ``offset``.

    Stage-major: stage ``s`` holds ranks ``offset + s*W/pp ... offset + (s+1)*W/pp - 1``,
    so lane ``l``'s TP group is contiguous (TP inside a node) and PP crosses nodes.
    """
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp * pp}")
    per_stage = world_size // pp
    return tuple(tuple(range(offset + s * per_stage, offset + (s + 1) * per_stage)) for s in range(pp))


def plan_lengths(plan: Plan | Sequence[StepPlan]) -> np.ndarray:
    """Doc lengths implied by a plan, ``[max doc_id + 1]``: each doc's furthest segment end.

    Used to validate a plan without its length file: ``validate`` then checks that every doc's
    segments tile ``[0, end)`` without gaps or overlaps, that no group is empty and that
    memory caps and the rank grid hold; a doc whose tail is missing goes unnoticed.
    """
    steps = plan.steps if isinstance(plan, Plan) else plan
    docs: list[int] = []
    ends: list[int] = []
    for sp in steps:
        for p in sp.pools:
            for mb in p.microbatches:
                for g in mb:
                    for doc, start, length in g.segments:
                        docs.append(doc)
                        ends.append(start + length)
    if not docs:
        return np.zeros(0, dtype=np.int64)
    d = np.asarray(docs, dtype=np.int64)
    if d.min() < 0:
        raise ValueError(f"plan has a negative doc_id {int(d.min())}")
    out = np.zeros(int(d.max()) + 1, dtype=np.int64)
    np.maximum.at(out, d, np.asarray(ends, dtype=np.int64))  # unbuffered: a doc's several segments all count
    return out


def _check_sequences(where: str, pieces: dict[int, list[tuple[int, int, str]]], seqs: BatchItems) -> None:
    """The segments (``pieces``: doc -> ``(start, length, where)``) tile each sequence of ``seqs`` exactly:
    no gap, no overlap, no segment across two sequences, no doc the step does not hold."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for d, a, n in zip(seqs.doc_ids.tolist(), seqs.starts.tolist(), seqs.lengths.tolist()):
        spans.setdefault(d, []).append((a, a + n))
    extra = sorted(set(pieces) - set(spans))[:8]
    if extra:
        raise ValueError(f"{where}: docs not in the batch {extra}")
    for doc, want in spans.items():
        segs = sorted(pieces.get(doc, []))
        want.sort()
        i = 0
        for a, b in want:
            pos = a
            while pos < b:
                if i == len(segs) or segs[i][0] != pos:
                    got = "nothing" if i == len(segs) else f"a segment at {segs[i][0]}"
                    raise ValueError(f"{where}: doc {doc}'s sequence [{a}, {b}) is covered up to token {pos}, "
                                     f"then {got}")
                pos += segs[i][1]
                if pos > b:
                    raise ValueError(f"{segs[i][2]}: doc {doc} segment at {segs[i][0]} runs past its sequence "
                                     f"[{a}, {b})")
                i += 1
        if i < len(segs):
            raise ValueError(f"{segs[i][2]}: doc {doc} segment at {segs[i][0]} is in none of the step's sequences")
