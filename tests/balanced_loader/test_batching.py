"""Batching: long/empty docs, the lazy epoch order, sequences as units, token-budget steps cut as they are consumed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.batches.items import DocStats, batch_bounds, to_items
from balanced_loader.batches.order import EpochOrder, FeistelPermutation, epoch_order
from balanced_loader.batches.sequences import UNIT_TAG
from balanced_loader.batches.stream import LengthArray, global_batches, stream_for
from balanced_loader.data.lengths import read_lengths
from balanced_loader.schedule import schedule


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


def _mix_ref(x, key):
    """splitmix64's finalizer in numpy (uint64 arrays wrap): the reference of the numba kernel."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def feistel_ref(f, pos, inverse=False):
    """The Feistel walk in plain numpy, round by round and walk by walk."""
    h, mask = np.uint64(f.half), np.uint64((1 << f.half) - 1)

    def step(x):
        left, right = x >> h, x & mask
        if inverse:
            for k in f.keys[::-1]:
                left, right = right ^ (_mix_ref(left, k) & mask), left
        else:
            for k in f.keys:
                left, right = right, left ^ (_mix_ref(right, k) & mask)
        return (left << h) | right

    y = step(np.asarray(pos, dtype=np.uint64))
    bad = np.flatnonzero(y >= f.n)
    while bad.size:
        y[bad] = step(y[bad])
        bad = bad[y[bad] >= f.n]
    return y.astype(np.int64)


@given(st.integers(1, 3000), st.integers(0, 2**31), st.booleans())
def test_feistel_kernel_equals_the_numpy_reference(n, key, inverse):
    f = FeistelPermutation(n, [key, 3])
    pos = np.arange(n, dtype=np.int64)[::-1]
    got = f.inverse(pos) if inverse else f(pos)
    with np.errstate(over="ignore"):
        assert np.array_equal(got, feistel_ref(f, pos, inverse))


@given(st.integers(1, 3000), st.integers(0, 2**31))
def test_feistel_is_a_bijection_with_its_inverse(n, key):
    f = FeistelPermutation(n, [key, 7])
    p = f(np.arange(n))
    assert sorted(p.tolist()) == list(range(n))
    assert (f.inverse(p) == np.arange(n)).all()
    assert (f(np.arange(n)[::-1]) == p[::-1]).all()  # any positions, any order


@given(n=st.integers(0, 3000), window=st.integers(1, 700), seed=st.integers(0, 5), shards=st.booleans(),
       cuts=st.lists(st.integers(0, 3000), max_size=6))
