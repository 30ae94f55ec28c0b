"""BalancedLoader: exactly-once delivery, equal step counts, valid plans, long/empty docs, prefetch."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from balanced_loader.build.writer import write_shards
from balanced_loader.cost import CostModel
from balanced_loader.loader import BalancedLoader, default_max_seq_len
from balanced_loader.materialize import IGNORE_INDEX
from balanced_loader.planning.config import PlanConfig
from balanced_loader.wrapping import DatasetSource


def small_cost(cap: int) -> CostModel:
    return CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                                "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0, 16: 1.0},
                                "max_tokens_per_lane": cap})


def make_docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 65_000, size=int(n)).astype(np.uint16) for n in lengths]


def pow2_divisor(n: int) -> int:
    return n & -n


def run_epochs(docs, world, budget, cap, *, epochs=1, seed=0, max_seq_len=None, long_docs="split",
               source=None, check_ranks=None, **kw):
    """Iterate rank 0's loader, materialize every rank of every plan, and check the step invariants."""
    source = source or DatasetSource(docs)
    cost = small_cost(cap)
    make = lambda r: BalancedLoader(source, policy="greedy", cost=cost, world_size=world, rank=r,  # noqa: E731
                                    global_batch_tokens=budget, seed=seed, epochs=epochs,
                                    max_seq_len=max_seq_len, long_docs=long_docs, validate=True, **kw)
    loader = make(0)
    others = [make(r) for r in sorted(set(check_ranks or [world - 1]) - {0})]
    total = len(loader)
    assert all(len(o) == total for o in others)
    delivered: dict[tuple[int, int], list[tuple[int, int]]] = {}
    n = 0
    for batch in loader:
        n += 1
        for o in others:
            ob = next(o)
            assert ob.plan.fingerprint() == batch.plan.fingerprint()
            assert (ob.step, ob.epoch, ob.step_in_epoch) == (batch.step, batch.epoch, batch.step_in_epoch)
            assert [m.input_ids.tolist() for m in ob.microbatches] == \
                [m.input_ids.tolist() for m in loader.microbatches(batch.plan, ob.rank)]
        valid = 0
        for r in range(world):
            mbs = batch.microbatches if r == 0 else loader.microbatches(batch.plan, r)
            for mb in mbs:
                valid += mb.num_valid_tokens
                o = 0
                for doc, start, length in mb.segments:
                    if doc >= 0:
                        got = mb.input_ids[o:o + length]
                        assert np.array_equal(got, source.tokens(doc)[start:start + length])
                        delivered.setdefault((batch.epoch, doc), []).append((start, length))
                    else:
                        assert (mb.labels[o:o + length] == IGNORE_INDEX).all()
                    o += length
                assert o == mb.num_tokens
        assert valid == batch.num_valid_tokens
    assert n == total
    for o in others:
        with pytest.raises(StopIteration):
            next(o)
    return loader, delivered


@settings(max_examples=max(100, settings.default.max_examples))
@given(lengths=st.lists(st.integers(0, 400), min_size=1, max_size=60),
       world=st.integers(1, 64), budget=st.integers(1, 3000), cap=st.integers(8, 200),
       seed=st.integers(0, 3), cp_inner=st.sampled_from([1, 2, 4]))
