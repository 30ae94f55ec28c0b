"""Exact mid-epoch resume: consume k steps, save, rebuild, and the next m steps are bitwise identical;
a state saved at one world size resumes at another and still delivers every doc of the epoch once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from balanced_loader.build.writer import write_shards
from balanced_loader.cost import CostModel
from balanced_loader.loader import BalancedLoader

WORLD = 4
COST = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                            "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 300})


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    rng = np.random.default_rng(11)
    lengths = np.concatenate([rng.integers(0, 400, size=70), [1500, 2500, 0, 900]])
    docs = [rng.integers(0, 60_000, size=int(n)) for n in lengths]
    return write_shards(docs, str(tmp_path_factory.mktemp("resume")), max_shard_bytes=8000)


def make(source, rank, **kw):
    args = {"policy": "greedy", "cost": COST, "world_size": WORLD, "rank": rank, "global_batch_tokens": 3000,
            "seed": 5, "epochs": 3, "max_seq_len": 1000, "shuffle_window": 16}
    args.update(kw)
    return BalancedLoader(source, **args)


def signature(batch):
    """Everything a rank receives for a step, as bytes."""
    mbs = [(m.k, m.lanes, m.segments, m.input_ids.tobytes(), m.labels.tobytes(), m.position_ids.tobytes(),
            m.cu_seqlens.tobytes()) for m in batch.microbatches]
    return (batch.step, batch.epoch, batch.step_in_epoch, batch.plan.fingerprint(), batch.num_valid_tokens, mbs)


def reference(source, n):
    out = []
    for r in range(WORLD):
        ld = make(source, r)
        out.append([signature(b) for _, b in zip(range(n), ld)])
        ld.close()
    return out


@pytest.mark.parametrize("where", ["mid_epoch", "epoch_end", "before_epoch_end"])
def test_resume_is_bitwise_identical_on_every_rank(shards, where):
    per_epoch = make(shards, 0).steps_in_epoch(0)
    assert per_epoch >= 6
    k = {"mid_epoch": per_epoch // 2, "epoch_end": per_epoch, "before_epoch_end": per_epoch - 1}[where]
    m = 4  # the next steps cross into epoch 1 for the last two cases
    ref = reference(shards, k + m)
    states = []
    for r in range(WORLD):
        ld = make(shards, r, prefetch_steps=3)
        consumed = [signature(b) for _, b in zip(range(k), ld)]
        assert consumed == ref[r][:k]
        states.append(json.loads(json.dumps(ld.state_dict())))  # plain JSON, as a checkpoint stores it
        ld.close()
    assert all(s == states[0] for s in states)  # the cursor is the same on every rank
    for r in range(WORLD):
        fresh = make(shards, r)
        fresh.load_state_dict(states[r])
        resumed = [signature(b) for _, b in zip(range(m), fresh)]
        assert resumed == ref[r][k:k + m]
    epochs = {s[1] for s in ref[0][k:k + m]}
    assert epochs == {"mid_epoch": epochs | {0}, "epoch_end": {1}, "before_epoch_end": {0, 1}}[where]


def test_load_state_rewinds_a_running_loader(shards):
    ld = make(shards, 2, prefetch_steps=2)
    first = [signature(b) for _, b in zip(range(3), ld)]
    state = ld.state_dict()
    later = [signature(b) for _, b in zip(range(3), ld)]
    ld.load_state_dict(state)
    assert [signature(b) for _, b in zip(range(3), ld)] == later
    assert first[-1][0] + 1 == later[0][0]


@pytest.mark.parametrize("change,match", [
    ({"seed": 6}, "saved with seed=5"),
    ({"global_batch_tokens": 4000}, "global_batch_tokens"),
    ({"max_seq_len": 900}, "max_seq_len"),
])
def test_refuses_a_changed_setup(shards, change, match):
    state = make(shards, 0).state_dict()
    with pytest.raises(ValueError, match=match):
        make(shards, 0, **change).load_state_dict(state)


def test_refuses_a_changed_policy_or_source(shards, tmp_path):
    state = make(shards, 0).state_dict()
    other = dict(state, policy="maxlen")
    with pytest.raises(ValueError, match="saved with policy='maxlen' but this loader has policy='greedy'"):
        make(shards, 0).load_state_dict(other)
    small = write_shards([np.arange(10)] * 3, str(tmp_path))
    with pytest.raises(ValueError, match="the source changed"):
        make(small, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="not a BalancedLoader state"):
        make(shards, 0).load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="version 4 is not supported"):
        make(shards, 0).load_state_dict(dict(state, version=4))
    with pytest.raises(ValueError, match="steps were cut between docs"):
        make(shards, 0).load_state_dict(dict(state, version=2))
    with pytest.raises(ValueError, match="batch cursor does not match epoch 0, step 2"):
        make(shards, 0).load_state_dict(dict(state, step_in_epoch=2, step=2))


def test_state_from_another_rank_is_accepted(shards):
    a, b = make(shards, 0), make(shards, 3)
    for _ in range(2):
        next(a)
    b.load_state_dict(a.state_dict())
    assert next(b).step == 2


def delivered(loader, batch):
    """Every doc piece ``(doc, start, length)`` a step delivers, over all ranks (materialized in one process)."""
    return [(d, a, n) for r in range(loader.world_size)
            for mb in (batch.microbatches if r == batch.rank else loader.microbatches(batch.plan, r))
            for d, a, n in mb.segments if d >= 0]


def test_state_from_world_size_4_resumes_at_2_with_every_doc_once(shards):
    kw = {"max_seq_len": 600, "epochs": 1}  # 600 tokens fit 2 lanes of 300: the same limit at both sizes
    four = make(shards, 0, world_size=4, prefetch_steps=2, **kw)
    first = [b for _, b in zip(range(3), four)]
    state = json.loads(json.dumps(four.state_dict()))
    four.close()
    two = make(shards, 1, world_size=2, **kw)
    two.load_state_dict(state)
    rest = list(two)
    assert [b.step for b in first + rest] == list(range(3 + len(rest))) and rest
    assert {b.epoch for b in first + rest} == {0}
    pieces: dict[int, list[tuple[int, int]]] = {}
    for ld, b in [(four, b) for b in first] + [(two, b) for b in rest]:
        for d, a, n in delivered(ld, b):
            pieces.setdefault(d, []).append((a, n))
    lengths = np.asarray(shards.lengths)
    assert set(pieces) == set(np.flatnonzero(lengths > 0).tolist())
    for d, segs in pieces.items():  # exactly once: the pieces tile the doc
        pos = 0
        for a, n in sorted(segs):
            assert a == pos
            pos += n
        assert pos == lengths[d]
    # the global batches do not depend on the world size: an uninterrupted run at 2 cuts the same ones
    ref = [b.plan.doc_ids().tolist() for b in make(shards, 0, world_size=2, **kw)]
    assert [b.plan.doc_ids().tolist() for b in first + rest] == ref


def test_default_context_limit_that_depends_on_the_world_size_is_refused(shards):
    state = make(shards, 0, max_seq_len=None).state_dict()  # default: 300 tokens x 4 lanes
    assert state["max_seq_len"] == 1200 and state["world_size"] == WORLD
    with pytest.raises(ValueError, match="saved with max_seq_len=1200 but this loader has max_seq_len=600"):
        make(shards, 0, world_size=2, max_seq_len=None).load_state_dict(state)
    resumed = make(shards, 1, world_size=8, max_seq_len=1200)  # the saved limit, given explicitly
    resumed.load_state_dict(state)
    assert next(resumed).step == 0


def test_length_mid_epoch_leaves_the_cursor_alone(shards):
    ref = [signature(b) for b in make(shards, 0, epochs=6)]
    ld = make(shards, 0, epochs=6, prefetch_steps=0)
    got = [signature(b) for _, b in zip(range(3), ld)]
    assert len(ld) == len(ref)  # one pass per epoch, over more epochs than the loader keeps
    got += [signature(b) for b in ld]
    assert got == ref
