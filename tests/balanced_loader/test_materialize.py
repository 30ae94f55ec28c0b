"""Materialization of one rank's microbatches: layout, labels, positions, cu_seqlens, stages, TP."""

from __future__ import annotations

import numpy as np
import pytest

from balanced_loader.materialize import (
    IGNORE_INDEX,
    cp_positions,
    lane_runs,
    materialize_rank,
    needed_token_count,
    num_valid_tokens,
    padded_length,
    rank_place,
)
from balanced_loader.plan import Group, Pool, StepPlan, single_pool_ranks
from balanced_loader.wrapping import DatasetSource

RNG = np.random.default_rng(7)
DOCS = [RNG.integers(1, 50_000, size=n) for n in (37, 5, 100, 1, 64, 23, 2, 77)]
SOURCE = DatasetSource(DOCS)


def one_pool(world: int, microbatches, tp: int = 1, pp: int = 1) -> StepPlan:
    pool = Pool(tp=tp, pp=pp, ranks=single_pool_ranks(world, tp, pp),
                microbatches=tuple(tuple(Group(lanes=tuple(l), segments=tuple(s)) for l, s in mb)
                                   for mb in microbatches))
    return StepPlan(step=0, world_size=world, pools=(pool,))


def expected_lane(doc: int, start: int, length: int, d: int, j: int, inner: int = 1):
    """Reference: ids, labels, positions of lane j straight from layout.cp_positions."""
    pos = cp_positions(length, d, inner)[j]
    full = cp_positions(padded_length(length, d), d, inner)[j]
    toks = DOCS[doc][start:start + length]
    ids = np.where(pos >= 0, toks[np.maximum(pos, 0)], 0)
    nxt = np.minimum(pos + 1, length - 1)
    labels = np.where((pos >= 0) & (pos + 1 < length), toks[nxt], IGNORE_INDEX)
    return ids, labels, full


@pytest.mark.parametrize("d,inner", [(1, 1), (2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (4, 4)])
def test_cp_group_matches_layout(d, inner):
    segs = [(2, 0, 100), (0, 3, 30), (7, 0, 77)]
    plan = one_pool(8, [[(list(range(d)), segs)]])
    for j in range(d):
        (mb,) = materialize_rank(plan, j, SOURCE, cp_inner=inner)
        assert mb.lanes == tuple(range(d)) and mb.cp_rank == j and mb.cp_inner == inner
        assert mb.seq_lengths == (100, 30, 77)
        per_lane = [padded_length(s[2], d) // d for s in segs]
        assert mb.cu_seqlens.dtype == np.int32
        assert mb.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(per_lane)]).tolist()
        for si, (doc, start, length) in enumerate(segs):
            a, b = mb.cu_seqlens[si], mb.cu_seqlens[si + 1]
            ids, labels, pos = expected_lane(doc, start, length, d, j, inner)
            np.testing.assert_array_equal(mb.input_ids[a:b], ids)
            np.testing.assert_array_equal(mb.labels[a:b], labels)
            np.testing.assert_array_equal(mb.position_ids[a:b], pos)
        # the runs describe input_ids exactly
        o = 0
        for doc, start, n in mb.segments:
            if doc >= 0:
                np.testing.assert_array_equal(mb.input_ids[o:o + n], DOCS[doc][start:start + n])
            else:
                assert (mb.input_ids[o:o + n] == 0).all() and (mb.labels[o:o + n] == IGNORE_INDEX).all()
            o += n
        assert o == mb.num_tokens
        for k in ("input_ids", "labels", "position_ids"):
            assert getattr(mb, k).dtype == np.int64


def test_runs_of_all_lanes_tile_each_segment():
    for length in (1, 2, 7, 16, 33, 100):
        for d in (1, 2, 4, 8, 16):
            for inner in (1, 2, 4):
                if d % inner:
                    continue
                covered = []
                layout = cp_positions(padded_length(length, d), d, inner)  # [d][positions per lane]
                for j in range(d):
                    runs = lane_runs(length, d, j, inner)
                    pos = [p for f, c, _ in runs for p in range(f, f + c)]
                    assert pos == layout[j].tolist()  # the analytic runs are the layout
                    assert all(real == (f < length) and (f + c <= length or not real) for f, c, real in runs)
                    covered += [p for f, c, real in runs if real for p in range(f, f + c)]
                assert sorted(covered) == list(range(length))


def test_labels_end_at_every_segment_and_positions_restart():
    segs = [(0, 0, 37), (1, 0, 5), (3, 0, 1), (4, 10, 20)]
    plan = one_pool(2, [[([1], segs)]])
    assert materialize_rank(plan, 0, SOURCE) == []  # lane 0 is in no group: no microbatch
    (mb,) = materialize_rank(plan, 1, SOURCE)
    assert mb.cu_seqlens.tolist() == [0, 37, 42, 43, 63]
    ends = mb.cu_seqlens[1:] - 1
    assert (mb.labels[ends] == IGNORE_INDEX).all()
    assert mb.num_valid_tokens == sum(s[2] - 1 for s in segs) == num_valid_tokens(plan)
    assert mb.position_ids[mb.cu_seqlens[:-1]].tolist() == [0, 0, 0, 0]
    np.testing.assert_array_equal(mb.labels[:36], DOCS[0][1:37])
    np.testing.assert_array_equal(mb.input_ids[43:63], DOCS[4][10:30])
    np.testing.assert_array_equal(mb.labels[43:62], DOCS[4][11:30])  # no label beyond the segment
    assert needed_token_count([mb]) == 63


