"""Reliability II (issue 24), the API and CLI cases as tables: nothing partial or changed opens as data,
no silent re-index, bounded resources, one line for every mistake.

Every API case is one ``ValueError`` matching its pattern, raised at once, with nothing written into the
fixture folders; every CLI case is exit code 2 and one stderr line, no traceback, nothing written.
The multi-process cases (locks, a full disk) are in ``test_outputs_mp.py`` and
``tests/parallel_runtime/test_run_outputs.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
from test_cli_errors import GOOD_COST

import balanced_loader as bl
from balanced_loader import cli
from balanced_loader.build.builder import build_from_files
from balanced_loader.build.reindex import reindex_folder
from balanced_loader.build.writer import write_shards
from balanced_loader.data.shards import ShardSource
from balanced_loader.strict import read_yaml

BYTES = {"name": "bytes", "vocab_size": 256}


def _docs(n: int = 40, seed: int = 0, shift: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [((rng.integers(0, 250, size=int(k)) + shift) % 250).astype(np.uint8) for k in rng.integers(1, 300, size=n)]


def _jsonl(path, ch: str) -> str:
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": ch * (i + 5)}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Read-only fixtures (each case copies what it changes): a shard folder, one with the same lengths and
    other tokens, the two parts of a build, a part of another build of same-named, same-sized inputs."""
    root = tmp_path_factory.mktemp("rel2")
    write_shards(_docs(), str(root / "good"), dtype=np.uint8, tokenizer=BYTES, max_shard_bytes=3000)
    write_shards(_docs(shift=1), str(root / "other_tokens"), dtype=np.uint8, tokenizer=BYTES, max_shard_bytes=3000)
    for name, ch in (("a", "x"), ("b", "y")):
        (root / f"in_{name}").mkdir()
        _jsonl(root / f"in_{name}" / "c.jsonl", ch)  # the same name and size, other bytes
    for k in (0, 1):
        build_from_files([str(root / "in_a" / "c.jsonl")], str(root / f"a{k}"), part=(k, 2))
    build_from_files([str(root / "in_b" / "c.jsonl")], str(root / "b1"), part=(1, 2))
    (root / "cost.yaml").write_text(GOOD_COST)
    (root / "l.txt").write_text("\n".join(str(x) for x in [100, 200, 300, 50] * 10) + "\n")
    return root


def _copy(env, name: str, tmp_path) -> str:
    dst = tmp_path / name
    shutil.copytree(env / name, dst)
    return str(dst)


def _loader(src, **kw):
    args = dict(policy="greedy", cost=_cost(), world_size=2, rank=0, global_batch_tokens=1000)
    args.update(kw)
    return bl.BalancedLoader(src, **args)


def _cost():
    from balanced_loader.cost import CostModel
    from balanced_loader.strict import yaml_loads

    return CostModel.from_dict(yaml_loads(GOOD_COST), where="cost")


# ---- opening data: never partial, never re-indexed, never another build's ----------------------------


def _deleted_index(env, tmp):
    d = _copy(env, "good", tmp)
    for f in os.listdir(d):
        if f.startswith("index"):
            os.remove(os.path.join(d, f))
    bl.open_source(d)


def _stray_shard(env, tmp):
    d = _copy(env, "good", tmp)
    shutil.copy(os.path.join(env, "other_tokens", "shard-000000.tar"), os.path.join(d, "shard-000099.tar"))
    bl.open_source(d)


def _missing_shard(env, tmp):
    d = _copy(env, "good", tmp)
    os.remove(os.path.join(d, "shard-000003.tar"))
    bl.open_source(d)


def _changed_size(env, tmp):
    d = _copy(env, "good", tmp)
    with open(os.path.join(d, "shard-000001.tar"), "ab") as f:
        f.write(b"\0" * 512)
    bl.open_source(d)


def _crc_disagrees(env, tmp):
    d = _copy(env, "good", tmp)
    with open(os.path.join(d, "shards.json")) as f:
        meta = json.load(f)
    meta["shards"][2]["crc32"] ^= 1
    with open(os.path.join(d, "shards.json"), "w") as f:
        json.dump(meta, f)
    bl.open_source(d)


def _same_lengths_other_tokens(env, tmp):
    a = _loader(str(env / "good"))
    next(a)
    state = a.state_dict()
    _loader(str(env / "other_tokens")).load_state_dict(state)


