"""The lead's batching functions: long/empty docs, epoch order, token-budget bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.data.batching import DocStats, batch_bounds, epoch_order, to_items


@given(st.lists(st.integers(0, 100), max_size=50), st.integers(1, 40))
def test_split_tiles_every_doc(lengths, max_len):
    ids = np.arange(len(lengths)) * 10
    items, stats = to_items(np.array(lengths, dtype=np.int64), ids, max_len, "split")
    assert stats.empty == lengths.count(0) and stats.tokens == sum(lengths)
    assert stats.split == sum(n > max_len for n in lengths)
    assert (items.lengths <= max_len).all() and (items.lengths > 0).all()
    for i, n in enumerate(lengths):
        sel = items.doc_ids == ids[i]
        assert items.lengths[sel].sum() == n
        assert (items.starts[sel] == np.arange(sel.sum()) * max_len).all()


def test_truncate_drop_error():
    lengths, ids = np.array([5, 30, 0, 12]), np.array([3, 1, 2, 0])
    it, st_ = to_items(lengths, ids, 10, "truncate")
    assert it.lengths.tolist() == [5, 10, 10] and st_ == DocStats(docs=3, tokens=25, empty=1, truncated=2,
                                                                    tokens_cut=22)
    it, st_ = to_items(lengths, ids, 10, "drop")
    assert it.doc_ids.tolist() == [3] and st_.dropped == 2 and st_.tokens_cut == 42
    with pytest.raises(ValueError, match="doc 1 has 30 tokens, over the context limit 10"):
        to_items(lengths, ids, 10, "error")
    with pytest.raises(ValueError, match="long_docs must be one of"):
        to_items(lengths, ids, 10, "cut")
    assert (DocStats(docs=1) + DocStats(docs=2, empty=1)).to_json()["docs"] == 3


def test_epoch_order_is_a_pure_function():
    a = epoch_order(1000, seed=1, epoch=0)
    assert sorted(a.tolist()) == list(range(1000))
    assert (a == epoch_order(1000, seed=1, epoch=0)).all() and not (a == epoch_order(1000, seed=1, epoch=1)).all()
    assert (epoch_order(10, seed=1, epoch=0, shuffle=False) == np.arange(10)).all()


def test_epoch_order_with_shards_stays_in_windows():
    bounds = np.array([0, 100, 250, 300, 420])
    o = epoch_order(420, seed=3, epoch=2, shard_bounds=bounds, window=50)
    assert sorted(o.tolist()) == list(range(420))
    shard = np.searchsorted(bounds, o, side="right") - 1
    for a in range(0, 420, 50):  # a window spans at most two shards (windows smaller than shards)
        assert len(set(shard[a:a + 50].tolist())) <= 3


@given(st.lists(st.integers(1, 50), max_size=60), st.integers(1, 120))
def test_batch_bounds(lengths, budget):
    b = batch_bounds(np.array(lengths, dtype=np.int64), budget)
    assert b[0] == 0 and b[-1] == len(lengths) and (np.diff(b) > 0).all()
    for i in range(len(b) - 1):
        chunk = lengths[b[i]:b[i + 1]]
        assert sum(chunk) <= budget or len(chunk) == 1
        if i + 1 < len(b) - 1:  # a batch closes only when the next item would not fit
            assert sum(chunk) + lengths[b[i + 1]] > budget
    assert batch_bounds(np.array([3, 4]), None).tolist() == [0, 2]
