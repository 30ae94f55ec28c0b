"""``bl.balance`` / ``bl.balance_batch``: kernels equal their references, the invariants (every index once,
the cap, equal counts), never heavier than verl's partition, one-line errors, and the packed tensors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import balanced_loader as bl
from balanced_loader.planning.kernels.karmarkar_karp import grouped_kk_kernel, verl_kk_reference
from balanced_loader.planning.packing import lpt
from balanced_loader.planning.rl import rollout_work
from balanced_loader.planning.rl.kernels import (
    balance_kernel,
    exchange_kernel,
    exchange_reference,
    microbatch_kernel,
    microbatch_reference,
)

torch = pytest.importorskip("torch")


@st.composite
def rollouts(draw):
    k = draw(st.integers(1, 7))
    n = draw(st.integers(1, 48))
    top = draw(st.sampled_from([4, 60, 3000]))  # 4: many exact ties
    lengths = np.asarray(draw(st.lists(st.integers(1, top), min_size=n, max_size=n)), dtype=np.int64)
    return lengths, k


# ---- kernels == references --------------------------------------------------------------------

@given(rollouts())
def test_grouped_kk_is_verls_equal_size_karmarkar_karp(case):
    lengths, k = case
    work = rollout_work(lengths)
    part = grouped_kk_kernel(work, k)
    assert [sorted(np.flatnonzero(part == j).tolist()) for j in range(k)] == verl_kk_reference(work.tolist(), k, True)


@given(rollouts(), st.integers(0, 2**31), st.integers(0, 40))
def test_exchange_equals_reference_and_never_raises_the_heaviest(case, seed, rounds):
    lengths, k = case
    work = rollout_work(lengths)
    start = np.random.default_rng(seed).integers(0, k, len(lengths))
    part, load, used = exchange_kernel(work, start, k, rounds)
    ref_part, ref_load, ref_used = exchange_reference(work, start, k, rounds)
    assert np.array_equal(part, ref_part) and used == ref_used
    np.testing.assert_allclose(load, ref_load, rtol=1e-12)
    np.testing.assert_allclose(load, np.bincount(part, weights=work, minlength=k), rtol=1e-12)
    assert load.max() <= np.bincount(start, weights=work, minlength=k).max()


@given(rollouts(), st.integers(0, 2**31), st.integers(0, 80), st.booleans())
def test_microbatch_kernel_equals_reference(case, seed, slack, equal):
    lengths, k = case
    work = rollout_work(lengths)
    part = np.random.default_rng(seed).integers(0, k, len(lengths))
    cap = int(lengths.max()) + slack
    mb, counts = microbatch_kernel(lengths, work, part, k, cap, equal)
    ref_mb, ref_counts = microbatch_reference(lengths, work, part, k, cap, equal)
    assert np.array_equal(mb, ref_mb) and np.array_equal(counts, ref_counts)
    for r in range(k):
        mine = part == r
        assert np.all(mb[mine] < counts[r])
        assert np.bincount(mb[mine], weights=lengths[mine], minlength=counts[r]).max(initial=0) <= cap


@given(rollouts(), st.integers(0, 80), st.booleans())
def test_balance_kernel_is_the_chain_of_the_references(case, slack, equal):
    lengths, k = case
    work = rollout_work(lengths)
    cap = int(lengths.max()) + slack
    part, mb, counts, items, bounds = balance_kernel(lengths, work, k, cap, equal, 2 * k)
    if k > 1:
        order = np.argsort(-work, kind="stable")
        start = np.empty(len(work), dtype=np.int64)
        start[order] = lpt(work[order], np.ones(len(work), dtype=np.int64), k).lane
        ref, load, _ = exchange_reference(work, start, k, 2 * k)
        verl = verl_kk_reference(work.tolist(), k, True)
        if load.max() > max(sum(work[i] for i in p) for p in verl):
            ranks = np.empty(len(work), dtype=np.int64)
            for j, p in enumerate(verl):
                ranks[p] = j
            ref = exchange_reference(work, ranks, k, 2 * k)[0]
    else:
        ref = np.zeros(len(work), dtype=np.int64)
    assert np.array_equal(part, ref)
    ref_mb, ref_counts = microbatch_reference(lengths, work, ref, k, cap, equal)
    assert np.array_equal(mb, ref_mb) and np.array_equal(counts, ref_counts)


# ---- balance ------------------------------------------------------------------------------------

@given(rollouts(), st.integers(0, 60), st.booleans())
def test_balance_invariants(case, slack, equal):
    lengths, world = case
    cap = int(lengths.max()) + slack
    out = bl.balance(lengths, world_size=world, max_tokens_per_microbatch=cap, equal_counts=equal)
    assert len(out) == world
    flat = sorted(i for rank in out for mb in rank for i in mb)
    assert flat == list(range(len(lengths)))  # every index exactly once
    assert all(mb == sorted(mb) and int(lengths[mb].sum()) <= cap for rank in out for mb in rank if mb)
    if equal:
        assert len({len(rank) for rank in out}) == 1
    # never heavier than verl's own equal-size partition (its exact Karmarkar-Karp is a start)
    work = rollout_work(lengths)
    verl = max(sum(work[i] for i in p) for p in verl_kk_reference(work.tolist(), world, True))
    assert max(sum(work[i] for mb in rank for i in mb) for rank in out) <= verl
    assert out == bl.balance(lengths.tolist(), world_size=world, max_tokens_per_microbatch=cap, equal_counts=equal)


def test_balance_long_tailed_batch_against_verls_two_functions():
    """4,096 long-tailed rollouts on 64 ranks (the full sweep and timing: tools/bench_rl_balance.py)."""
    rng = np.random.default_rng(0)
    cap = 16384
    lengths = np.clip(np.round(rng.lognormal(np.log(2048), 1.2, 4096)), 1, cap).astype(np.int64)
    out = bl.balance(lengths, world_size=64, max_tokens_per_microbatch=cap)
    work = rollout_work(lengths)
    loads = np.array([sum(work[i] for mb in rank for i in mb) for rank in out])
    assert loads.max() <= 1.01 * loads.mean()
    # verl: equal-size KK to ranks, then ceil(tokens / cap) microbatches per rank, the largest everywhere
    ranks = verl_kk_reference(work.tolist(), 64, True)
    assert loads.max() <= max(sum(work[i] for i in r) for r in ranks)
    assert len(out[0]) <= max(min(len(r), -(-int(lengths[r].sum()) // cap)) for r in ranks)
    assert all(int(lengths[mb].sum()) <= cap for rank in out for mb in rank)


def test_balance_with_a_cost_model_and_fewer_rollouts_than_the_count():
    cost = bl.CostModel.from_dict({"quadratic_ms": 1e-6, "linear_ms": 1e-3, "microbatch_ms": 1.0,
                                   "comm_bytes_per_token": 0, "bandwidth_gbs": {2: 1.0}, "max_tokens_per_lane": 100})
    # the rank with two 90-token rollouts needs 2 microbatches: the one-rollout rank gets an empty one
    out = bl.balance([90, 90, 90], world_size=2, max_tokens_per_microbatch=100, cost=cost)
    assert [len(r) for r in out] == [2, 2]
    assert sorted(len(mb) for r in out for mb in r) == [0, 1, 1, 1]


@pytest.mark.parametrize("kw, needle", [
    ({"lengths": [5, 40], "max_tokens_per_microbatch": 32}, "rollout 1 has 40 tokens, more than"),
    ({"lengths": []}, "lengths is empty"),
    ({"world_size": 0}, "world_size must be an integer >= 1"),
    ({"lengths": [[1, 2], [3, 4]]}, "must be a 1-D sequence"),
    ({"lengths": [3, 0]}, "rollout 1 has 0 tokens"),
    ({"lengths": [1.5, 2]}, "lengths must be integers"),
    ({"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch must be an integer >= 1"),
])
def test_bad_input_is_one_line(kw, needle):
    args = {"lengths": [3, 5, 8], "world_size": 2, "max_tokens_per_microbatch": 64, **kw}
    with pytest.raises(ValueError, match=needle) as e:
        bl.balance(args.pop("lengths"), **args)
    assert "\n" not in str(e.value)


# ---- balance_batch ----------------------------------------------------------------------------

def _batch(left: bool):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 21, (13,), generator=g)  # [B]
    ids = torch.randint(1, 100, (13, 20), generator=g)  # [B, S]
    mask = torch.zeros(13, 20, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        if left:
            mask[i, 20 - n:] = 1
        else:
            mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "advantages": torch.randn(13, 20, generator=g),
            "score": torch.randn(13, generator=g)}


@pytest.mark.parametrize("left", [True, False])
def test_balance_batch_packs_every_field_alike_and_restores_the_order(left):
    t = _batch(left)
    out = bl.balance_batch(t, world_size=3, max_tokens_per_microbatch=40)
    assert out.indices == bl.balance(t["attention_mask"].sum(-1), world_size=3, max_tokens_per_microbatch=40)
    rows = []
    for rank in out.microbatches:
        for mb in rank:
            assert set(mb) == {"input_ids", "position_ids", "cu_seqlens", "max_seqlen", "indices", "padding",
                               "advantages", "score"}
            cu = mb["cu_seqlens"].tolist()
            assert mb["input_ids"].shape == mb["advantages"].shape == (1, cu[-1]) and cu[-1] <= 40
            for j, i in enumerate(mb["indices"].tolist()):
                real = t["attention_mask"][i].bool()
                assert torch.equal(mb["input_ids"][0, cu[j]:cu[j + 1]], t["input_ids"][i][real])
                assert torch.equal(mb["advantages"][0, cu[j]:cu[j + 1]], t["advantages"][i][real])
                assert torch.equal(mb["position_ids"][0, cu[j]:cu[j + 1]], torch.arange(cu[j + 1] - cu[j]))
            rows.append(mb["score"])
    assert torch.equal(out.restore(torch.cat(rows)), t["score"])


def test_balance_batch_nested_and_one_line_errors():
    t = _batch(False)
    lens = t["attention_mask"].sum(-1).tolist()
    nested = {"input_ids": torch.nested.nested_tensor([t["input_ids"][i, :n] for i, n in enumerate(lens)],
                                                      layout=torch.jagged),
              "logp": torch.nested.nested_tensor([t["advantages"][i, :n] for i, n in enumerate(lens)],
                                                 layout=torch.jagged)}
    padded = bl.balance_batch({k: t[k] for k in ("input_ids", "attention_mask", "advantages")}, world_size=2,
                              max_tokens_per_microbatch=40)
    out = bl.balance_batch(nested, world_size=2, max_tokens_per_microbatch=40)
    assert out.indices == padded.indices
    for a, b in zip((m for r in out.microbatches for m in r), (m for r in padded.microbatches for m in r)):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["logp"], b["advantages"])
    for bad, needle in [({"ids": t["input_ids"]}, "with a 'input_ids' entry"),
                        ({"input_ids": t["input_ids"], "attention_mask": t["attention_mask"][:, :5]}, "must match"),
                        ({"input_ids": t["input_ids"], "score": t["score"][:4]}, "the 13 rollouts on dim 0")]:
        with pytest.raises(ValueError, match=needle) as e:
            bl.balance_batch(bad, world_size=2, max_tokens_per_microbatch=40)
        assert "\n" not in str(e.value)


def test_balance_batch_gives_an_empty_microbatch_as_one_pad_token():
    ids = torch.tensor([[5, 6, 7], [8, 9, 1], [2, 3, 4]])
    mask = torch.ones_like(ids)
    out = bl.balance_batch({"input_ids": ids, "attention_mask": mask}, world_size=2, max_tokens_per_microbatch=3,
                           pad_id=0)
    empty = [mb for r in out.microbatches for mb in r if mb["padding"]]
    assert empty and all(mb["input_ids"].tolist() == [[0]] and len(mb["indices"]) == 0 for mb in empty)
    assert sum(len(mb["indices"]) for r in out.microbatches for mb in r) == 3