def _cursor_inside_a_step(env, tmp):
    a = _loader(str(env / "good"))
    next(a), next(a)
    state = a.state_dict()
    state["position"]["cursor"]["sources"]["data"]["unit"] += 1
    _loader(str(env / "good")).load_state_dict(state)


def _cursor_on_another_step(env, tmp):
    a = _loader(str(env / "good"))
    next(a), next(a), next(a)
    state = a.state_dict()
    b = _loader(str(env / "good"))
    next(b)
    moved = b.state_dict()["position"]["cursor"]
    state["position"]["cursor"] = {**moved, "step": 3, "step_in_epoch": 3}
    _loader(str(env / "good")).load_state_dict(state)


def _hf_none_row(env, tmp):
    datasets = pytest.importorskip("datasets")
    bl.open_source(datasets.Dataset.from_dict({"input_ids": [[1, 2], None, [3]]}))


def _wrap_ids(bad):
    def case(env, tmp):
        loader = bl.wrap([np.array([1, bad, 4])] * 4, global_batch_tokens=100, cost=_cost(),
                         world_size=1, rank=0, policy="greedy")
        next(loader)
    return case


def _dup_cost(env, tmp):
    p = tmp / "dup.yaml"
    p.write_text(GOOD_COST + "linear_ms: 5.0\n")
    bl.CostModel.from_file(str(p))


def _list_yaml(env, tmp):
    p = tmp / "list.yaml"
    p.write_text("- seed: 1\n- steps: 2\n")
    read_yaml(str(p), "recipe", mapping=True)


def _graph_gpus(env, tmp):
    from balanced_loader.spindle.graph import graph_from_dict

    graph_from_dict({"gpus": 10**10, "metaops": [{"name": "a", "task": "a", "layers": 2, "batch": 8,
                                                    "alpha_ms": 1, "beta_ms": 1}]})


def _candidate_units(env, tmp):
    from balanced_loader.planning.solvers.candidates import generate

    cost = bl.CostModel.from_dict({**json.loads(json.dumps(read_yaml(str(env / "cost.yaml"), "cost"))),
                                   "strategies": [{"tp": 2, "pp": 1, "max_tokens_per_lane": 2000}]}, where="cost")
    generate(np.arange(1, 500), None, cost, 1 << 20)


def _candidate_bins(env, tmp):
    from balanced_loader.planning.solvers.candidates import generate

    cost = bl.CostModel.from_dict({**read_yaml(str(env / "cost.yaml"), "cost"), "max_tokens_per_lane": 9000,
                                   "strategies": [{"tp": 2, "pp": 1, "max_tokens_per_lane": 9000}]}, where="cost")
    generate(np.arange(1, 8000), None, cost, 8, delta_s=1)


