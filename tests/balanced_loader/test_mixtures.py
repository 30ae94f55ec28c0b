"""Mixtures and schedules (issue 21): ``bl.mix`` sources in the loader, shares per step and per run,
per-source epochs (every doc n or n+1 times), schedules of weights / max_seq_len / global_batch_tokens,
strict order, exact resume at another world size, and one-line errors for bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

import balanced_loader as bl
from balanced_loader.batches.stream import stream_for
from balanced_loader.build.writer import write_shards
from balanced_loader.cost import CostModel
from balanced_loader.data.mixture import ConcatLengths, MixtureSource, mix
from balanced_loader.loader import BalancedLoader
from balanced_loader.schedule import parse_text, schedule, weight_schedule

COST = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                            "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 512})
WEIGHTS = {"code": 0.3, "math": 0.1, "web": 0.6}


@pytest.fixture(scope="module")
def shard_mix(tmp_path_factory):
    """Three real shard folders of different sizes and length profiles (every doc <= 1024 tokens)."""
    rng = np.random.default_rng(3)
    out = {}
    for name, n, hi in (("web", 400, 1024), ("code", 300, 400), ("math", 40, 900)):
        docs = [rng.integers(0, 60_000, size=int(k)) for k in rng.integers(1, hi, size=n)]
        out[name] = write_shards(docs, str(tmp_path_factory.mktemp(name)), max_shard_bytes=40_000)
    return out


def loader(source, rank=0, world=4, **kw):
    args = {"policy": "greedy", "cost": COST, "world_size": world, "rank": rank, "global_batch_tokens": 16384,
            "seed": 7, "epochs": None, "max_seq_len": 1024, "shuffle_window": 64, "prefetch_steps": 1}
    args.update(kw)
    return BalancedLoader(source, **args)


def take(ld, n):
    out = [b for _, b in zip(range(n), ld)]
    ld.close()
    return out


def segments(batch):
    """The step's global batch as planned: every segment, sorted (the same at any world size)."""
    return sorted((int(d), int(s), int(n)) for p in batch.plan.pools for mb in p.microbatches
                  for g in mb for d, s, n in g.segments)


# ---- schedules ------------------------------------------------------------------------------


def test_schedules_are_piecewise_linear_and_constant_outside_the_points():
    s = schedule([(10, 512), (20, 4096)], "max_seq_len")
    assert [s.at(k) for k in (0, 10, 15, 20, 99)] == [512, 512, 2304, 4096, 4096]
    assert s.at(11) == 512 + round((4096 - 512) / 10) and isinstance(s.at(13), int)
    f = schedule([(0, 1.0), (4, 0.0)], "w", integer=False, minimum=0)
    assert f.at(1) == 0.75 and f.at(7) == 0.0
    assert schedule(8, "x").constant and schedule(8, "x").to_json() == 8
    assert parse_text("512@0,4096@20", "x") == [(0, 512), (20, 4096)] and parse_text("7", "x") == 7
    w = weight_schedule([(10, {"a": 0.6, "b": 0.4}), (20, {"a": 0.2, "b": 0.8})], ["a", "b"])
    assert w.at(15) == pytest.approx((0.4, 0.6)) and w.at(0) == pytest.approx((0.6, 0.4))
    per = weight_schedule({"a": [(10, 0.6), (20, 0.2)], "b": 0.4}, ["a", "b"])  # per source, as recipes write it
    assert per.raw(15) == pytest.approx((0.4, 0.4)) and per.at(30) == pytest.approx((1 / 3, 2 / 3))


