"""Steps of sequences on a corpus zoo built from this machine's files (docs hundreds of times max_seq_len,
thousands of tiny docs, code, prose, mixtures): every step's size and mix, every token once per epoch,
exact resume between two pieces of one doc and at another world size, mixture cursors checked on load."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

import balanced_loader as bl
from balanced_loader.batches.stream import global_batches
from balanced_loader.build import zoo
from balanced_loader.build.writer import write_shards
from balanced_loader.loader import BalancedLoader
from balanced_loader.materialize import IGNORE_INDEX

L, B = 512, 16384  # the stdlib's largest file is ~1,500 pieces of L


@functools.cache
def _lengths(name: str, limit: int | None) -> np.ndarray:
    return zoo.lengths(name, limit=limit)


def corpus(name: str, limit: int | None = None) -> np.ndarray:
    ln = _lengths(name, limit)
    if len(ln) < 20:
        pytest.skip(f"zoo corpus '{name}' is not on this machine")
    return ln


@pytest.fixture(scope="module")
def code_shards(tmp_path_factory):
    """Real shards: 80 stdlib files including pydoc_data/topics.py (757 KB: ~1,480 pieces of L) and 400
    tiny lines, byte tokens."""
    files = zoo.files("stdlib")
    big = [f for f in files if f.endswith("pydoc_data/topics.py")]
    picked = big + files[:: max(1, len(files) // 80)][:80]
    docs = [np.frombuffer(zoo.read_doc(f), dtype=np.uint8) for f in picked]
    docs += [np.frombuffer(x, dtype=np.uint8) for x in zoo.docs("lines", limit=5)[:400]]
    order = np.random.default_rng(0).permutation(len(docs))
    return write_shards([docs[i] for i in order], str(tmp_path_factory.mktemp("zoo")), max_shard_bytes=256 << 10)


def make(source, rank=0, world=4, **kw):
    args = {"policy": "hydra", "cost": "analytic:tiny@cpu", "world_size": world, "rank": rank,
            "global_batch_tokens": B, "max_seq_len": L, "seed": 5, "shuffle_window": 256, "validate": True}
    args.update(kw)
    return BalancedLoader(source, **args)


@pytest.mark.parametrize("name", ["stdlib", "lines", "c_headers", "man", "license_texts"])
@pytest.mark.parametrize("long_docs", ["split", "truncate", "drop"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_step_but_the_last_holds_between_budget_minus_a_sequence_and_the_budget(name, long_docs, shuffle):
    ln = corpus(name, limit=400 if name == "lines" else 4000)
    batches, stats = global_batches(ln, max_seq_len=L, long_docs=long_docs, global_batch_tokens=B,
                                    shuffle=shuffle, seed=1)
    sizes = np.asarray([int(b.lengths.sum()) for b in batches])
    assert (sizes[:-1] >= B - L).all() and (sizes <= B).all() and (sizes > 0).all()
    assert int(sizes.sum()) == stats.tokens
    want = {"split": int(ln.sum()), "truncate": int(np.minimum(ln, L).sum()), "drop": int(ln[ln <= L].sum())}
    assert stats.tokens == want[long_docs]  # every token once (split), nothing silently lost


def test_the_loader_on_a_code_corpus_with_docs_hundreds_of_times_the_context(code_shards):
    """hydra on 4 ranks, shuffled: each step in [B - L, B], plans valid for the step's sequences, every
    token once per epoch (all ranks materialized here), the long doc spread over many steps."""
    ld = make(code_shards, epochs=1, shuffle_window=1 << 16)  # one window: the long doc spreads over the epoch
    others = [make(code_shards, rank=r, epochs=1, shuffle_window=1 << 16) for r in (1, 2, 3)]
    lengths = np.asarray(code_shards.lengths)
    longest = int(np.argmax(lengths))
    assert lengths[longest] > 1000 * L
    pieces: dict[int, list[tuple[int, int]]] = {}
    sizes, steps_with_longest, share = [], 0, 0.0
    for batch in ld:
        obs = [next(o) for o in others]
        sizes.append(int(batch.sequences.lengths.sum()))
        mine = batch.sequences.lengths[batch.sequences.doc_ids == longest].sum()
        steps_with_longest += bool(mine)
        share = max(share, mine / sizes[-1])
        seqs = batch.sequences
        ends = set(zip(seqs.doc_ids.tolist(), (seqs.starts + seqs.lengths).tolist()))
        for b in [batch, *obs]:
            for mb in b.microbatches:
                o = 0
                for d, a, n in mb.segments:
                    if d >= 0:
                        assert np.array_equal(mb.input_ids[o:o + n], code_shards.tokens(d)[a:a + n])
                        if (d, a + n) in ends:  # a sequence's last token (a piece of a long doc too): no target
                            assert mb.labels[o + n - 1] == IGNORE_INDEX
                        pieces.setdefault(d, []).append((a, n))
                    o += n
    sizes = np.asarray(sizes)
    assert (sizes[:-1] >= B - L).all() and (sizes <= B).all()
    for d, n in enumerate(lengths.tolist()):
        pos = 0
        for a, k in sorted(pieces.get(d, [])):
            assert a == pos
            pos += k
        assert pos == n
    assert steps_with_longest > 0.9 * len(sizes) and share < 0.75  # it is 38% of the tokens (unshuffled: 100%)


def test_to_hf_gives_no_target_to_the_first_token_of_every_sequence_pieces_included(code_shards):
    """cp=1 (a DDP loop over a transformers model): unshifted labels, -100 at each sequence's first token."""
    ld = make(code_shards, cp=1, epochs=1, shuffle_window=1 << 16)
    checked = 0
    for _, batch in zip(range(12), ld):
        starts = set(zip(batch.sequences.doc_ids.tolist(), batch.sequences.starts.tolist()))
        for r in range(ld.world_size):
            for mb in ld.microbatches(batch.plan, r):
                labels, o = mb.to_hf()["labels"][0], 0
                for d, a, n in mb.segments:
                    if d >= 0 and (d, a) in starts:
                        assert labels[o].item() == IGNORE_INDEX
                        checked += a > 0
                    o += n
    ld.close()
    assert checked > 10  # pieces of long docs (start > 0) among them