API_CASES = {
    "a deleted index": (_deleted_index, r"has no length index \(index.json\); rebuild the index with: balanced-loader "
                                        r"index .*good"),
    "a stray shard": (_stray_shard, r"shard-000099.tar is not in index.json \(a stray or added shard\)"),
    "a missing shard": (_missing_shard, r"shard-000003.tar listed in index.json is missing"),
    "a changed shard size": (_changed_size, r"shard-000001.tar has \d+ bytes but index.json recorded"),
    "a shards.json crc32 the index does not have": (_crc_disagrees, r"index.json records crc32 \d+ for shard "
                                                                    r"shard-000002.tar but shards.json records"),
    "one part alone": (lambda env, tmp: bl.open_source(str(env / "a1")),
                       r"a1 is part 1/2 of a build-shards --part build, not a whole dataset"),
    "parts of two builds (same names and sizes)": (lambda env, tmp: bl.open_source([str(env / "a0"), str(env / "b1")]),
                                                  r"inputs of different content \(the same file names and sizes"),
    "a state of the same lengths, other tokens": (_same_lengths_other_tokens,
                                                  r"tokens_fingerprint=.* \(the source changed\)"),
    "a cursor moved inside a step": (_cursor_inside_a_step,
                                     r"source\(s\) data are not where step 2 begins \(a cursor moved inside a step"),
    "a cursor on another step's start": (_cursor_on_another_step, r"source\(s\) data are not where step 3 begins"),
    "world_size=10**9": (lambda env, tmp: _loader([100] * 10, world_size=10**9),
                         r"world_size must be in 1..1,048,576, got 1,000,000,000"),
    "planner_workers=10**6": (lambda env, tmp: _loader([100] * 10, planner_workers=10**6),
                              r"planner_workers must be in 0..\d+ \(2 x the \d+ CPU core"),
    "prefetch_steps=10**9": (lambda env, tmp: _loader([100] * 10, prefetch_steps=10**9),
                             r"prefetch_steps must be in 0..256"),
    "seed=-1": (lambda env, tmp: _loader([100] * 10, seed=-1), r"seed must be in 0..9,223"),
    "seed=None": (lambda env, tmp: _loader([100] * 10, seed=None), r"seed must be an integer, got None"),
    "prefetch_steps='2'": (lambda env, tmp: _loader([100] * 10, prefetch_steps="2"),
                           r"prefetch_steps must be an integer, got '2' \(str\)"),
    "global_batch_tokens=True": (lambda env, tmp: _loader([100] * 10, global_batch_tokens=True),
                                 r"global_batch_tokens must be an integer, got True \(bool\)"),
    "max_seq_len=True": (lambda env, tmp: _loader([100] * 10, max_seq_len=True), r"max_seq_len must be an integer"),
    "epochs=True": (lambda env, tmp: _loader([100] * 10, epochs=True), r"epochs must be an integer"),
    "shuffle='yes'": (lambda env, tmp: _loader([100] * 10, shuffle="yes"), r"shuffle must be True or False"),
    "pad_id=-1": (lambda env, tmp: _loader([100] * 10, pad_id=-1), r"pad_id must be in 0..4,294,967,295, got -1"),
    "pad_id=2**40": (lambda env, tmp: _loader([100] * 10, pad_id=2**40), r"pad_id must be in 0..4,294,967,295"),
    "pad_id past the source's vocabulary": (lambda env, tmp: _loader(str(env / "good"), pad_id=256),
                                            r"pad_id 256 is outside the vocabulary of shard folder .*\(256 ids"),
    "wrap() token id -3": (_wrap_ids(-3), r"sample 0 holds token id -3, outside the 32-bit id range"),
    "wrap() token id 2**40": (_wrap_ids(2**40), r"sample 0 holds token id 1099511627776, outside"),
    "a Hugging Face None row": (_hf_none_row, r"row 1 of column 'input_ids' is None \(null\)"),
    "a cost file with a duplicate key": (_dup_cost, r"dup.yaml: duplicate key 'linear_ms' on line 7 \(first given "
                                                    r"on line 2\)"),
    "a YAML list where a mapping belongs": (_list_yaml, r"must be a YAML mapping \(key: value lines\), but its "
                                                        r"document is a list of 2 item"),
    "graph gpus 10**10": (_graph_gpus, r"'gpus' must be <= 1048576, got 10000000000"),
    "candidates for 2**20 GPUs": (_candidate_units, r"1,048,576 GPU units, over 4,096 .* delta_n of at least 256"),
    "candidates with 8,000 length bins": (_candidate_bins, r"cuts the lengths into 7,999 bins, over 1,024"),
    "read_timeout_s=0": (lambda env, tmp: bl.open_source("http://127.0.0.1:9/x", read_timeout_s=0),
                         r"read_timeout_s must be a number of seconds in \(0, 1e6\]"),
}


