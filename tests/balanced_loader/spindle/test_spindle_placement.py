"""Spindle placement: movement metric, node-aligned packing, pinning, local search."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.spindle.graph import graph_from_dict, load_graph
from balanced_loader.spindle.placement import moved_docs, movement, pack_aligned, place
from balanced_loader.spindle.wave_plan import batch_shards
from balanced_loader.spindle.waves import Run

F1 = Path(__file__).resolve().parents[3] / "recipes" / "spindle-f1.yaml"


def test_batch_shards_are_balanced_and_contiguous():
    assert batch_shards(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert batch_shards(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_moved_docs_counts_docs_not_already_on_their_rank():
    assert moved_docs((0, 1, 2, 3), 32, 0, 4, 32) == 0  # same ranks, same shards
    # Quarters (8 docs each) to halves on ranks 0-1: rank 0 keeps docs 0-7, rank 1 keeps none of 16-31.
    assert moved_docs((0, 1, 2, 3), 32, 0, 2, 32) == 24
    assert moved_docs((0, 1), 16, 4, 2, 16) == 16  # disjoint ranks
    # Hand-over between batches of different sizes is measured as fractions of each batch.
    assert moved_docs((6, 7), 16, 4, 4, 32) == 32 - 8  # rank 7 keeps the last quarter of 32


def _aligned(starts, sizes, gpus, node):
    taken = set()
    for s, n in zip(starts, sizes):
        r = set(range(s, s + n))
        assert not taken & r and s >= 0 and s + n <= gpus
        taken |= r
        if n <= node:
            assert s // node == (s + n - 1) // node  # inside one node
        else:
            assert s % node == 0  # whole nodes


def test_pack_aligned_places_whole_nodes_first_then_best_fit():
    sizes = [2, 16, 4, 8, 2]
    starts = pack_aligned(sizes, 32, 8)
    assert starts == [28, 0, 24, 16, 30]
    _aligned(starts, sizes, 32, 8)
    # Blocked ranks are avoided; a run that cannot fit without crossing a node boundary fails.
    assert pack_aligned([4, 2], 8, 8, blocked=[(2, 4)]) == [4, 0]
    assert pack_aligned([8], 16, 8, blocked=[(3, 4)]) == [8]
    assert pack_aligned([4, 4], 8, 8, blocked=[(2, 3)]) is None


@given(sizes=st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=10))
def test_pack_aligned_always_fits_aligned_sizes(sizes):
    gpus = 8 * max(1, -(-sum(sizes) // 8))
    starts = pack_aligned(sizes, gpus, 8)
    assert starts is not None
    _aligned(starts, sizes, gpus, 8)


def test_f1_ranks_and_handover_search():
    g = load_graph(str(F1))
    waves = [[Run(op=0, n=4, layers=4), Run(op=1, n=2, layers=6), Run(op=2, n=2, layers=4)],
             [Run(op=5, n=4, layers=8), Run(op=3, n=2, layers=8), Run(op=4, n=2, layers=8)]]
    # Spindle's behaviour: contiguous in list order, no remapping at the frontier boundary.
    ranks = place(g.metaops, waves, 8, 8)
    assert ranks == [[(0, 1, 2, 3), (4, 5), (6, 7)], [(0, 1, 2, 3), (4, 5), (6, 7)]]
    entries = [list(zip([r.op for r in w], rk)) for w, rk in zip(waves, ranks)]
    assert movement(g.metaops, entries) == 32 + 16 + 16  # every backbone reads from other ranks
    # With hand-over the search keeps B's data in place: B-bb takes B-aud's ranks 4-5.
    ranks = place(g.metaops, waves, 8, 8, handover=True)
    assert ranks[1] == [(0, 1, 2, 3), (6, 7), (4, 5)]
    entries = [list(zip([r.op for r in w], rk)) for w, rk in zip(waves, ranks)]
    assert movement(g.metaops, entries) == 32 + 0 + 16


def test_runs_keeping_their_count_stay_on_their_ranks_and_search_reduces_movement():
    ops = graph_from_dict({"gpus": 16, "gpus_per_node": 8, "metaops": [
        {"name": f"m{k}", "task": "t", "layers": 8, "batch": 16, "alpha_ms": 1.0, "beta_ms": 1.0} for k in range(4)
    ]}).metaops
    waves = [[Run(op=0, n=8, layers=2), Run(op=1, n=4, layers=2), Run(op=2, n=2, layers=2)],
             [Run(op=3, n=8, layers=2), Run(op=2, n=2, layers=2), Run(op=1, n=4, layers=2), Run(op=0, n=2, layers=2)],
             [Run(op=0, n=8, layers=4), Run(op=1, n=2, layers=4)]]
    searched = place(ops, waves, 16, 8)
    plain = place(ops, waves, 16, 8, search=False)
    assert searched[1][1] == searched[0][2] and searched[1][2] == searched[0][1]  # m2 and m1 pinned
    cost = {}
    for name, ranks in (("searched", searched), ("plain", plain)):
        for w, rk in zip(waves, ranks):
            _aligned([r[0] for r in rk], [r.n for r in w], 16, 8)
        cost[name] = movement(ops, [list(zip([r.op for r in w], rk)) for w, rk in zip(waves, ranks)])
    assert cost["searched"] <= cost["plain"]