def test_resume_between_two_pieces_of_one_doc_exactly_at_another_world_size(code_shards):
    four = make(code_shards, epochs=2, prefetch_steps=2)
    ref = make(code_shards, world=2, rank=1, epochs=2)
    lengths = np.asarray(code_shards.lengths)
    for _ in range(7):
        b = next(four)
    seen = {int(d) for d, a in zip(b.sequences.doc_ids, b.sequences.starts) if a > 0}
    assert any(lengths[d] > 100 * L for d in seen)  # the state falls between two pieces of a long doc
    state = json.loads(json.dumps(four.state_dict()))
    four.close()
    two = make(code_shards, world=2, rank=1, epochs=2)
    two.load_state_dict(state)
    for _ in range(7):
        next(ref)
    rest, want = list(two), list(ref)
    assert [r.plan.fingerprint() for r in rest] == [w.plan.fingerprint() for w in want] and len(rest) > 10
    assert [r.step for r in rest] == [w.step for w in want]
    total = sum(int(x.sequences.lengths.sum()) for x in make(code_shards, epochs=2))
    assert total == 2 * int(lengths.sum())  # two epochs: every token exactly twice


@pytest.fixture(scope="module")
def zoo_mix():
    return bl.mix({"code": corpus("stdlib"), "prose": corpus("man", limit=4000), "tiny": corpus("lines")},
                  weights={"code": 0.6, "prose": 0.3, "tiny": 0.1})