def test_every_doc_exactly_once_equal_steps(lengths, world, budget, cap, seed, cp_inner):
    assume(sum(lengths) > 0)
    docs = make_docs(lengths, seed)
    # greedy places a group of d lanes on an aligned block, so d must divide the lane count
    max_seq_len = cap * pow2_divisor(world)
    budget = max(budget, max_seq_len)  # a step holds one sequence at least (smaller is refused)
    loader, delivered = run_epochs(docs, world, budget, cap, epochs=2, seed=seed, max_seq_len=max_seq_len,
                                   check_ranks=[world // 2, world - 1], cp_inner=cp_inner)
    for doc, n in enumerate(lengths):  # two epochs: every token exactly twice (a step may span two passes)
        cover = np.zeros(n, dtype=np.int64)
        for epoch in range(2):
            for start, length in delivered.get((epoch, doc), []):
                assert length <= max_seq_len
                cover[start:start + length] += 1
        assert (cover == 2).all()
    stats = loader.epoch_stats(0) + loader.epoch_stats(1)  # each doc counted where its first sequence is
    assert stats.empty == 2 * lengths.count(0)
    assert stats.split == 2 * sum(n > max_seq_len for n in lengths)
    assert stats.tokens == 2 * sum(lengths)


def test_shard_source_end_to_end(tmp_path):
    lengths = [0, 5, 900, 17, 3000, 1, 64, 2048, 333, 0, 77] * 3
    docs = make_docs(lengths, 3)
    src = write_shards(docs, str(tmp_path), max_shard_bytes=4000)
    assert len(src.shard_bounds) > 4
    _, delivered = run_epochs(docs, 8, 4096, 256, source=src, check_ranks=[3, 7])
    assert sum(length for v in delivered.values() for _, length in v) == sum(lengths)
    assert src.bytes_read > 0


@pytest.mark.parametrize("mode", ["split", "truncate", "drop"])
def test_long_doc_modes(mode, caplog):
    lengths = [10, 500, 0, 30, 1200, 0, 7]
    docs = make_docs(lengths)
    with caplog.at_level(logging.WARNING, logger="balanced_loader"):
        loader, delivered = run_epochs(docs, 4, 1000, 100, max_seq_len=256, long_docs=mode)
    stats = loader.epoch_stats(0)
    assert stats.empty == 2
    got = {doc: sum(n for _, n in v) for (_, doc), v in delivered.items()}
    if mode == "split":
        assert stats.split == 2 and got == {0: 10, 1: 500, 3: 30, 4: 1200, 6: 7}
    elif mode == "truncate":
        assert stats.truncated == 2 and stats.tokens_cut == 500 + 1200 - 512
        assert got == {0: 10, 1: 256, 3: 30, 4: 256, 6: 7}
    else:
        assert stats.dropped == 2 and stats.tokens_cut == 1700 and got == {0: 10, 3: 30, 6: 7}
    assert "epoch 0" in caplog.text and "empty 2" in caplog.text  # counts are reported, never silent


def test_long_docs_error_names_the_doc():
    with pytest.raises(ValueError, match="doc 1 has 500 tokens"):
        BalancedLoader(DatasetSource(make_docs([10, 500])), policy="greedy", cost=small_cost(100), world_size=2,
                       global_batch_tokens=1000, max_seq_len=256, long_docs="error")


def test_the_pieces_of_a_split_doc_fill_steps_like_docs():
    # sequences are the unit of a step: a long doc's pieces go to whichever steps have room
    lengths = [50, 1000, 60]
    loader = BalancedLoader(DatasetSource(make_docs(lengths)), policy="greedy", cost=small_cost(100),
                            world_size=4, global_batch_tokens=600, max_seq_len=300, validate=True, shuffle=False)
    steps = [sorted(s for p in b.plan.pools for mb in p.microbatches for g in mb for s in g.segments)
             for b in loader]
    assert [[(d, a, n) for d, a, n in s] for s in steps] == [
        [(0, 0, 50), (1, 0, 300)], [(1, 300, 300), (1, 600, 300)], [(1, 900, 100), (2, 0, 60)]]


def test_prefetch_modes_give_identical_batches():
    docs = make_docs(np.random.default_rng(1).integers(1, 700, size=80))
    src = DatasetSource(docs)

    def collect(**kw):
        ld = BalancedLoader(src, policy="greedy", cost=small_cost(128), world_size=8, rank=5,
                            global_batch_tokens=2000, seed=4, **kw)
        return [(b.plan.fingerprint(), [m.input_ids.tobytes() for m in b.microbatches]) for b in ld]

    ref = collect(prefetch_steps=0)
    assert collect(prefetch_steps=3) == ref
    assert collect(prefetch_steps=1, planner_workers=1) == ref


def test_endless_iteration_and_epochs():
    src = DatasetSource(make_docs([100, 200, 300, 400]))
    ld = BalancedLoader(src, policy="greedy", cost=small_cost(512), world_size=2, global_batch_tokens=500,
                        epochs=None)
    with pytest.raises(TypeError):
        len(ld)
    seen = [(b.epoch, b.step_in_epoch, b.step) for _, b in zip(range(20), ld)]
    assert [s for _, _, s in seen] == list(range(20))
    assert max(e for e, _, _ in seen) >= 5
    per_epoch = ld.steps_in_epoch(0)
    assert seen[per_epoch][:2] == (1, 0)
    ld.close()
    two = BalancedLoader(src, policy="greedy", cost=small_cost(512), world_size=2, global_batch_tokens=500,
                         epochs=2)
    assert len(list(two)) == len(two) == two.steps_in_epoch(0) + two.steps_in_epoch(1)
    assert list(two) == []  # a finished loader stays finished


def test_shuffle_depends_on_seed_and_epoch():
    src = DatasetSource(make_docs(np.full(64, 10)))

    def order(seed, epoch):
        ld = BalancedLoader(src, policy="greedy", cost=small_cost(64), world_size=1, global_batch_tokens=10,
                            seed=seed, epochs=epoch + 1)
        return [b.plan.doc_ids()[0] for b in ld if b.epoch == epoch]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(1, 0) and order(0, 0) != order(0, 1)
    assert sorted(order(0, 1)) == list(range(64))
    unshuffled = BalancedLoader(src, policy="greedy", cost=small_cost(64), world_size=1, global_batch_tokens=10,
                                shuffle=False)
    assert [int(b.plan.doc_ids()[0]) for b in unshuffled] == list(range(64))


def test_lengths_only_source_plans_without_tokens():
    ld = BalancedLoader([5, 900, 40, 0, 3], policy="greedy", cost=small_cost(128), world_size=4, rank=1,
                        global_batch_tokens=4096, max_seq_len=512)
    (b,) = list(ld)
    assert b.num_valid_tokens == 5 + 512 + 388 + 40 + 3 - 5
    for mb in b.microbatches:
        assert not mb.has_tokens and (mb.labels == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="lengths only"):
        ld.source.tokens(0)


def test_default_max_seq_len_from_cost():
    cost = small_cost(1000)
    assert default_max_seq_len(cost, PlanConfig(policy="greedy", world_size=8)) == 8000
    assert default_max_seq_len(cost, PlanConfig(policy="greedy", world_size=12)) == 8000
    assert default_max_seq_len(cost, PlanConfig(policy="greedy", world_size=8, cp=2)) == 2000
    ld = BalancedLoader([5], policy="greedy", cost=cost, world_size=4, global_batch_tokens=100_000)
    assert ld.max_seq_len == 4000
    ld = BalancedLoader([5], policy="greedy", cost=cost, world_size=4, global_batch_tokens=10)
    assert ld.max_seq_len == 10  # the default limit fits the budget: a step holds one sequence


@pytest.mark.parametrize(("policy", "world", "limit"), [
    ("maxlen", 12, 4 * 1000),  # one CP degree dividing the 12 lanes: at most 4
    ("static-sp", 6, 2 * 1000),
    ("token-kk", 8, 8 * 1000),
    ("hydra", 12, 8 * 1000),  # aligned power-of-two blocks
    ("hydraulis", 8, 4 * 3000),  # CP over the 4 replicas of tp 2 (one pool per shape)
])
def test_default_max_seq_len_is_what_the_policy_can_plan(policy, world, limit):
    cost = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                                "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0},
                                "max_tokens_per_lane": 1000,
                                "strategies": [{"tp": 2, "pp": 1, "max_tokens_per_lane": 3000}]})
    config = PlanConfig(policy=policy, world_size=world)
    assert default_max_seq_len(cost, config) == limit
    # a loader with the default context limit plans every step (long docs are split to fit)
    lengths = [limit + 1, 3 * limit, 10, 700, 999, limit]
    ld = BalancedLoader(lengths, policy=policy, cost=cost, world_size=world, global_batch_tokens=2 * limit,
                        prefetch_steps=0, validate=True)
    assert ld.max_seq_len == limit and sum(1 for _ in ld) == len(ld)


