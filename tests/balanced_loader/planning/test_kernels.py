"""Every numba kernel equals its pure-Python reference (same tie-breaking), on random inputs
that include 1-token items, capacity-sized items and exact ties."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from balanced_loader.planning import kernels as K
from balanced_loader.planning import packing as P
from balanced_loader.planning.kernels.repair import repair_round_reference


@st.composite
def packing_case(draw):
    cap = draw(st.integers(1, 64))
    special = st.sampled_from([1, cap, max(1, cap // 2), max(1, cap // 3)])
    lengths = draw(st.lists(st.one_of(st.integers(1, cap), special), max_size=80))
    return np.asarray(lengths, dtype=np.int64), cap


@given(packing_case())
def test_ffd_equals_reference(case):
    lengths, cap = case
    bins, nb = P.ffd(lengths, cap)
    ref, rnb = P.ffd_reference(lengths, cap)
    assert nb == rnb
    assert np.array_equal(bins, ref)
    if len(lengths):
        assert np.bincount(bins, weights=lengths).max() <= cap


@given(packing_case())
def test_bfd_equals_reference(case):
    lengths, cap = case
    bins, nb = P.bfd(lengths, cap)
    ref, rnb = P.bfd_reference(lengths, cap)
    assert nb == rnb
    assert np.array_equal(bins, ref)


@given(packing_case(), st.integers(0, 9), st.booleans(), st.randoms(use_true_random=False))
def test_cost_pack_equals_reference(case, num_bins, integral, rnd):
    tokens, cap = case
    work = np.asarray([rnd.random() * 10 for _ in tokens])
    if integral:
        work = np.round(work)  # many exact ties
    load = np.asarray([float(rnd.randint(0, 5)) for _ in range(num_bins)])
    room = np.asarray([rnd.randint(0, cap) for _ in range(num_bins)], dtype=np.int64)
    got = P.cost_pack(tokens, work, num_bins, cap, load, room)
    ref = P.cost_pack_reference(tokens, work, num_bins, cap, load, room)
    assert np.array_equal(got.bins, ref.bins)
    assert np.array_equal(got.room, ref.room)
    assert np.allclose(got.load, ref.load)
    assert (got.room >= 0).all()


@st.composite
def block_case(draw):
    lanes = draw(st.integers(1, 20))
    nlev = lanes.bit_length()
    n = draw(st.integers(0, 25))
    vals = st.one_of(st.integers(0, 9).map(float), st.floats(0, 10), st.just(np.inf))
    times = np.asarray(draw(st.lists(st.lists(vals, min_size=nlev, max_size=nlev), min_size=n, max_size=n)),
                       dtype=np.float64).reshape(n, nlev)
    pref = np.asarray(draw(st.lists(st.integers(0, nlev - 1), min_size=n, max_size=n)), dtype=np.int64)
    load = np.asarray(draw(st.lists(st.integers(0, 4).map(float), min_size=lanes, max_size=lanes)))
    target = draw(st.sampled_from([np.inf, 5.0, 12.0]))
    return times, pref, lanes, load, target


@given(block_case(), st.booleans())
def test_block_place_equals_reference(case, smallest):
    times, pref, lanes, load, target = case
    got = P.block_place(times, pref, lanes, load, target=target, smallest=smallest)
    ref = P.block_place_reference(times, pref, lanes, load, target=target, smallest=smallest)
    for name in got._fields:
        assert np.array_equal(getattr(got, name), getattr(ref, name)), name
    placed = got.level >= 0
    # every placed item sits on an aligned block inside the lanes, at or above its preferred level
    width = np.left_shift(1, got.level[placed])
    assert (got.lane[placed] % width == 0).all()
    assert (got.lane[placed] + width <= lanes).all()
    assert (got.level[placed] >= pref[placed]).all()


@given(packing_case(), st.integers(1, 12), st.sampled_from([0.0, 1.0, 3.0]), st.randoms(use_true_random=False))
def test_fill_passes_equals_reference(case, lanes, beta, rnd):
    tokens, cap = case
    work = np.asarray([float(rnd.randint(0, 9)) for _ in tokens])
    load = np.asarray([float(rnd.randint(0, 5)) for _ in range(lanes)])
    got = P.fill_passes(tokens, work, load, cap, beta)
    ref = P.fill_passes_reference(tokens, work, load, cap, beta)
    for name in got._fields:
        assert np.array_equal(getattr(got, name), getattr(ref, name)), name
    if len(tokens):  # no pass over the token cap
        key = got.lane * (int(got.passes.max()) + 1) + got.pass_
        assert np.bincount(key, weights=tokens).max() <= cap


@given(st.integers(9, 700), st.integers(0, 400), st.sampled_from([0.0, 2.0]), st.integers(0, 2**32 - 1))
def test_fill_passes_on_many_lanes_equals_reference(lanes, n, beta, seed):
    # more lanes than one node of the kernel's 8-ary tree holds (2 to 4 levels), with equal loads (ties)
    rng = np.random.default_rng(seed)
    tokens = np.sort(rng.integers(1, 33, n))[::-1].copy()
    work = rng.integers(0, 4, n).astype(np.float64)
    load = rng.integers(0, 3, lanes).astype(np.float64)
    got = P.fill_passes(tokens, work, load, 32, beta)
    ref = P.fill_passes_reference(tokens, work, load, 32, beta)
    for name in got._fields:
        assert np.array_equal(getattr(got, name), getattr(ref, name)), name


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 5)), max_size=80), st.booleans())
def test_order_by_pair_is_a_stable_sort_by_both_keys(pairs, huge):
    major = np.asarray([a for a, _ in pairs], dtype=np.int64)
    minor = np.asarray([b for _, b in pairs], dtype=np.int64)
    if huge and len(pairs):
        major = major * 10**9 - 7  # above the counting-sort range: the merge sort path
    want = sorted(range(len(pairs)), key=lambda i: (major[i], minor[i], i))
    assert K.order_by_pair(major, minor).tolist() == want


@given(st.lists(st.one_of(st.integers(0, 6).map(float), st.floats(0, 100)), max_size=60), st.integers(1, 9))
def test_karmarkar_karp_equals_reference(work, k):
    w = np.asarray(work, dtype=np.float64)
    assert np.array_equal(P.karmarkar_karp(w, k), P.karmarkar_karp_reference(w, k))


@given(st.lists(st.integers(0, 50), max_size=60), st.booleans())
def test_order_desc_is_a_stable_descending_sort(values, huge):
    arr = np.asarray(values, dtype=np.int64)
    if huge and len(arr):
        arr = arr * 10**9  # above the counting-sort range: the merge sort path
    assert K.order_desc(arr).tolist() == sorted(range(len(arr)), key=lambda i: (-arr[i], i))
    assert np.array_equal(K.argsort_stable(arr.astype(np.float64)), np.argsort(arr, kind="stable"))


@st.composite
def packing_to_repair(draw):
    """A valid packing (FFD, or next fit in a random order: loose bins) and a pool size."""
    lengths, cap = draw(packing_case())
    rnd = draw(st.randoms(use_true_random=False))
    if draw(st.booleans()):
        bins, nb = P.ffd(lengths, cap)
    else:
        order = list(range(len(lengths)))
        rnd.shuffle(order)
        bins = np.zeros(len(lengths), dtype=np.int64)
        nb, room = 0, 0
        for i in order:
            if lengths[i] > room:
                nb, room = nb + 1, cap
            bins[i] = nb - 1
            room -= int(lengths[i])
    return lengths, cap, bins, nb, draw(st.integers(1, 6))


@given(packing_to_repair())
def test_repair_round_equals_reference(case):
    lengths, cap, bins, nb, pool = case
    got, gnb = K.repair_round(lengths, bins, nb, cap, pool)
    ref, rnb = repair_round_reference(lengths, bins, nb, cap, pool)
    assert gnb == rnb and np.array_equal(got, ref)
    assert gnb <= nb
    if len(lengths):  # a packing again: bins 0..gnb-1, none empty, none over the capacity
        fill = np.bincount(got, weights=lengths)
        assert len(fill) == gnb and (fill > 0).all() and fill.max() <= cap


@given(st.integers(0, 10**6), st.integers(1, 9), st.integers(2, 60), st.sampled_from([0.0, 2.0, 30.0]))
def test_polish_tail_equals_reference_and_never_lengthens_a_lane(seed, lanes, n, beta):
    from balanced_loader.planning.kernels.polish import polish_tail_kernel, polish_tail_reference

    rng = np.random.default_rng(seed)
    cap = 100
    tok = rng.integers(1, cap + 1, n).astype(np.int64)
    work = tok * rng.uniform(0.5, 2.0, n)
    lane = rng.integers(0, lanes, n).astype(np.int64)
    pas = np.arange(n, dtype=np.int64)  # one pass per doc: always within the cap
    base = rng.uniform(0, 50, lanes)
    got = polish_tail_kernel(tok, work, lane, pas, base, beta, cap, 64)
    ref = polish_tail_reference(tok, work, lane, pas, base, beta, cap, 64)
    assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])

    def finish(lane_of, pass_of):
        out = base.copy()
        for p in np.unique(pass_of):
            mine = pass_of == p
            assert len(set(lane_of[mine].tolist())) == 1 and tok[mine].sum() <= cap
            out[lane_of[mine][0]] += beta + work[mine].sum()
        return out

    assert finish(*got).max() <= finish(lane, pas).max() + 1e-9


@given(st.integers(0, 10**6), st.integers(1, 40), st.integers(1, 4), st.sampled_from([0.0, 3.0]))
def test_target_groups_equals_reference(seed, n, nlev, beta):
    from balanced_loader.planning.kernels.place import target_groups_kernel, target_groups_reference

    rng = np.random.default_rng(seed)
    tokens = np.sort(rng.integers(1, 400, n))[::-1].astype(np.int64)
    seg = tokens[:, None] / (1 << np.arange(nlev))[None, :] * rng.uniform(0.5, 1.5)
    fit = np.minimum(-(-tokens // 100) - 1, nlev - 1).clip(0).astype(np.int64)
    target = float(rng.uniform(1, 600))
    got = target_groups_kernel(tokens, seg, fit, beta, 100, target)
    ref = target_groups_reference(tokens, seg, fit, beta, 100, target)
    for a, b in zip(got, ref):
        assert np.allclose(a, b)
    sizes = np.bincount(got[0], weights=tokens)
    assert (sizes <= 100 << got[1]).all() or n == 1 or fit.max() == nlev - 1  # within each group's lanes


@given(st.integers(0, 10**6), st.sampled_from([1, 2, 4, 8]), st.integers(2, 40), st.sampled_from([0.0, 2.0, 30.0]),
       st.sampled_from([1 << 6, 1 << 12, 1 << 20]))
def test_polish_groups_equals_reference_and_never_lengthens_the_step(seed, lanes, n, beta, budget):
    from balanced_loader.planning.kernels.evaluate import items_step_ms_reference
    from balanced_loader.planning.kernels.polish import polish_groups_kernel, polish_groups_reference

    rng = np.random.default_rng(seed)
    cap = 100
    levels = lanes.bit_length()
    tok = np.minimum(rng.integers(1, 2 * cap + 1, n), cap << (levels - 1)).astype(np.int64)  # each fits all lanes
    width = np.left_shift(1, np.arange(levels)).astype(np.float64)
    seg = tok[:, None] * rng.uniform(0.5, 2.0, n)[:, None] / width[None, :] + rng.uniform(0, 3) * tok[:, None]
    seg[tok[:, None] > cap * width[None, :]] = np.inf
    # groups in contract-2 order: microbatch k, aligned blocks of random levels that hold their docs
    gl0, gdeg, item_g = [], [], np.empty(n, np.int64)
    lane, room = 0, 0
    for i in range(n):
        lv = int(rng.integers(int(np.ceil(np.log2(-(-tok[i] // cap)))), levels))
        if not gl0 or rng.random() < 0.6 or gdeg[-1] != 1 << lv or tok[i] > room:  # a new group, next block
            lane = -(-lane // (1 << lv)) * (1 << lv)
            if lane + (1 << lv) > lanes:  # the next microbatch
                lane = 0
            gl0.append(lane)
            gdeg.append(1 << lv)
            lane += 1 << lv
            room = cap << lv
        item_g[i] = len(gl0) - 1
        room -= tok[i]
    gl0, gdeg = np.asarray(gl0, np.int64), np.asarray(gdeg, np.int64)
    glev = np.log2(gdeg).astype(np.int64)
    got = polish_groups_kernel(gl0, gdeg, glev, item_g, tok, seg, beta, cap, lanes, budget)
    ref = polish_groups_reference(gl0, gdeg, glev, item_g, tok, seg, beta, cap, lanes, budget)
    assert np.array_equal(got, ref)

    def step(groups):  # the plan as items: a group's docs share its (order, first lane)
        order = np.arange(len(gl0))
        s = seg[np.arange(n), glev[groups]]
        return items_step_ms_reference(order[groups], gl0[groups], gdeg[groups], s, beta, 1, lanes)

    assert (np.bincount(got, weights=tok, minlength=len(gl0)) <= gdeg * cap).all()  # every group within its cap
    assert step(got) <= step(item_g) + 1e-9