@pytest.mark.parametrize(("weights", "message"), [
    ({"a": -0.1, "b": 1}, "weights: 'a' at step 0 must be >= 0"),
    ({"a": 0, "b": 0}, "weights at step 0 are all zero"),
    ({"a": 1, "b": 1, "c": 1}, "'c' is not a source of the mixture (sources: a, b)"),
    ({"a": 1}, "no weight for source 'b'"),
    ([(20, {"a": 1, "b": 1}), (10, {"a": 1, "b": 2})], "schedule steps must increase; point 1 (step 10)"),
    ({"a": [(5, 1.0), (5, 2.0)], "b": 1}, "schedule steps must increase"),
])
def test_bad_weights_are_one_line_value_errors(weights, message):
    with pytest.raises(ValueError) as e:
        mix({"a": [5, 6], "b": [7]}, weights=weights)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_sources_and_settings_are_one_line_value_errors():
    for kw, message in ((dict(sources={"a": [], "b": [3]}), "source 'a' (a list of lengths) is empty"),
                        (dict(sources={"a b": [3]}), "must be a non-empty string without"),
                        (dict(sources={"a": [3]}, by="bytes"), "by must be one of tokens, docs")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            mix(weights=None, **kw)
    with pytest.raises(ValueError, match="all docs|no tokens to train on"):
        loader(mix({"a": [0, 0], "b": [5]}, weights={"a": 1, "b": 1}), world=1)
    with pytest.raises(ValueError, match="max_seq_len: schedule steps must increase"):
        loader([5, 6], max_seq_len=[(20, 64), (10, 32)], world=1)
    with pytest.raises(ValueError, match="order='strict' keeps the source order: pass shuffle=False"):
        loader([5, 6], order="strict", world=1)


# ---- the mixture source ------------------------------------------------------------------------


def test_doc_ids_are_laid_end_to_end_in_name_order_and_tokens_route(shard_mix):
    m = bl.mix(shard_mix, weights=WEIGHTS)
    assert isinstance(m, MixtureSource) and m.names == ("code", "math", "web")
    sizes = [shard_mix[n].num_docs for n in m.names]
    assert m.num_docs == sum(sizes) and list(m.offsets) == [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
    for d in (0, sizes[0] - 1, sizes[0], m.num_docs - 1):
        name, local = m.split_id(d)
        assert m.join_id(name, local) == d
        assert np.array_equal(m.tokens(d), shard_mix[name].tokens(local))
    ref = np.concatenate([np.asarray(shard_mix[n].lengths) for n in m.names])
    ids = np.random.default_rng(0).integers(0, m.num_docs, 50)
    assert np.array_equal(m.lengths[ids], ref[ids]) and np.array_equal(m.lengths[3:9], ref[3:9])
    assert int(m.lengths[-1]) == ref[-1] and np.array_equal(np.asarray(m.lengths), ref)
    assert isinstance(m.lengths, ConcatLengths) and m.num_tokens == int(ref.sum())
    with pytest.raises(ValueError, match="itself a mixture"):
        mix({"x": m})


def test_every_step_holds_each_sources_share_and_the_run_total_is_on_the_weights(shard_mix):
    m = mix(shard_mix, weights=WEIGHTS)
    batches = take(loader(m, validate=True), 60)
    total = dict.fromkeys(m.names, 0)
    for b in batches:
        tokens = b.plan.tokens
        assert sum(b.mixture_tokens.values()) == tokens
        for n in m.names:
            assert abs(b.mixture_tokens[n] - WEIGHTS[n] * tokens) <= 1024, (b.step, b.mixture_tokens)
            total[n] += b.mixture_tokens[n]
    grand = sum(total.values())
    for n in m.names:
        assert abs(total[n] / grand - WEIGHTS[n]) <= 0.005 * WEIGHTS[n] + 1e-9, total


def test_shares_by_docs(shard_mix):
    m = mix(shard_mix, weights={"code": 1, "math": 1, "web": 2}, by="docs")
    st = stream_for(m, seed=1, shuffle=True, window=64, max_seq_len=schedule(1024, "L"),
                    global_batch_tokens=schedule(32768, "B"), long_docs="split")
    cur = st.epoch_start(0)
    for _ in range(20):
        c = st.cut(cur)
        cur = c.end
        part = np.searchsorted(m.offsets, np.unique(c.items.doc_ids), side="right") - 1
        docs = np.bincount(part, minlength=3)
        assert np.all(np.abs(docs - np.asarray(m.weights.at(0)) * docs.sum()) <= 2), docs


def test_each_source_delivers_every_doc_n_or_n_plus_1_times_at_every_step(shard_mix):
    m = mix(shard_mix, weights=WEIGHTS)  # math (40 docs) repeats many times while web is read once
    counts = [np.zeros(shard_mix[n].num_docs, dtype=np.int64) for n in m.names]
    for b in take(loader(m, world=2, epochs=1), 10_000):
        docs = np.unique([d for d, _, _ in segments(b)])  # a doc is in a step at most once (plans are validated)
        part = np.searchsorted(m.offsets, docs, side="right") - 1
        for j in range(len(m.names)):
            np.add.at(counts[j], docs[part == j] - m.offsets[j], 1)
            assert counts[j].max() - counts[j].min() <= 1, (b.step, m.names[j])
    # epochs=1 ended with the step in which every source had been read once (the small ones more often)
    assert all(c.min() >= 1 for c in counts) and counts[1].max() >= 2 and counts[2].min() == 1


def test_a_weight_schedule_moves_every_steps_shares(shard_mix):
    w = [(10, {"web": 0.6, "code": 0.3, "math": 0.1}), (20, {"web": 0.2, "code": 0.2, "math": 0.6})]
    m = mix(shard_mix, weights=w)
    for b in take(loader(m), 26):
        want = dict(zip(m.names, m.weights.at(b.step)))
        tokens = sum(b.mixture_tokens.values())
        for n in m.names:
            assert abs(b.mixture_tokens[n] - want[n] * tokens) <= 1024, (b.step, n)
    assert m.weights.at(15) == pytest.approx((0.25, 0.35, 0.4))


@pytest.mark.parametrize("long_docs", ["split", "truncate", "drop"])
def test_a_max_seq_len_schedule_limits_every_step(shard_mix, long_docs):
    m = mix(shard_mix, weights=WEIGHTS)
    limits = [(0, 128), (6, 1024)]
    sc = schedule(limits, "max_seq_len")
    seen = []
    for b in take(loader(m, max_seq_len=limits, long_docs=long_docs, validate=True), 9):
        longest = max(n for _, _, n in segments(b))
        assert longest <= sc.at(b.step)
        seen.append(longest)
        if long_docs == "truncate":  # validate checked each doc ends at min(length, the step's limit)
            assert all(s == 0 for _, s, _ in segments(b))
    assert seen[0] <= 128 and max(seen) > 128 and sc.at(8) == 1024


def test_a_global_batch_tokens_ramp(shard_mix):
    ramp = [(0, 4096), (5, 32768)]
    sc = schedule(ramp, "global_batch_tokens")
    got = [b.plan.tokens for b in take(loader(mix(shard_mix, weights=WEIGHTS), global_batch_tokens=ramp), 8)]
    assert all(t <= sc.at(k) for k, t in enumerate(got)) and got[0] < 4097 and got[7] > 16384


def test_a_constant_schedule_gives_the_plain_loaders_batches(shard_mix):
    src = shard_mix["web"]
    plain = [(b.epoch, b.step_in_epoch, b.plan.fingerprint()) for b in loader(src, epochs=2)]
    sched = [(b.epoch, b.step_in_epoch, b.plan.fingerprint())
             for b in loader(src, epochs=2, global_batch_tokens=[(0, 16384), (10_000, 16385)])]
    assert plain == sched and plain[-1][0] == 1


def test_strict_order_keeps_each_sources_file_order(shard_mix):
    m = mix(shard_mix, weights=WEIGHTS)
    order = []
    for b in take(loader(m, shuffle=False, order="strict"), 12):
        step_docs = {d for d, _, _ in segments(b)}
        order.extend(sorted(step_docs))  # inside a step a planner may place docs anywhere
    ids = np.asarray(order)
    part = np.searchsorted(m.offsets, ids, side="right") - 1
    for j in range(3):
        mine = ids[part == j] - m.offsets[j]
        first = mine[: np.argmax(mine[1:] < mine[:-1]) + 1] if (np.diff(mine) < 0).any() else mine
        assert np.array_equal(first, np.arange(len(first)))  # 0, 1, 2, ... until the source wraps around


def test_resume_after_step_7_at_another_world_size_gives_the_same_global_batches(shard_mix):
    m = mix(shard_mix, weights=[(0, WEIGHTS), (12, {"web": 0.2, "code": 0.2, "math": 0.6})])
    sched = {"max_seq_len": [(0, 256), (10, 1024)], "global_batch_tokens": [(0, 8192), (8, 16384)]}
    ref = take(loader(m, world=4, **sched), 16)
    first = loader(m, world=4, **sched)
    take(first, 7)
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint is JSON
    for world, rank in ((2, 1), (4, 3)):
        again = loader(m, world=world, rank=rank, **sched)
        again.load_state_dict(state)
        got = take(again, 9)
        assert [b.step for b in got] == list(range(7, 16))
        assert [segments(b) for b in got] == [segments(b) for b in ref[7:]]
        assert [b.mixture_tokens for b in got] == [b.mixture_tokens for b in ref[7:]]
        if world == 4:  # same world: bitwise the same plans
            assert [b.plan.fingerprint() for b in got] == [b.plan.fingerprint() for b in ref[7:]]
    other = loader(mix(shard_mix, weights=WEIGHTS), world=2, **sched)
    with pytest.raises(ValueError, match="mixture"):
        other.load_state_dict(state)


def test_every_rank_gets_the_mixtures_tokens_and_the_same_mixture_counts(shard_mix):
    m = mix(shard_mix, weights=WEIGHTS)
    per_rank = [take(loader(m, rank=r, world=4, global_batch_tokens=4096), 3) for r in range(4)]
    for step in range(3):
        assert len({json.dumps(ranks[step].mixture_tokens) for ranks in per_rank}) == 1
        read = 0
        for ranks in per_rank:
            for mb in ranks[step].microbatches:
                o = 0
                for d, s, n in mb.segments:  # runs of input_ids: each a piece of one source's doc
                    if d >= 0:
                        name, local = m.split_id(d)
                        assert np.array_equal(mb.input_ids[o:o + n], shard_mix[name].tokens(local)[s:s + n])
                        read += n
                    o += n
        assert read == per_rank[0][step].plan.tokens


# ---- the command line ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def length_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixlens")
    rng = np.random.default_rng(5)
    paths = {}
    for name, n, hi in (("web", 3000, 4000), ("code", 2000, 1500), ("math", 300, 4000)):
        paths[name] = str(d / f"{name}.npy")
        np.save(paths[name], rng.integers(1, hi, n).astype(np.int64))
    paths["empty"] = str(d / "empty.npy")
    np.save(paths["empty"], np.zeros(0, dtype=np.int64))
    return paths


def run_cli(capsys, argv):
    from balanced_loader import cli

    rc = cli.main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def mix_args(files, weights=("0.6", "0.3", "0.1")):
    return ["--mix", *(f"{n}={files[n]}:{w}" for n, w in zip(("web", "code", "math"), weights))]


def test_plan_on_a_mixture_with_schedules_writes_valid_steps_that_follow_them(capsys, tmp_path, length_files):
    out = tmp_path / "plan.json"
    rc, table, err = run_cli(capsys, ["plan", *mix_args(length_files, ("0.6", "0.3", "0.1@10,0.6@20")),
                                  "--world-size", "4", "--cost", "analytic:tiny@cpu", "--policy", "hydra",
                                  "--global-batch-tokens", "32768", "--max-seq-len", "512@0,4096@20",
                                  "--long-docs", "truncate", "--steps", "22", "--out", str(out)])
    assert rc == 0, err
    plan = bl.Plan.from_json(json.loads(out.read_text()))
    sc = schedule([(0, 512), (20, 4096)], "L")
    longest = [max(n for p in s.pools for mb in p.microbatches for g in mb for _, _, n in g.segments)
               for s in plan.steps]
    assert all(x <= sc.at(k) for k, x in enumerate(longest)) and longest[-1] > 2048
    assert "shares" in table and "math 10." in table  # the step table shows each source's share


def test_compare_and_analyze_take_a_mixture(capsys, tmp_path, length_files):
    from pngcheck import assert_png

    rc, out, err = run_cli(capsys, ["compare", *mix_args(length_files), "--policies", "maxlen,hydra",
                                    "--world-size", "4", "--cost", "analytic:tiny@cpu", "--global-batch-tokens",
                                    "32768", "--steps", "3", "--out", str(tmp_path / "cmp")])
    assert rc == 0, err
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert len(report["settings"]["mixture_tokens"]) == 3 and {r["policy"] for r in report["policies"]} == \
        {"maxlen", "hydra"}
    rc, out, err = run_cli(capsys, ["analyze", *mix_args(length_files), "--global-batch-tokens", "32768",
                                    "--steps", "8", "--out", str(tmp_path / "an")])
    assert rc == 0, err
    rep = json.loads((tmp_path / "an" / "analyze.json").read_text())["mixture"]
    assert [s["name"] for s in rep["sources"]] == ["code", "math", "web"] and len(rep["steps"]) == 8
    assert rep["sources"][2]["stats"]["docs"] == 3000 and abs(rep["sources"][2]["share"] - 0.6) < 0.02
    assert_png(str(tmp_path / "an" / "mixture.png"))
    assert "worst step" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--mix", "web={web}:-0.5", "code={code}:1"], "'web' at step 0 must be >= 0"),
    (["--mix", "web={web}:0", "code={code}:0"], "weights at step 0 are all zero"),
    (["--mix", "web={web}:0.5@20,0.1@10", "code={code}:1"], "schedule steps must increase"),
    (["--mix", "web={web}:1", "code={code}:1", "--max-seq-len", "4096@20,512@0"], "schedule steps must increase"),
    (["--mix", "web={web}:1", "nosuch=/no/such/folder:1"], "source /no/such/folder does not exist"),
    (["--mix", "web={web}:1", "empty={empty}:1"], "source 'empty' (lengths file"),
    (["--mix", "web={web}", "code={code}:1"], "is not NAME=PATH:WEIGHT"),
    (["--mix", "web={web}:1", "web={code}:1"], "source name 'web' is given twice"),
    (["--mix", "web={web}:1", "code={code}:1", "--global-batch-tokens", "0@0,5@4"], "must be >= 1"),
])
def test_bad_mixture_input_is_one_line_and_exit_2(capsys, length_files, argv, message):
    argv = [a.format(**length_files) for a in argv]
    budget = [] if "--global-batch-tokens" in argv else ["--global-batch-tokens", "8192"]
    rc, out, err = run_cli(capsys, ["plan", *argv, *budget, "--world-size", "2", "--cost", "analytic:tiny@cpu",
                                    "--policy", "greedy", "--steps", "1"])
    assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_weight_for_a_source_that_does_not_exist_in_the_api():
    with pytest.raises(ValueError, match=r"'wbe' is not a source of the mixture \(sources: code, web\)"):
        mix({"web": [5, 6], "code": [7]}, weights={"wbe": 1.0, "code": 1.0, "web": 1.0})