@pytest.mark.parametrize("kw,match", [
    ({"rank": 4}, "rank must be in 0..3"),
    ({"world_size": 0}, "world_size must be in 1..1,048,576, got 0"),
    ({"global_batch_tokens": 0}, "global_batch_tokens must be in 1.."),
    ({"long_docs": "chop"}, "long_docs must be one of"),
    ({"policy": "nope"}, "unknown policy 'nope'"),
    ({"cost": None}, "needs a cost model"),
    ({"cost": "no-such-preset"}, "unknown cost preset"),
    ({"plan_config": {"tpp": 2}}, r"unknown key\(s\) \['tpp'\]"),
    ({"epochs": 0}, r"epochs must be in 1..1,073,741,824 or None \(endless\), got 0"),
])
def test_bad_arguments(kw, match):
    args = {"policy": "greedy", "cost": small_cost(64), "world_size": 4, "rank": 0, "global_batch_tokens": 100}
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        BalancedLoader([5, 6], **args)


def test_all_empty_source_is_an_error():
    with pytest.raises(ValueError, match="no tokens to train on"):
        BalancedLoader([0, 0], policy="greedy", cost=small_cost(64), world_size=2, global_batch_tokens=10)


def test_cost_preset_by_name():
    ld = BalancedLoader([100, 2000], policy="greedy", cost="analytic:tiny@cpu", world_size=8,
                        global_batch_tokens=4096)
    (b,) = list(ld)
    assert b.plan.predicted_ms > 0 and ld.cost.name == "analytic:tiny@cpu"


def test_world_64_with_wide_cp_groups():
    lengths = [3000, 1500, 40, 700, 1024, 5, 0, 999]
    docs = make_docs(lengths, 9)
    loader, delivered = run_epochs(docs, 64, 2500, 16, check_ranks=[17, 63])
    assert loader.max_seq_len == 16 * 64
    assert {doc: sum(n for _, n in v) for (_, doc), v in delivered.items()} == \
        {i: n for i, n in enumerate(lengths) if n}
    plans = [b.plan for b in BalancedLoader(DatasetSource(docs), policy="greedy", cost=small_cost(16), world_size=64,
                                            global_batch_tokens=2500)]
    degrees = {g.degree for p in plans for mb in p.pools[0].microbatches for g in mb}
    assert max(degrees) == 64 and 1 in degrees