def shares_ok(ld, steps):
    names, dev, total, want = ld.source.names, 0.0, np.zeros(3), np.zeros(3)
    for _, b in zip(range(steps), ld):
        t = np.asarray([b.mixture_tokens[n] for n in names], dtype=np.float64)
        w = np.asarray(ld.source.weights.at(b.step))
        assert B - L <= t.sum() <= B
        dev = max(dev, float(np.abs(t - w * t.sum()).max()))
        assert all(t[i] > 0 for i in range(3) if w[i] * t.sum() >= L)  # no step without a source of >= L
        total, want = total + t, want + w * t.sum()
    ld.close()
    return dev, total / total.sum(), want / want.sum()


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_mixture_holds_every_share_in_every_step_with_long_docs_split(zoo_mix, shuffle):
    ld = make(zoo_mix, policy="greedy", epochs=None, shuffle=shuffle, validate=False)
    dev, got, want = shares_ok(ld, 150)
    assert dev <= L and np.abs(got - want).max() < 0.005


def test_a_weight_schedule_is_followed_step_by_step(zoo_mix):
    sched = bl.mix(dict(zip(zoo_mix.names, zoo_mix.sources)),
                   weights=[(10, {"code": 0.6, "prose": 0.3, "tiny": 0.1}),
                            (20, {"code": 0.2, "prose": 0.2, "tiny": 0.6})])
    dev, got, want = shares_ok(make(sched, policy="greedy", epochs=None, validate=False), 60)
    assert dev <= L and np.abs(got - want).max() < 0.005


def test_each_source_delivers_every_token_n_or_n_plus_1_times():
    m = bl.mix({"code": corpus("stdlib", limit=40), "tiny": corpus("lines", limit=2)},
               weights={"code": 0.5, "tiny": 0.5})
    ld = make(m, policy="greedy", epochs=None, validate=False)
    ln = [np.asarray(x.lengths) for x in m.sources]
    first = [np.concatenate([[0], np.cumsum(x)]) for x in ln]  # [docs + 1] each source's token offsets
    cover = [np.zeros(int(x.sum()), dtype=np.int64) for x in ln]  # [tokens] times each token was delivered
    for _, b in zip(range(100), ld):
        for d, a, k in zip(b.sequences.doc_ids.tolist(), b.sequences.starts.tolist(), b.sequences.lengths.tolist()):
            name, local = m.split_id(d)
            i = m.names.index(name)
            cover[i][first[i][local] + a:first[i][local] + a + k] += 1
        for c in cover:  # at every step boundary
            assert int(c.max()) - int(c.min()) <= 1
    assert min(int(c.min()) for c in cover) >= 1  # both sources went round at least once
    ld.close()


def test_a_moved_mixture_cursor_is_refused(zoo_mix):
    ld = make(zoo_mix, policy="greedy", epochs=None, validate=False)
    for _ in range(5):
        next(ld)
    good = json.loads(json.dumps(ld.state_dict()))
    ld.close()
    src = good["position"]["cursor"]["sources"]
    for name, key, delta in (("code", "unit", -2), ("code", "unit", 1), ("prose", "unit", 1),
                             ("tiny", "carry", 1e300), ("tiny", "carry", 0.5), ("code", "epoch", 5)):
        bad = json.loads(json.dumps(good))
        bad["position"]["cursor"]["sources"][name][key] = src[name][key] + delta
        with pytest.raises(ValueError, match="loader state"):
            make(zoo_mix, policy="greedy", epochs=None).load_state_dict(bad)
    fresh = make(zoo_mix, policy="greedy", epochs=None, validate=False)
    fresh.load_state_dict(good)  # the state as saved resumes
    assert next(fresh).step == 5


def test_global_batch_tokens_below_max_seq_len_is_one_line_and_the_default_limit_fits_the_budget():
    ln = corpus("lines")
    with pytest.raises(ValueError, match="global_batch_tokens 1000 is smaller than max_seq_len 4096"):
        BalancedLoader(ln, cost="analytic:tiny@cpu", world_size=2, rank=0, global_batch_tokens=1000,
                       max_seq_len=4096)
    with pytest.raises(ValueError, match="at step 10"):
        BalancedLoader(ln, cost="analytic:tiny@cpu", world_size=2, rank=0, global_batch_tokens=[(0, 8192), (10, 2048)],
                       max_seq_len=4096)
    ld = BalancedLoader(ln, cost="analytic:tiny@cpu", world_size=2, rank=0, global_batch_tokens=1000)
    assert ld.max_seq_len <= 1000
