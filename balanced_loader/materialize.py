"""Materialization: one rank's microbatches of a step plan, as flat (THD) numpy arrays.

For every group that includes the rank's lane, in microbatch order, each segment of the
group is laid out for this lane by :func:`balanced_loader.materialize.cp_positions`: the per-doc
zigzag over the group's ``d`` lanes (with ``cp_inner`` Ulysses ranks nested inside; a group
whose degree is not a multiple of ``cp_inner`` uses ``gcd(cp_inner, d)``). A segment of
``L`` tokens takes ``padded_length(L, d) / d`` positions on each lane (``L`` when d == 1).

* ``input_ids``: the tokens; padding gets ``pad_id``.
* ``labels``: the next token of the same segment, ``-100`` at each segment's last token and
  on padding (a doc split at the context limit trains as independent sequences).
* ``position_ids``: position inside the (padded) segment; padding continues the count, so
  every lane's positions are exactly the layout's positions of the padded segment.
* ``cu_seqlens``: offsets of the segments in this lane's arrays (int32).
* ``segments``: the runs ``(doc_id, start, length)`` making up ``input_ids`` in order, with
  ``doc_id == -1`` for padding runs.

Ranks of tp index > 0 get the same data as tp index 0 of their lane. Pipeline stages other
than the first and the last read no tokens: their ``input_ids`` are ``pad_id`` and their
``labels`` ``-100`` (``has_tokens`` is False); positions, ``cu_seqlens`` and segments are filled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import numpy as np

from balanced_loader.plan import Group, Segment, StepPlan

if TYPE_CHECKING:
    from balanced_loader.data.sources import Source

IGNORE_INDEX = -100

# ------------------------------------------------------------------------------------------
# The CP layout. The one context-parallel token layout, shared by the loader and every CP engine.
#
# A doc of ``length`` tokens on a group of ``degree = inner * outer`` lanes is padded to a
# multiple of ``2 * degree`` and cut into ``2 * outer`` equal chunks (zigzag on the outer
# index): outer rank ``j`` owns chunks ``j`` and ``2*outer - 1 - j``. Each owned chunk is then
# split evenly among the ``inner`` ranks, inner rank ``i`` taking sub-chunk ``i`` of both.
# Lane ``j * inner + i`` of the group holds, in order, its sub-chunk of chunk ``j`` followed by
# its sub-chunk of chunk ``2*outer - 1 - j``.
#
# * ``inner == 1`` is the plain per-doc zigzag used by ring attention.
# * ``outer == 1`` is the layout a Ulysses all-to-all gathers back into token order.
# * Padding positions are ``-1``; every lane gets the same number of positions.
# ------------------------------------------------------------------------------------------

def padded_length(length: int, degree: int) -> int:
    """``length`` rounded up to a multiple of ``2 * degree`` (``length`` itself when degree == 1)."""
    if degree <= 1:
        return length
    m = 2 * degree
    return -(-length // m) * m


def cp_positions(length: int, degree: int, inner: int = 1) -> np.ndarray:
    """Token positions of each lane: ``[degree][padded_length // degree]``, ``-1`` for padding."""
    if degree < 1 or inner < 1 or degree % inner:
        raise ValueError(f"CP degree {degree} must be a positive multiple of the inner (Ulysses) size {inner}")
    if degree == 1:
        return np.arange(length, dtype=np.int64)[None, :]
    outer = degree // inner
    total = padded_length(length, degree)
    pos = np.arange(total, dtype=np.int64)
    pos[pos >= length] = -1
    chunks = pos.reshape(2 * outer, inner, total // (2 * outer) // inner)  # [2*outer][inner][sub]
    out = np.empty((degree, total // degree), dtype=np.int64)  # [degree][per_lane]
    half = total // degree // 2
    for j in range(outer):
        for i in range(inner):
            lane = j * inner + i
            out[lane, :half] = chunks[j, i]
            out[lane, half:] = chunks[2 * outer - 1 - j, i]
    return out


def lane_positions(length: int, degree: int, lane: int, inner: int = 1) -> np.ndarray:
    """Positions held by one lane of the group (``[padded_length // degree]``, ``-1`` for padding)."""
    return cp_positions(length, degree, inner)[lane]


@dataclass(frozen=True, kw_only=True, slots=True)
class Microbatch:
    """This rank's share of one group of one microbatch."""

    input_ids: np.ndarray  # [T] int64
    labels: np.ndarray  # [T] int64
    position_ids: np.ndarray  # [T] int64
    cu_seqlens: np.ndarray  # [num_segments + 1] int32, over per-lane padded segment lengths
    segments: tuple[tuple[int, int, int], ...]  # [num_runs] (doc_id, start, length); doc_id -1 = padding
    seq_lengths: tuple[int, ...]  # [num_segments] the group's segment lengths, unpadded, in order
    k: int  # microbatch index in the pool's microbatch list
    pool: int  # pool index in the plan
    stage: int  # pipeline stage of this rank
    lane: int  # this rank's lane in the pool
    tp_index: int  # this rank's index in its lane's TP group
    lanes: tuple[int, ...]  # [degree] the group's lanes
    cp_rank: int  # position of this lane in the group's lanes
    cp_inner: int  # Ulysses size used for this group's layout
    has_tokens: bool = True  # False on middle pipeline stages (no tokens read)
    padding: bool = False  # a filler microbatch (one pad token, no label) that evens out counts under cp=1

    @property
    def degree(self) -> int:
        return len(self.lanes)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_valid_tokens(self) -> int:
        """Label tokens of this lane that count in the loss."""
        return int(np.count_nonzero(self.labels != IGNORE_INDEX))

    def to_hf(self) -> dict[str, Any]:
        """This microbatch in the Hugging Face transformers convention, as ``[1, T]`` torch tensors.

        * ``input_ids`` (int64): the tokens, docs packed back to back.
        * ``labels`` (int64): *unshifted*, the input ids themselves, ``-100`` at each segment's first
          token and on padding; the model shifts them (``logits[:, :-1]`` predicts ``labels[:, 1:]``),
          so no target crosses a doc boundary. ``mb.labels`` is the same targets already shifted.
        * ``position_ids`` (int64): restart at 0 in every segment, which is how transformers finds
          packed docs (a block-diagonal causal mask for sdpa/eager, varlen for flash-attention).
        * ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 ``[num_segments + 1]``) and ``max_length_q``/
          ``max_length_k`` (int): transformers' ``FlashAttentionKwargs``; ``cu_seqlens``/``max_seqlen``:
          the same under flash-attn's own names.
        * ``use_cache``: False. transformers looks for packed docs in ``position_ids`` only without a
          KV cache; with the default ``use_cache=True`` every token attends across doc boundaries.

        ``model(**mb.to_hf())`` runs the packed docs correctly (sdpa, eager, flash-attention) and
        returns transformers' mean loss over this microbatch's targets.

        A CP lane shard (``degree > 1``: this lane's share of docs spread over a group, in the CP
        layout) gives ``input_ids``, its true ``position_ids``, ``shift_labels`` = ``mb.labels`` (the
        targets shifted *before* sharding, transformers' and accelerate's name; the model then does
        not shift) and ``labels`` (the same tensor, so that the model computes a loss), ``use_cache``;
        only a model whose attention runs the group's CP engine can run it
        (``parallel_runtime.hf.enable_context_parallel``). A middle pipeline stage raises ``ValueError``.
        """
        if not self.has_tokens:
            raise ValueError(f"to_hf(): microbatch {self.k} has no tokens (middle pipeline stage {self.stage})")
        import torch  # only here: the loader itself does not need torch

        if self.degree > 1:  # a lane's tokens are not contiguous: its targets come shifted from the loader
            shifted = torch.from_numpy(self.labels.copy())[None, :]
            return {"input_ids": torch.from_numpy(self.input_ids.copy())[None, :],
                    "position_ids": torch.from_numpy(self.position_ids.copy())[None, :],
                    "labels": shifted, "shift_labels": shifted, "use_cache": False}

        labels = self.input_ids.copy()  # [T] unshifted
        labels[self.cu_seqlens[:-1].astype(np.int64)] = IGNORE_INDEX  # no target for a segment's first token
        # padding runs: their tokens are no targets either (offsets follow the runs in order)
        ends = np.cumsum([n for _, _, n in self.segments])  # [num_runs]
        for (doc, _, n), end in zip(self.segments, ends.tolist()):
            if doc < 0:
                labels[end - n:end] = IGNORE_INDEX
        cu = torch.from_numpy(self.cu_seqlens.astype(np.int32))  # [num_segments + 1]
        longest = int(np.diff(self.cu_seqlens).max()) if len(self.cu_seqlens) > 1 else 0
        return {"input_ids": torch.from_numpy(self.input_ids.copy())[None, :],
                "labels": torch.from_numpy(labels)[None, :],
                "position_ids": torch.from_numpy(self.position_ids.copy())[None, :],
                "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
                "cu_seqlens": cu, "max_seqlen": longest, "use_cache": False}

    def as_tensors(self) -> dict[str, Any]:
        """``input_ids``, ``labels``, ``position_ids`` (int64) and ``cu_seqlens`` (int32) as torch tensors."""
        import torch

        return {"input_ids": torch.from_numpy(self.input_ids), "labels": torch.from_numpy(self.labels),
                "position_ids": torch.from_numpy(self.position_ids),
                "cu_seqlens": torch.from_numpy(self.cu_seqlens)}


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlace:
    """Where a rank sits in a step plan."""

    pool: int
    stage: int
    lane: int
    tp_index: int
    pp: int


def rank_place(plan: StepPlan, rank: int) -> RankPlace:
    for pi, pool in enumerate(plan.pools):
        for s, stage_ranks in enumerate(pool.ranks):
            if rank in stage_ranks:
                idx = stage_ranks.index(rank)
                return RankPlace(pool=pi, stage=s, lane=idx // pool.tp, tp_index=idx % pool.tp, pp=pool.pp)
    raise ValueError(f"rank {rank} is in no pool of step {plan.step} (world size {plan.world_size})")


def num_valid_tokens(plan: StepPlan) -> int:
    """Global number of label tokens of a step (each segment's last token has no label)."""
    return sum(s[2] - 1 for p in plan.pools for mb in p.microbatches for g in mb for s in g.segments)


def max_microbatches(plan: StepPlan) -> int:
    """The most groups any lane of the step runs (the microbatch count every rank gets under ``cp=1``)."""
    best = 0
    for pool in plan.pools:
        counts: dict[int, int] = {}
        for mb in pool.microbatches:
            for g in mb:
                for lane in g.lanes:
                    counts[lane] = counts.get(lane, 0) + 1
        best = max(best, *counts.values()) if counts else best
    return best


def lane_runs(length: int, degree: int, cp_rank: int, inner: int = 1) -> list[tuple[int, int, bool]]:
    """One lane's share of a segment as runs ``(first position, count, real)`` of consecutive positions.

    The runs are :func:`~balanced_loader.materialize.cp_positions` of the padded segment, row
    ``cp_rank``, written analytically (no ``[degree][positions]`` matrix): the lane
    ``(j, i) = divmod(cp_rank, inner)`` holds sub-chunk ``i`` of chunks ``j`` and
    ``2*outer - 1 - j``, each ``padded_length / (2 * degree)`` positions. A run is cut where
    real tokens (position < length) turn into padding. Tests check it against ``cp_positions``.
    """
    if degree == 1:
        return [(0, length, True)]
    total = padded_length(length, degree)
    outer = degree // inner
    half = total // (2 * degree)
    chunk = inner * half
    j, i = divmod(cp_rank, inner)
    runs: list[tuple[int, int, bool]] = []
    for c in (j, 2 * outer - 1 - j):
        a = c * chunk + i * half
        real = min(max(length - a, 0), half)
        if real:
            runs.append((a, real, True))
        if real < half:
            runs.append((a + real, half - real, False))
    return runs


_IOTA = np.arange(1 << 16, dtype=np.int64)  # shared 0, 1, 2, ... for position ids (read-only use)


def _iota(n: int) -> np.ndarray:
    global _IOTA
    if len(_IOTA) < n:
        _IOTA = np.arange(max(n, 2 * len(_IOTA)), dtype=np.int64)
    return _IOTA[:n]


def _lane_arrays(offsets: list[int], source: Source | None, pad_id: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``input_ids, labels, position_ids`` (``[T]`` each, ``T = offsets[-1]``) and ``cu_seqlens`` of one lane:
    uninitialized where a source will fill them, else padding and ignored labels (middle pipeline stages)."""
    total = offsets[-1]
    if source is None:
        ids = np.full(total, pad_id, dtype=np.int64)  # [T]
        labels = np.full(total, IGNORE_INDEX, dtype=np.int64)  # [T]
    else:
        ids = np.empty(total, dtype=np.int64)
        labels = np.empty(total, dtype=np.int64)
    return ids, labels, np.empty(total, dtype=np.int64), np.array(offsets, dtype=np.int32)


def materialize_group(group: Group, lane: int, source: Source | None, *, cp_inner: int = 1, pad_id: int = 0
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """``input_ids, labels, position_ids, cu_seqlens, runs`` of one lane of a group.

    ``source=None`` reads no tokens (middle pipeline stages): ids are ``pad_id``, labels -100.
    Every position is written once (the arrays start uninitialized).
    """
    d = len(group.lanes)
    if d == 1:
        if group.lanes[0] != lane:
            raise ValueError(f"lane {lane} is not in the group of lane {group.lanes[0]}")
        return _materialize_whole(group.segments, source, pad_id)
    j = group.lanes.index(lane)
    inner = math.gcd(cp_inner, d)
    offsets = list(accumulate((padded_length(s[2], d) // d for s in group.segments), initial=0))
    ids, labels, pos_ids, cu = _lane_arrays(offsets, source, pad_id)
    runs: list[tuple[int, int, int]] = []
    for si, (doc, start, length) in enumerate(group.segments):
        o = offsets[si]
        for first, count, real in lane_runs(length, d, j, inner):
            np.add(_iota(count), first, out=pos_ids[o:o + count])
            if real:
                runs.append((doc, start + first, count))
                if source is not None:
                    stop = min(first + count + 1, length)  # one more token for the last label
                    toks = source.read(doc, start + first, stop - first)
                    ids[o:o + count] = toks[:count]
                    labels[o:o + stop - first - 1] = toks[1:]
                    if stop - first == count:  # the segment ends here: no next token
                        labels[o + count - 1] = IGNORE_INDEX
            else:
                if source is not None:
                    ids[o:o + count] = pad_id
                    labels[o:o + count] = IGNORE_INDEX
                if runs and runs[-1][0] == -1:
                    runs[-1] = (-1, 0, runs[-1][2] + count)
                else:
                    runs.append((-1, 0, count))
            o += count
    return ids, labels, pos_ids, cu, runs


def _materialize_whole(segments: tuple[Segment, ...], source: Source | None, pad_id: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """:func:`materialize_group` of a one-lane group (most groups of a step): each segment whole, in one read
    and with no padding, so no per-run bookkeeping (the same arrays as the general path, which tests check)."""
    offsets = list(accumulate((s[2] for s in segments), initial=0))
    ids, labels, pos_ids, cu = _lane_arrays(offsets, source, pad_id)
    for (doc, start, length), o in zip(segments, offsets):
        pos_ids[o:o + length] = _iota(length)
        if source is not None:
            toks = source.read(doc, start, length)
            ids[o:o + length] = toks
            labels[o:o + length - 1] = toks[1:]
            labels[o + length - 1] = IGNORE_INDEX
    return ids, labels, pos_ids, cu, list(segments)


def group_reads(group: Group, lane: int, *, cp_inner: int = 1) -> list[tuple[int, int, int]]:
    """The ``source.read(doc, start, count)`` calls :func:`materialize_group` makes for one lane, in order
    (``count`` includes the look-ahead token of the last label)."""
    d = len(group.lanes)
    j = group.lanes.index(lane)
    inner = math.gcd(cp_inner, d)
    out = []
    for doc, start, length in group.segments:
        for first, count, real in lane_runs(length, d, j, inner):
            if real:
                out.append((doc, start + first, min(first + count + 1, length) - first))
    return out


def materialize_rank(plan: StepPlan, rank: int, source: Source | None, *, cp_inner: int = 1,
                     pad_id: int = 0) -> list[Microbatch]:
    """This rank's microbatches of a step, in execution order (microbatch index ``k``)."""
    if cp_inner < 1:
        raise ValueError(f"cp_inner must be >= 1, got {cp_inner}")
    place = rank_place(plan, rank)
    pool = plan.pools[place.pool]
    reads = source is not None and place.stage in (0, place.pp - 1)
    if reads:  # announce the step's reads: a remote source fetches them concurrently, a local one ignores this
        # (lazily: a source that ignores the hint never pays for listing the reads, every step on every rank)
        source.prefetch(r for mb in pool.microbatches for g in mb if place.lane in g.lanes
                        for r in group_reads(g, place.lane, cp_inner=cp_inner))
    out: list[Microbatch] = []
    for k, mb in enumerate(pool.microbatches):
        for g in mb:
            if place.lane not in g.lanes:
                continue
            ids, labels, pos, cu, runs = materialize_group(g, place.lane, source if reads else None,
                                                           cp_inner=cp_inner, pad_id=pad_id)
            out.append(Microbatch(
                input_ids=ids, labels=labels, position_ids=pos, cu_seqlens=cu, segments=tuple(runs),
                seq_lengths=tuple(s[2] for s in g.segments), k=k, pool=place.pool, stage=place.stage,
                lane=place.lane, tp_index=place.tp_index, lanes=g.lanes, cp_rank=g.lanes.index(place.lane),
                cp_inner=math.gcd(cp_inner, len(g.lanes)), has_tokens=reads))
            break
    return out


def padding_microbatch(like: RankPlace, *, lane: int, pad_id: int = 0) -> Microbatch:
    """A filler microbatch of one pad token with no label (``padding`` True, no valid tokens).

    Under ``cp=1`` the loader appends these so every rank runs the same number of forward and
    backward passes in a step (a DDP all-reduce per pass would otherwise wait forever).
    """
    return Microbatch(input_ids=np.full(1, pad_id, dtype=np.int64), labels=np.full(1, IGNORE_INDEX, dtype=np.int64),
                      position_ids=np.zeros(1, dtype=np.int64), cu_seqlens=np.array([0, 1], dtype=np.int32),
                      segments=((-1, 0, 1),), seq_lengths=(1,), k=-1, pool=like.pool, stage=like.stage, lane=lane,
                      tp_index=like.tp_index, lanes=(lane,), cp_rank=0, cp_inner=1, padding=True)


def needed_token_count(microbatches: list[Microbatch]) -> int:
    """Real tokens in a rank's microbatches (what it must read at least)."""
    return sum(n for mb in microbatches if mb.has_tokens for doc, _, n in mb.segments if doc >= 0)