def _listing(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_mistakes_are_one_value_error_at_once_and_write_nothing(case, env, tmp_path):
    fn, pattern = API_CASES[case]
    fixtures, t0 = _listing(env), time.perf_counter()
    with pytest.raises(ValueError, match=pattern) as info:
        fn(env, tmp_path)
    assert "\n" not in str(info.value)
    assert time.perf_counter() - t0 < 20  # at once (generous: a loaded 2-core box), never minutes or a hang
    assert _listing(env) == fixtures  # no index built, nothing added to the fixture folders
    assert not [f for f in _listing(tmp_path) if os.path.basename(f).startswith("index.")
                and not os.path.exists(env / "good" / os.path.basename(f))]


def _index_files(folder: str) -> dict[str, bytes]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.startswith("index"):
            with open(os.path.join(folder, f), "rb") as fh:
                out[f] = fh.read()
    return out


def test_the_explicit_index_command_rebuilds_what_opening_refuses(env, tmp_path, capsys):
    d = _copy(env, "good", tmp_path)
    shards = len(ShardSource(d).shard_names)
    want = _index_files(d)
    for f in want:
        os.remove(os.path.join(d, f))
    assert cli.main(["index", d, "--no-progress"]) == 0
    assert f"checked {shards} shard crc32(s) and 40 doc checksum(s)" in capsys.readouterr().out
    assert _index_files(d) == want  # the writer's index, byte for byte
    src = bl.open_source(d)
    assert src.max_token_id == max(int(x.max()) for x in _docs())
    # a corrupted doc is never indexed: the checksums it recorded refuse it
    path, off = src.location(7)
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    for f in want:
        os.remove(os.path.join(d, f))
    with pytest.raises(ValueError, match=r"crc32 [0-9a-f]{8} differs from the [0-9a-f]{8} shards.json recorded"):
        reindex_folder(d)
    assert not [f for f in os.listdir(d) if f.startswith("index")]  # nothing written


def test_a_part_alone_opens_when_asked_and_parts_carry_a_content_hash(env):
    with bl.open_source(str(env / "a1"), allow_part=True) as one:
        assert one.index["part"] == {"index": 1, "count": 2, "input_bytes": one.index["part"]["input_bytes"]}
    a1, b1 = (json.loads((env / n / "shards.json").read_text())["inputs"] for n in ("a1", "b1"))
    assert a1["sha256"] == b1["sha256"] and a1["content"] != b1["content"]  # names and sizes agree, bytes do not
    with bl.open_source([str(env / "a1"), str(env / "a0")]) as both:
        assert both.num_docs == 40


def test_loader_states_carry_a_tokens_fingerprint_and_resume_exactly(env):
    a = _loader(str(env / "good"))
    next(a), next(a)
    state = a.state_dict()
    assert state["tokens_fingerprint"] == bl.open_source(str(env / "good")).tokens_fingerprint() is not None
    b = _loader(str(env / "good"))
    b.load_state_dict(state)
    assert [s for s in (next(b).plan.doc_ids().tolist(),)] == [next(a).plan.doc_ids().tolist()]
    old = dict(state)
    old.pop("tokens_fingerprint")  # a state from before the fingerprint still loads (checked without it)
    _loader(str(env / "good")).load_state_dict(old)


# ---- the command line -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_env(env, tmp_path_factory):
    """Inputs of the CLI cases (the commands' mistakes must write nothing beside them)."""
    root = tmp_path_factory.mktemp("rel2cli")
    shutil.copytree(env / "good", root / "noindex")
    for f in os.listdir(root / "noindex"):
        if f.startswith("index"):
            os.remove(root / "noindex" / f)
    shutil.copytree(env / "good", root / "stray")
    shutil.copy(env / "other_tokens" / "shard-000000.tar", root / "stray" / "shard-000099.tar")
    shutil.copytree(env / "a1", root / "a1")
    (root / "cost.yaml").write_text(GOOD_COST)
    (root / "dup.yaml").write_text(GOOD_COST + "linear_ms: 5.0\n")
    (root / "list.yaml").write_text("- quadratic_ms: 1\n")
    (root / "l.txt").write_text("\n".join(str(x) for x in range(1, 8000, 2)) + "\n")
    (root / "scost.yaml").write_text(GOOD_COST.replace("max_tokens_per_lane: 1000", "max_tokens_per_lane: 9000")
                                     + "strategies:\n  - {tp: 2, pp: 1, max_tokens_per_lane: 9000}\n")
    (root / "g_gpus.yaml").write_text("gpus: 10000000000\nmetaops:\n  - {name: a, task: a, layers: 2, batch: 8, "
                                      "alpha_ms: 1, beta_ms: 1}\n")
    (root / "g_zero.yaml").write_text("gpus: 4\ngpus_per_node: 4\nmetaops:\n  - {name: a, task: a, layers: 2, "
                                      "batch: 4, alpha_ms: 0, beta_ms: 0}\n")
    (root / "full").mkdir()
    (root / "full" / "keep.txt").write_text("the user's file")
    (root / "latin1").mkdir()
    (root / "latin1" / "a.txt").write_bytes(b"caf\xe9 au lait")
    return root


def _hf_tokenizer_file(root) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    path = root / "tokenizer.json"
    if not path.exists():
        tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator(["hello world, cafe au lait"] * 20, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        tok.save(str(path))
    return str(path)


PLAN = ["plan", "--world-size", "2", "--cost-file", "{d}/cost.yaml", "--policy", "greedy", "--out", "{d}/out.json"]
CLI_CASES = {
    "plan --source: a folder without its index": (
        [*PLAN, "--source", "{d}/noindex"], r"has no length index \(index.json\); rebuild the index with: "
                                            r"balanced-loader index .*noindex"),
    "analyze: a folder with a stray shard": (["analyze", "{d}/stray", "--out", "{d}/an"],
                                             r"shard-000099.tar is not in index.json"),
    "index: a stray shard the build never recorded": (["index", "{d}/stray", "--no-progress"],
                                                      r"shard-000099.tar is not one of the shards shards.json records"),
    "plan --source: one part alone": ([*PLAN, "--source", "{d}/a1"], r"a1 is part 1/2 of a build-shards --part build"),
    "plan: a cost file with a duplicate key": (
        ["plan", "--lengths", "{d}/l.txt", "--world-size", "2", "--cost-file", "{d}/dup.yaml", "--policy", "greedy",
         "--out", "{d}/out.json"], r"duplicate key 'linear_ms' on line 7"),
    "plan: a cost file that is a list": (
        ["plan", "--lengths", "{d}/l.txt", "--world-size", "2", "--cost-file", "{d}/list.yaml", "--policy", "greedy",
         "--out", "{d}/out.json"], r"list.yaml must be a YAML mapping"),
    "waves: gpus 10**10 in the graph file": (["waves", "--graph", "{d}/g_gpus.yaml"], r"'gpus' must be <= 1048576"),
    "waves: a MetaOp that takes no time": (["waves", "--graph", "{d}/g_zero.yaml"],
                                           r"alpha_ms \+ beta_ms is 0; a layer must take some time"),
    "candidates --world-size 1048576": (
        ["candidates", "--lengths", "{d}/l.txt", "--world-size", "1048576", "--cost-file", "{d}/scost.yaml",
         "--out", "{d}/c.yaml"], r"1,048,576 GPU units, over 4,096"),
    "candidates --delta-s 1": (
        ["candidates", "--lengths", "{d}/l.txt", "--world-size", "8", "--cost-file", "{d}/scost.yaml", "--delta-s", "1",
         "--out", "{d}/c.yaml"], r"cuts the lengths into 4,000 bins, over 1,024 .* delta_s of at least 8"),
    "build-shards into a folder that holds files": (["build-shards", "{d}/l.txt", "--out", "{d}/full", "--no-progress"],
                                                    r"shard folder .*full already holds files \(keep.txt\)"),
    "build-shards: non-UTF-8 text for a Hugging Face tokenizer": (
        ["build-shards", "{d}/latin1", "--out", "{d}/o", "--tokenizer", "{tok}", "--no-progress"],
        r"a.txt is not valid UTF-8 text \(byte 0xe9 at offset 3\); .* --decode-errors replace"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_mistakes_are_one_line_exit_2_and_write_nothing(case, cli_env, capsys):
    argv, pattern = CLI_CASES[case]
    tok = _hf_tokenizer_file(cli_env) if any("{tok}" in a for a in argv) else ""
    before, t0 = _listing(cli_env), time.perf_counter()
    rc = cli.main([a.format(d=cli_env, tok=tok) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert pytest.importorskip("re").search(pattern, err), err
    assert time.perf_counter() - t0 < 20
    assert _listing(cli_env) == before  # no output, no index, no lock or staging folder left


def test_verify_reports_a_stray_shard_instead_of_taking_it_in(cli_env, capsys):
    assert cli.main(["verify", str(cli_env / "stray")]) == 2
    assert "shard-000099.tar is not in index.json (a stray or added shard)" in capsys.readouterr().out


def test_decode_errors_replace_is_counted(cli_env, tmp_path, capsys):
    tok = _hf_tokenizer_file(cli_env)
    out = tmp_path / "o"
    assert cli.main(["build-shards", str(cli_env / "latin1"), "--out", str(out), "--tokenizer", tok,
                     "--decode-errors", "replace", "--no-progress"]) == 0
    assert "note: 1 doc(s) were not valid UTF-8" in capsys.readouterr().out
    assert json.loads((out / "shards.json").read_text())["decode_errors"] == {"docs": 1, "replaced_with": "U+FFFD"}


def test_a_glob_through_a_symlink_loop_ends_and_takes_each_file_once(tmp_path, capsys):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "x.txt").write_text("one")
    (tmp_path / "a" / "b" / "y.txt").write_text("two")
    os.symlink("..", tmp_path / "a" / "b" / "up")  # a/b/up/b/up/... loops
    os.symlink(str(tmp_path / "a"), tmp_path / "a" / "b" / "again")
    t0 = time.perf_counter()
    assert cli.main(["build-shards", str(tmp_path / "a" / "**" / "*.txt"), "--out", str(tmp_path / "o"),
                     "--no-progress"]) == 0
    assert time.perf_counter() - t0 < 20
    assert "2 docs, 6 tokens" in capsys.readouterr().out
    assert sorted(bytes(ShardSource(str(tmp_path / "o")).tokens(d)).decode() for d in range(2)) == ["one", "two"]


def test_compare_and_analyze_publish_their_files_as_a_set(env, tmp_path, monkeypatch, capsys):
    """A failure while writing the last file of the set (here an injected ENOSPC at the chart writer; the
    real full disk is in test_outputs_mp.py) leaves the folder's previous set, byte for byte."""
    import errno

    from balanced_loader.cli import charts

    out = tmp_path / "cmp"
    args = ["compare", "--lengths", str(env / "l.txt"), "--policies", "greedy,maxlen", "--world-size", "2",
            "--cost-file", str(env / "cost.yaml"), "--global-batch-tokens", "1000", "--steps", "2", "--out", str(out)]
    assert cli.main(args) == 0
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    assert sorted(before) == ["compare.json", "rank_load.png", "step_times.png"]

    def full(*a, **k):
        raise OSError(errno.ENOSPC, f"cannot write {a[1]}: No space left on device")

    monkeypatch.setattr(charts, "step_times", full)
    capsys.readouterr()
    assert cli.main([*args, "--shuffle", "--seed", "7"]) == 2
    err = capsys.readouterr().err
    assert "step_times.png: No space left on device (the folder's previous files were kept)" in err
    assert ".tmp" not in err
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before  # the old set, no temporary file


# ---- remote: planning without Range, a read timeout, retries ---------------------------------------


def test_remote_index_plans_without_range_retries_and_times_out(env, tmp_path, capsys, monkeypatch):
    pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    from balanced_loader.data import remote
    from balanced_loader.diagnostics.range_server import RangeServer

    monkeypatch.setattr(remote, "BACKOFF_S", 0.05)  # the same doubling backoff, shorter waits

    local = ShardSource(str(env / "good"))
    with RangeServer(str(env / "good"), ranges=False) as s:  # plan and analyze read the index only
        assert cli.main([*(a.format(d=env) for a in PLAN[:-2]), "--source", s.url, "--global-batch-tokens",
                         "2000", "--out", str(tmp_path / "p.json")]) == 0
        assert not any(k.endswith(".tar") for k in s.bytes_served)
    with RangeServer(str(env / "good"), errors=2, drops=1) as s:  # transient failures: retried with backoff
        src = bl.open_source(s.url)
        s.fail_next(errors=1, drops=1)
        assert np.array_equal(src.tokens(5), local.tokens(5)) and s.faults_served == 5
        s.fail_next(errors=20)  # a server that keeps failing: one line after the retries
        with pytest.raises(ValueError, match=r"HTTP 503 \(Service Unavailable\) after 4 attempts; the server is "
                                             r"failing or overloaded"):
            src.tokens(6)
    # a stalled server: a read fails after read_timeout_s, not after minutes
    listener = __import__("socket").create_server(("127.0.0.1", 0))
    conns = []
    threading.Thread(target=lambda: conns.append(listener.accept()), daemon=True).start()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"no answer within the read timeout of 1 s \(a stalled server"):
        bl.open_source(f"http://127.0.0.1:{listener.getsockname()[1]}/x", read_timeout_s=1)
    assert time.perf_counter() - t0 < 10
    listener.close()