def test_epoch_order_is_lazy_and_consistent(n, window, seed, shards, cuts):
    bounds = np.unique(np.concatenate([[0, n], np.linspace(0, n, 7).astype(np.int64)])) if shards else None
    order = EpochOrder(n, seed=seed, epoch=1, window=window, shard_bounds=bounds)
    whole = order.docs(0, n)
    assert sorted(whole.tolist()) == list(range(n))
    edges = sorted({0, n, *(min(c, n) for c in cuts)})
    fresh = EpochOrder(n, seed=seed, epoch=1, window=window, shard_bounds=bounds)  # random access, any order
    parts = [fresh.docs(a, b) for a, b in reversed(list(zip(edges, edges[1:])))][::-1]
    assert np.array_equal(np.concatenate(parts) if parts else whole, whole)
    # a window draws from about window / block runs of the file: +1 as windows and runs need not align,
    # +1 for the one short run (the file's tail), which may land inside any window
    if not shards and n > window:
        block = max(1, window // 16)
        for a in range(0, n, window):
            assert len(np.unique(whole[a:a + window] // block)) <= -(-window // block) + 2


def reference_units(lengths, *, seed, epoch, shuffle, window, piece, mode):
    """Every unit of one epoch in reading order, whole-array (the streamed reader reads them lazily)."""
    n = len(lengths)
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle, window=window)
    out = []
    for w in range(-(-n // window)):
        units = []
        for d in order[w * window:(w + 1) * window].tolist():
            ln = int(lengths[d])
            if mode == "split" and piece is not None:
                units += [(d, j * piece, min(piece, ln - j * piece), ln) for j in range(max(1, -(-ln // piece)))]
            else:
                units.append((d, 0, ln, ln))
        if shuffle and len(units) > len(order[w * window:(w + 1) * window]):
            perm = FeistelPermutation(len(units), [seed, epoch, w, UNIT_TAG])(np.arange(len(units)))
            units = [units[q] for q in perm.tolist()]
        out += units
    return out


def reference_batches(lengths, *, seed, shuffle, window, max_len, mode, budget):
    """The whole-array way: every unit of the epoch, the long-doc rule, then greedy bounds."""
    units = reference_units(lengths, seed=seed, epoch=0, shuffle=shuffle, window=window, piece=max_len, mode=mode)
    seqs = []
    for d, a, n, full in units:
        if mode == "truncate":
            n = min(n, max_len)
        elif mode == "drop" and full > max_len:
            n = 0
        seqs.append((d, a, n))
    tok = np.asarray([x[2] for x in seqs], dtype=np.int64)
    b = batch_bounds(tok, budget)
    out = [[x for x in seqs[b[i]:b[i + 1]] if x[2]] for i in range(len(b) - 1)]
    return [x for x in out if x]


@given(lengths=st.lists(st.integers(0, 400), max_size=150), budget=st.integers(500, 2000) | st.none(),
       max_len=st.integers(10, 500), mode=st.sampled_from(["split", "truncate", "drop"]),
       window=st.integers(1, 100), seed=st.integers(0, 3), shuffle=st.booleans())
def test_streamed_batches_equal_the_whole_array_cut(lengths, budget, max_len, mode, window, seed, shuffle):
    ln = np.asarray(lengths, dtype=np.int64)
    ref = reference_batches(ln, seed=seed, shuffle=shuffle, window=window, max_len=max_len, mode=mode,
                            budget=budget)
    got, stats = global_batches(ln, max_seq_len=max_len, long_docs=mode, global_batch_tokens=budget,
                                shuffle=shuffle, seed=seed, window=window)
    assert [list(zip(b.doc_ids.tolist(), b.starts.tolist(), b.lengths.tolist())) for b in got] == ref
    _, want = to_items(ln, np.arange(len(ln)), max_len, mode)
    assert stats == want  # every doc counted once, where its first sequence is
    sizes = [int(b.lengths.sum()) for b in got]
    if budget is not None:  # the step-size promise: [B - L, B], the last one excepted
        assert all(budget - max_len <= x <= budget for x in sizes[:-1]) and all(x <= budget for x in sizes)


@given(lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=60), window=st.integers(1, 50),
       seed=st.integers(0, 3), shuffle=st.booleans(), points=st.lists(st.integers(8, 400), min_size=1, max_size=3),
       budgets=st.lists(st.integers(400, 3000), min_size=1, max_size=3))
def test_schedules_of_max_seq_len_and_budget_tile_every_doc_once_in_steps_of_their_size(lengths, window, seed, shuffle,
                                                                                      points, budgets):
    """Under a schedule, pieces of the largest limit are read as sequences of each step's limit, and every
    step but the run's last holds between its budget minus its limit and its budget."""
    ln = np.asarray(lengths, dtype=np.int64)
    limit = schedule([(3 * i, v) for i, v in enumerate(points)], "max_seq_len")
    budget = schedule([(2 * i + 1, v) for i, v in enumerate(budgets)], "global_batch_tokens")
    st_ = stream_for(LengthArray(lengths=ln, shard_bounds=None), seed=seed, shuffle=shuffle, window=window,
                     max_seq_len=limit, global_batch_tokens=budget, long_docs="split", epochs=1)
    cur, cov = st_.epoch_start(0), {}
    for _ in range(10_000):
        c = st_.cut(cur)
        L, B = limit.at(cur.step), budget.at(cur.step)
        assert (c.items.lengths <= L).all() and c.tokens <= B
        if c.end.epoch == 0:
            assert c.tokens >= B - L
        for d, a, n in zip(c.items.doc_ids.tolist(), c.items.starts.tolist(), c.items.lengths.tolist()):
            cov.setdefault(d, []).append((a, n))
        if c.end.epoch:
            break
        cur = c.end
    for d, n in enumerate(lengths):
        pos = 0
        for a, k in sorted(cov.get(d, [])):
            assert a == pos
            pos += k
        assert pos == n


def test_shuffling_spreads_a_long_doc_over_the_epoch():
    ln = np.concatenate([np.full(2000, 700), [400 * 256]])  # one doc of 400 pieces among 2,000 short docs
    kw = dict(max_seq_len=256, global_batch_tokens=4096, seed=3)
    plain, _ = global_batches(ln, shuffle=False, **kw)
    mixed, _ = global_batches(ln, shuffle=True, **kw)

    def worst(batches):
        return max(float(b.lengths[b.doc_ids == 2000].sum()) / b.lengths.sum() for b in batches)

    assert worst(plain) == 1.0  # unshuffled: the long doc's pieces are consecutive (25 steps of it alone)
    assert worst(mixed) < 0.5  # shuffled: its pieces spread like docs (it is 7% of the tokens)
    steps = [i for i, b in enumerate(mixed) if (b.doc_ids == 2000).any()]
    assert len(steps) > 0.5 * len(mixed)


def test_a_doc_longer_than_the_budget_without_a_limit_is_a_step_of_its_own():
    got, _ = global_batches(np.asarray([5, 0, 50, 3]), max_seq_len=None, global_batch_tokens=10)
    assert [b.lengths.tolist() for b in got] == [[5], [50], [3]]


class CountingLengths(np.ndarray):
    """A length array that counts the docs read from it (to check reads stay bounded)."""

    read = 0

    def __getitem__(self, index):
        CountingLengths.read += int(np.size(index)) if isinstance(index, np.ndarray) else 1
        return super().__getitem__(index)


def test_first_batches_read_a_bounded_number_of_docs():
    n = 4_000_000
    lengths = np.full(n, 1000, dtype=np.int64).view(CountingLengths)
    CountingLengths.read = 0
    batches, stats = global_batches(lengths, max_seq_len=None, global_batch_tokens=1_000_000, shuffle=True,
                                    seed=1, max_steps=3)
    assert [len(b) for b in batches] == [1000] * 3 and stats.docs == 3000
    assert CountingLengths.read <= 1 << 16  # one shuffle window's lengths (its units), not the 4M docs
    ids = np.concatenate([b.doc_ids for b in batches])
    assert len(np.unique(ids)) == 3000 and ids.max() > n // 2  # shuffled over the whole file


def test_memory_mapped_npy_gives_the_same_batches_and_checks_lazily(tmp_path):
    ln = np.random.default_rng(5).integers(1, 900, 20_000)
    np.save(tmp_path / "l.npy", ln)
    mapped = read_lengths(tmp_path / "l.npy", check=False)
    assert isinstance(mapped, np.memmap) and not mapped.flags.writeable
    kw = {"max_seq_len": 512, "global_batch_tokens": 30_000, "shuffle": True, "seed": 2, "window": 4096}
    a, sa = global_batches(mapped, **kw)
    b, sb = global_batches(ln, **kw)
    assert sa == sb and all(np.array_equal(x.doc_ids, y.doc_ids) for x, y in zip(a, b)) and len(a) == len(b)
    bad = ln.copy()
    bad[17] = 0
    np.save(tmp_path / "z.npy", bad)
    zero = read_lengths(tmp_path / "z.npy", check=False)
    with pytest.raises(ValueError, match="doc 17 has length 0"):  # the CLI adds the file line
        global_batches(zero, max_seq_len=None, empty_docs="error")
    bad[17] = -3
    np.save(tmp_path / "n.npy", bad)
    with pytest.raises(ValueError, match="doc 17 has a negative length -3"):
        global_batches(read_lengths(tmp_path / "n.npy", check=False), max_seq_len=None)
    with pytest.raises(ValueError, match="doc 17 has a negative length -3"):
        read_lengths(tmp_path / "n.npy")  # the default checks the whole file at once
