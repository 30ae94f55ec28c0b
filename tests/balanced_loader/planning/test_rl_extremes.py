"""Reliability III (issue 38), RL balancing: ``world_size`` bounded as the loader's, planning near-linear in the
rollouts and the ranks (10^5 ranks: was a MemoryError, a ``ranks x (items + rounds)`` member table), per-rollout
fields of any kind (numpy uid strings, lists, bf16 tensors), strided and jagged nested batches; bad values
(bf16 or meta lengths, ``pad_id=-1``, ``inf`` lengths, a 2**70 cap) one line each. The 10^7-rollout figure is
``tools/bench_rl_scaling.py`` (``docs/results/reliability3.md``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import balanced_loader as bl
from balanced_loader.planning.rl import rollout_work

torch = pytest.importorskip("torch")


def _lens(n: int, seed: int = 0, cap: int = 32768) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(2048), 1.2, n)), 1, cap).astype(np.int64)


def _check(out, lengths, world, cap):
    assert len(out) == world and len({len(r) for r in out}) == 1
    flat = sorted(i for r in out for mb in r for i in mb)
    assert flat == list(range(len(lengths)))
    assert max(int(lengths[mb].sum()) for r in out for mb in r if mb) <= cap


@pytest.mark.parametrize("n, world", [(100_000, 100_000), (1_000, 1_000_000), (300_000, 64)])
def test_many_ranks_or_rollouts_plan_in_seconds(n, world):
    lengths = _lens(n)
    bl.balance(lengths[:100], world_size=4, max_tokens_per_microbatch=32768)  # compiled kernels loaded
    t0 = time.process_time()
    out = bl.balance(lengths, world_size=world, max_tokens_per_microbatch=32768)  # was: MemoryError (1e5, 1e6 ranks)
    seconds = time.process_time() - t0
    _check(out, lengths, world, 32768)
    assert seconds < 20, seconds  # about 0.5 / 5 / 1 s CPU on a shared 2-core machine (results: reliability3.md)
    work = rollout_work(lengths)
    loads = [sum(float(work[i]) for mb in r for i in mb) for r in out]
    assert max(loads) <= max(float(work.max()), 1.02 * float(work.sum()) / world)


def test_the_exchange_keeps_every_tie_on_equal_lengths():
    lengths = np.full(20_000, 512, dtype=np.int64)  # every work equal: the tie runs were O(items) each
    out = bl.balance(lengths, world_size=64, max_tokens_per_microbatch=4096)
    _check(out, lengths, 64, 4096)
    assert {sum(len(mb) for mb in r) for r in out} == {312, 313}


@pytest.mark.parametrize("kw, needle", [
    ({"world_size": 10**9}, "world_size must be at most 1,048,576"),
    ({"max_tokens_per_microbatch": 2**70}, "max_tokens_per_microbatch must be at most 1,099,511,627,776"),
    ({"lengths": [3.0, float("inf")]}, r"lengths must be integers: rollout 1 has inf tokens"),
    ({"lengths": [3.0, float("nan")]}, r"rollout 1 has nan tokens"),
    ({"lengths": [3.5, 2.0]}, r"rollout 0 has 3.5 tokens"),
    ({"lengths": np.array([5, 2**63], dtype=np.uint64)}, "rollout 1 has 9,223,372,036,854,775,808 tokens, more than"),
    ({"lengths": [True, False]}, "lengths must be integers, got dtype bool"),
    ({"lengths": ["3", None]}, "lengths must be integers"),
])
def test_extreme_values_are_one_line(kw, needle):
    args = {"lengths": [3, 5, 8], "world_size": 2, "max_tokens_per_microbatch": 64, **kw}
    with pytest.raises(ValueError, match=needle) as e:
        bl.balance(args.pop("lengths"), **args)
    assert "\n" not in str(e.value)


def test_bf16_and_meta_lengths_are_one_line():
    with pytest.raises(ValueError, match="lengths are bfloat16, which holds integers exactly only up to 256"):
        bl.balance(torch.tensor([300.0, 257.0], dtype=torch.bfloat16), world_size=2, max_tokens_per_microbatch=999)
    with pytest.raises(ValueError, match="lengths is a meta tensor"):
        bl.balance(torch.zeros(4, dtype=torch.long, device="meta"), world_size=2, max_tokens_per_microbatch=99)
    out = bl.balance(torch.tensor([300, 257], dtype=torch.int32), world_size=2, max_tokens_per_microbatch=999)
    assert sorted(i for r in out for mb in r for i in mb) == [0, 1]


def _padded(b: int = 11, s: int = 16):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, s + 1, (b,), generator=g)
    ids = torch.randint(1, 100, (b, s), generator=g)
    mask = (torch.arange(s)[None] < lens[:, None]).long()
    return lens, ids, mask


def test_per_rollout_fields_of_any_kind_and_dtype():
    lens, ids, mask = _padded()
    uid = np.array([f"uid-{i}" for i in range(11)], dtype=object)  # verl keeps uids so (was: AttributeError)
    fields = {"input_ids": ids, "attention_mask": mask, "uid": uid, "names": [f"n{i}" for i in range(11)],
              "reward": torch.randn(11).to(torch.bfloat16), "done": torch.ones(11, dtype=torch.bool),
              "logp": torch.randn(11, 16).to(torch.bfloat16), "np_tok": np.arange(11 * 16).reshape(11, 16)}
    out = bl.balance_batch(fields, world_size=3, max_tokens_per_microbatch=40)
    got_uid, got_names, got_reward = [], [], []
    for rank in out.microbatches:
        for mb in rank:
            idx = mb["indices"].tolist()
            assert list(mb["uid"]) == [f"uid-{i}" for i in idx] and mb["names"] == [f"n{i}" for i in idx]
            assert mb["reward"].dtype == torch.bfloat16 and mb["done"].dtype == torch.bool
            cu = mb["cu_seqlens"].tolist()
            for j, i in enumerate(idx):
                n = int(lens[i])
                assert torch.equal(mb["logp"][0, cu[j]:cu[j + 1]], fields["logp"][i, :n])
                assert np.array_equal(mb["np_tok"][0, cu[j]:cu[j + 1]], fields["np_tok"][i, :n])
            got_uid += list(mb["uid"])
            got_names += mb["names"]
            got_reward.append(mb["reward"])
    assert list(out.restore(np.array(got_uid, dtype=object))) == list(uid)
    assert out.restore(got_names) == fields["names"]
    assert torch.equal(out.restore(torch.cat(got_reward)), fields["reward"])


@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_nested_batches_of_either_layout(layout):
    lens, ids, mask = _padded()
    rows = [ids[i, :int(n)] for i, n in enumerate(lens)]
    kw = {"layout": torch.jagged} if layout == "jagged" else {}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that the strided layout is a prototype
        nested = torch.nested.nested_tensor(rows, **kw)  # the default layout is strided (was: AttributeError)
    padded = bl.balance_batch({"input_ids": ids, "attention_mask": mask, "uid": list(range(11))}, world_size=2,
                              max_tokens_per_microbatch=40)
    out = bl.balance_batch({"input_ids": nested, "uid": list(range(11))}, world_size=2, max_tokens_per_microbatch=40)
    assert out.indices == padded.indices
    for a, b in zip((m for r in out.microbatches for m in r), (m for r in padded.microbatches for m in r)):
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["uid"] == b["uid"]


def test_bad_batches_are_one_line():
    lens, ids, mask = _padded()
    cases = [({"input_ids": ids}, {"pad_id": -1}, "pad_id must be a token id in 0..4,294,967,295, got -1"),
             ({"input_ids": ids.to(torch.bfloat16)}, {}, "must hold integer token ids, got bfloat16"),
             ({"input_ids": torch.zeros(11, 16, dtype=torch.long, device="meta")}, {}, "is a meta tensor"),
             ({"input_ids": ids, "uid": np.arange(4)}, {}, "must hold the 11 rollouts on dim 0, got 4"),
             ({"input_ids": ids, "x": 3.0}, {}, "must be a tensor, a numpy array or a list"),
             ({"input_ids": ids}, {"world_size": 10**7}, "world_size must be at most")]
    for tensors, kw, needle in cases:
        args = {"world_size": 2, "max_tokens_per_microbatch": 40, **kw}
        with pytest.raises(ValueError, match=needle) as e:
            bl.balance_batch(tensors, **args)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("descending", [False, True])
def test_radix_order_equals_a_stable_argsort(descending):
    from balanced_loader.planning.kernels.order import argsort_nonneg, argsort_stable

    rng = np.random.default_rng(5)
    keys = rng.integers(0, 300, 200_000).astype(np.float64) * rng.choice([1.0, 1e-7, 3e12], 200_000)  # many ties
    keys[:5] = 0.0
    want = np.argsort(-keys if descending else keys, kind="stable")
    assert np.array_equal(argsort_nonneg(keys, descending), want)
    assert np.array_equal(argsort_nonneg(keys[:1000], descending), np.argsort(-keys[:1000] if descending else
                                                                               keys[:1000], kind="stable"))
    # the one order of the kernels: the radix path is argsort_stable's order, ties included
    assert np.array_equal(argsort_nonneg(keys, descending), argsort_stable(-keys if descending else keys))