def test_microbatch_order_and_metadata():
    plan = one_pool(4, [[([0, 1], [(2, 0, 100)]), ([2], [(0, 0, 37)])],
                        [([0], [(1, 0, 5)]), ([1, 2, 3], [(4, 0, 64)])],
                        [([3, 2], [(7, 0, 77)])]])
    mbs = materialize_rank(plan, 2, SOURCE)
    assert [m.k for m in mbs] == [0, 1, 2]
    assert [m.lanes for m in mbs] == [(2,), (1, 2, 3), (3, 2)]
    assert [m.cp_rank for m in mbs] == [0, 1, 1]
    assert mbs[1].degree == 3 and mbs[1].num_tokens == padded_length(64, 3) // 3


def test_tp_and_pipeline_stages():
    segs = [(2, 0, 100), (5, 0, 23)]
    plan = one_pool(12, [[([0], segs), ([1], [(0, 0, 37)])]], tp=2, pp=3)
    # stage s holds ranks 4s..4s+3; lane l, tp index t -> 4s + 2l + t
    assert rank_place(plan, 6).stage == 1 and rank_place(plan, 6).lane == 1 and rank_place(plan, 6).tp_index == 0
    first = materialize_rank(plan, 0, SOURCE)[0]
    tp1 = materialize_rank(plan, 1, SOURCE)[0]
    middle = materialize_rank(plan, 4, SOURCE)[0]
    last = materialize_rank(plan, 9, SOURCE)[0]
    for k in ("input_ids", "labels", "position_ids", "cu_seqlens"):
        np.testing.assert_array_equal(getattr(first, k), getattr(tp1, k))
        np.testing.assert_array_equal(getattr(first, k), getattr(last, k))
    assert tp1.tp_index == 1 and last.stage == 2 and first.has_tokens and last.has_tokens
    assert not middle.has_tokens and (middle.input_ids == 0).all() and (middle.labels == IGNORE_INDEX).all()
    np.testing.assert_array_equal(middle.position_ids, first.position_ids)
    assert middle.segments == first.segments
    with pytest.raises(ValueError, match="rank 12 is in no pool"):
        materialize_rank(plan, 12, SOURCE)


def test_middle_stage_reads_no_bytes():
    src = DatasetSource(DOCS)
    plan = one_pool(3, [[([0], [(2, 0, 100)])]], pp=3)
    materialize_rank(plan, 1, src)
    assert src.bytes_read == 0
    materialize_rank(plan, 0, src)
    assert src.bytes_read == DOCS[2].nbytes


def test_as_tensors():
    torch = pytest.importorskip("torch")
    plan = one_pool(2, [[([0, 1], [(2, 0, 100)])]])
    t = materialize_rank(plan, 1, SOURCE)[0].as_tensors()
    assert t["input_ids"].dtype == torch.int64 and t["cu_seqlens"].dtype == torch.int32
    assert t["labels"].shape == t["position_ids"].shape == (50,)


def test_degree_not_multiple_of_inner_uses_gcd():
    plan = one_pool(4, [[([0, 1], [(2, 0, 100)])], [([0], [(0, 0, 37)])]])
    a, b = materialize_rank(plan, 0, SOURCE, cp_inner=4)
    assert a.cp_inner == 2 and b.cp_inner == 1
    ids, _, _ = expected_lane(2, 0, 100, 2, 0, inner=2)
    np.testing.assert_array_equal(a.input_ids, ids)


class _Recording(DatasetSource):
    """Records what materialization announces (prefetch) and then reads."""

    def __init__(self, docs):
        super().__init__(docs)
        self.announced: list[tuple[int, int, int]] = []
        self.reads: list[tuple[int, int, int]] = []

    def prefetch(self, reads):
        self.announced += reads

    def read(self, doc_id, start, length):
        self.reads.append((doc_id, start, length))
        return super().read(doc_id, start, length)


@pytest.mark.parametrize("d,inner", [(1, 1), (2, 1), (4, 2), (8, 4), (3, 1)])
def test_announced_reads_are_the_reads(d, inner):
    """materialize_rank announces exactly the reads it makes, in order (a remote source prefetches them)."""
    segs = [(2, 0, 100), (0, 3, 30), (7, 0, 77), (3, 0, 1)]
    plan = one_pool(8, [[(list(range(d)), segs)], [([d % 8], [(4, 0, 64)])]])
    for j in range(8):
        src = _Recording(DOCS)
        materialize_rank(plan, j, src, cp_inner=inner)
        assert src.announced == src.reads
