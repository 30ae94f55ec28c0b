"""Parallel and multi-machine ``build-shards``: ``--workers N`` writes the same bytes as one worker;
``--part K/N`` folders opened together hold exactly the docs of one whole build, in its order;
mismatched part sets are one error line; HF batch encoding equals per-doc encoding."""

from __future__ import annotations

import json
import os
import pickle
import random
import sys

import numpy as np
import pytest

from balanced_loader import cli
from balanced_loader.build.builder import build_from_files, file_sizes, ordered_map, part_range, read_docs, sub_ranges
from balanced_loader.build.writer import write_shards
from balanced_loader.data.open import open_source
from balanced_loader.data.parts import PartsSource
from balanced_loader.data.shards import ShardSource
from balanced_loader.data.sources import LengthSource
from balanced_loader.data.tokenizers import get_tokenizer

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog;", "data", "loaders", "shard",
         "parts", "of", "tokens", "é", "日本", "\U0001f600"]

COST_YAML = """quadratic_ms: 0.0
linear_ms: 1.0
microbatch_ms: 0.0
comm_bytes_per_token: 0.0
bandwidth_gbs: {2: 100.0}
max_tokens_per_lane: 100000
"""


def _text(rng: random.Random, lo: int = 0, hi: int = 60) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def _jsonl(path, rng: random.Random, docs: int, *, blank_every: int = 0, trailing_newline: bool = True) -> str:
    lines = []
    for i in range(docs):
        lines.append(json.dumps({"text": _text(rng), "id": i}, ensure_ascii=rng.random() < 0.5))
        if blank_every and i % blank_every == 0:
            lines.append("   ")
    path.write_text("\n".join(lines) + ("\n" if trailing_newline else ""), encoding="utf-8")
    return str(path)


def _shape(tmp_path, shape: str) -> list[str]:
    """Input sets: one big jsonl, many small files (txt and jsonl, one empty), fewer files than parts."""
    rng = random.Random(shape)
    d = tmp_path / f"in-{shape}"
    d.mkdir()
    if shape == "one-jsonl":
        return [_jsonl(d / "big.jsonl", rng, 400, blank_every=37, trailing_newline=False)]
    if shape == "many-files":
        files = []
        for i in range(25):
            if i % 3 == 0:
                files.append(_jsonl(d / f"f{i:02d}.jsonl", rng, rng.randint(0, 12)))
            else:
                p = d / f"f{i:02d}.txt"
                p.write_text(_text(rng) if i != 4 else "", encoding="utf-8")  # f04.txt: an empty doc
                files.append(str(p))
        return files
    assert shape == "two-files"
    (d / "a.txt").write_text(_text(rng, 5, 9), encoding="utf-8")
    (d / "b.txt").write_text(_text(rng, 5, 9), encoding="utf-8")
    return [str(d / "a.txt"), str(d / "b.txt")]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A tiny byte-level BPE trained here (never downloaded); its vocab > 256, so tokens are uint16."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["[UNK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(0)
    tok.train_from_iterator([_text(rng) for _ in range(200)], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _files_bytes(folder) -> dict[str, bytes]:
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}


def _same_docs(a, b) -> None:
    assert a.num_docs == b.num_docs
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    for d in range(a.num_docs):
        np.testing.assert_array_equal(a.tokens(d), b.tokens(d))
    assert a.fingerprint() == b.fingerprint()


# ---- the part rule on raw docs: every N, every shape -----------------------------------------


@pytest.mark.parametrize("shape", ["one-jsonl", "many-files", "two-files"])
def test_parts_of_the_input_stream_tile_it_in_order(tmp_path, shape):
    files = _shape(tmp_path, shape)
    sizes = file_sizes(files)
    whole = [(d.data, d.jsonl) for d in read_docs(files, sizes)]
    assert whole
    for n in (1, 2, 3, 5, 8, 64):
        parts = [[(d.data, d.jsonl) for d in read_docs(files, sizes, *part_range(sum(sizes), k, n))]
                 for k in range(n)]
        assert [doc for p in parts for doc in p] == whole, n  # contiguous runs of the whole stream, in order
    for step in (3, 97, 1000):  # the byte ranges that workers read follow the same rule
        pieces = [(d.data, d.jsonl) for a, b in sub_ranges(0, sys.maxsize, sum(sizes), step)
                  for d in read_docs(files, sizes, a, b)]
        assert pieces == whole, step
    if shape == "one-jsonl":  # one file: the byte split balances the parts
        counts = [len(list(read_docs(files, sizes, *part_range(sum(sizes), k, 4)))) for k in range(4)]
        assert max(counts) - min(counts) <= 0.2 * len(whole) / 4, counts


# ---- builds ------------------------------------------------------------------------------------


def test_workers_write_the_same_bytes_as_one_worker(tmp_path, hf_tokenizer):
    files = _shape(tmp_path, "many-files") + _shape(tmp_path, "one-jsonl")
    for tok in ("bytes", hf_tokenizer):
        one = tmp_path / f"w1-{os.path.basename(tok)}"
        two = tmp_path / f"w2-{os.path.basename(tok)}"
        kw = {"tokenizer": tok, "max_docs_per_shard": 60, "chunk_docs": 7, "chunk_bytes": 3000}
        m1 = build_from_files(files, str(one), **kw)
        m2 = build_from_files(files, str(two), workers=2, **kw)
        assert m2["build"]["workers"] == 2 and m1["num_docs"] == m2["num_docs"] > 400
        assert len(m1["shards"]) > 3
        assert _files_bytes(one) == _files_bytes(two)  # every shard, the index, the checksums


@pytest.mark.parametrize("shape,n", [("one-jsonl", 2), ("one-jsonl", 3), ("many-files", 2), ("many-files", 4),
                                     ("two-files", 3)])
def test_parts_opened_together_hold_the_whole_build(tmp_path, shape, n):
    files = _shape(tmp_path, shape)
    whole = tmp_path / "whole"
    build_from_files(files, str(whole), max_docs_per_shard=50)
    dirs = []
    for k in range(n):
        d = tmp_path / f"part{k}"
        meta = build_from_files(files, str(d), max_docs_per_shard=50, part=(k, n))
        assert meta["part"]["index"] == k and meta["part"]["count"] == n
        dirs.append(str(d))
    counts = [ShardSource(d, allow_part=True).num_docs if os.path.exists(os.path.join(d, "index.json")) else 0
              for d in dirs]
    if shape == "two-files":
        assert 0 in counts  # fewer docs than parts: a part with no docs is an empty, complete folder
    with ShardSource(str(whole)) as ref, open_source(dirs[::-1]) as parts:  # argument order does not matter
        assert isinstance(parts, PartsSource)
        assert parts.folders == dirs
        _same_docs(ref, parts)
        assert parts.fingerprint() == ref.index["lengths_fingerprint"]  # a loader state carries over
        assert parts.shard_bounds[0] == 0 and parts.shard_bounds[-1] == ref.num_docs
        assert np.all(np.diff(parts.shard_bounds) > 0)
        assert parts.tokenizer == ref.tokenizer and parts.dtype == ref.dtype
        assert parts.num_tokens == ref.num_tokens
        parts.tokens(parts.num_docs - 1)
        assert parts.bytes_read > 0
        back = pickle.loads(pickle.dumps(parts))
        np.testing.assert_array_equal(back.tokens(0), ref.tokens(0))
        back.close()


def test_parts_through_the_cli_and_the_planner(tmp_path, capsys, hf_tokenizer):
    files = _shape(tmp_path, "one-jsonl")
    whole, p0, p1 = (str(tmp_path / x) for x in ("whole", "p0", "p1"))
    assert cli.main(["build-shards", *files, "--out", whole, "--no-progress", "--tokenizer", hf_tokenizer]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("speed: ") and "docs/s" in out[1] and "MB/s" in out[1]
    for k, d in enumerate((p0, p1)):
        assert cli.main(["build-shards", *files, "--out", d, "--part", f"{k}/2", "--workers", "2",
                         "--no-progress", "--tokenizer", hf_tokenizer]) == 0
        assert capsys.readouterr().out.startswith(f"part {k}/2: ")
    with ShardSource(whole) as ref, open_source([p0, p1]) as parts:
        _same_docs(ref, parts)
    cost = tmp_path / "cost.yaml"
    cost.write_text(COST_YAML)
    plans = []
    for src in ([whole], [p1, p0]):
        path = tmp_path / f"plan{len(plans)}.json"
        assert cli.main(["plan", "--source", *src, "--world-size", "2", "--cost-file", str(cost),
                         "--policy", "token-kk", "--global-batch-tokens", "4000", "--out", str(path)]) == 0
        plans.append([{k: v for k, v in st.items() if k != "plan_seconds"}
                      for st in json.loads(path.read_text())["steps"]])
    assert plans[0] == plans[1] and len(plans[0]) > 2  # same docs, same ids, same shards: the same plan


def test_a_list_of_lengths_stays_lengths_and_plain_folders_combine_in_argument_order(tmp_path):
    assert isinstance(open_source([3, 1, 2]), LengthSource)
    a = write_shards([np.arange(5), np.arange(3)], str(tmp_path / "a"))
    b = write_shards([np.arange(7)], str(tmp_path / "b"))
    with open_source([tmp_path / "b", tmp_path / "a"]) as src:  # PathLike; plain folders: argument order
        assert src.lengths.tolist() == [7, 5, 3]
        assert src.shard_bounds.tolist() == [0, 1, 3]
        np.testing.assert_array_equal(src.read(2, 1, 2), a.tokens(1)[1:3])
        np.testing.assert_array_equal(src.tokens(0), b.tokens(0))
        with pytest.raises(ValueError, match="outside 0..2"):
            src.tokens(3)
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="x.jsonl is a file; a list of sources must be shard folders"):
        open_source([str(tmp_path / "a"), str(tmp_path / "x.jsonl")])
    a.close()
    b.close()


def test_hf_batch_encoding_equals_per_doc_encoding(hf_tokenizer):
    tok = get_tokenizer(hf_tokenizer)
    rng = random.Random(5)
    docs = [_text(rng) for _ in range(50)] + ["", " ", "\n\n", "é" * 3, "x" * 5000]
    docs += [d.encode("utf-8") for d in docs[:5]]
    with pytest.raises(ValueError, match="not valid UTF-8"):  # decoding is the caller's (counted) choice
        tok.encode(b"\xff\xfe bad utf-8")
    batch = tok.encode_batch(docs)
    single = [tok.encode(d) for d in docs]
    assert len(batch) == len(single)
    for b, s in zip(batch, single, strict=True):
        assert b.dtype == s.dtype == np.uint16
        np.testing.assert_array_equal(b, s)
    assert max(len(s) for s in single) > 100 and tok.vocab_size > 256
    again = pickle.loads(pickle.dumps(tok))  # workers get the tokenizer this way
    np.testing.assert_array_equal(again.encode(docs[0]), single[0])


# ---- mistakes: one error line, exit 2 ------------------------------------------------------------


@pytest.fixture(scope="module")
def part_dirs(tmp_path_factory, hf_tokenizer):
    """Parts of several builds: 3-way of set A, 2-way of set A and B, a 2-way HF build of A, a plain folder."""
    tmp_path = tmp_path_factory.mktemp("parts")
    rng = random.Random(1)
    a = _jsonl(tmp_path / "a.jsonl", rng, 60)
    b = _jsonl(tmp_path / "b.jsonl", rng, 60)
    out = {}
    for name, files, n, tok in (("a3", [a], 3, None), ("a2", [a], 2, None), ("b2", [b], 2, None),
                                ("h2", [a], 2, hf_tokenizer)):
        for k in range(n):
            out[f"{name}.{k}"] = str(tmp_path / f"{name}.{k}")
            build_from_files(files, out[f"{name}.{k}"], tokenizer=tok, part=(k, n))
    out["plain"] = str(tmp_path / "plain")
    build_from_files([a], out["plain"])
    write_shards([np.arange(4)], str(tmp_path / "u8"), dtype=np.uint8).close()
    write_shards([np.arange(4)], str(tmp_path / "u16"), dtype=np.uint16).close()
    out["u8"], out["u16"] = str(tmp_path / "u8"), str(tmp_path / "u16")
    out["cost"] = str(tmp_path / "cost.yaml")
    (tmp_path / "cost.yaml").write_text(COST_YAML)
    return out


BAD_SETS = {
    "a part missing": (["a3.0", "a3.2"], r"part 1 of 3 missing \(got parts 0, 2\)"),
    "a part twice": (["a2.0", "a2.1", "a2.0"], r"part 0/2 is given twice: .*a2\.0 and .*a2\.0"),
    "different N": (["a2.0", "a3.1", "a3.2"], r"a2\.0 is part 0/2 but .*a3\.1 is part 1/3"),
    "different input sets": (["a2.0", "b2.1"], r"a2\.0 and .*b2\.1 were built from input sets \(file names and "
                                               r"sizes\)"),
    "different tokenizers": (["a2.0", "h2.1"], r"a2\.0 was built with tokenizer \{'name': 'bytes'.* but .*h2\.1 "
                                               r"with \{'name': 'hf'"),
    "different dtypes": (["u8", "u16"], r"u8 stores uint8 tokens but .*u16 stores uint16"),
    "a part and a plain folder": (["a2.0", "plain"], r"a2\.0 is one part of a build-shards --part build but "
                                                     r".*plain is not"),
}


@pytest.mark.parametrize("case", list(BAD_SETS))
def test_mismatched_folders_are_one_error(part_dirs, capsys, case):
    names, pattern = BAD_SETS[case]
    folders = [part_dirs[n] for n in names]
    with pytest.raises(ValueError, match=pattern):
        open_source(folders)
    rc = cli.main(["plan", "--source", *folders, "--world-size", "2", "--cost-file", part_dirs["cost"],
                   "--policy", "token-kk"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("balanced-loader plan: error: ")


def test_one_part_alone_is_refused_unless_asked_for(part_dirs):
    with pytest.raises(ValueError, match="part 1 of 2 missing"):
        open_source([part_dirs["a2.0"]])
    with pytest.raises(ValueError, match=r"a2\.0 is part 0/2 of a build-shards --part build, not a whole dataset"):
        open_source(part_dirs["a2.0"])
    with open_source(part_dirs["a2.0"], allow_part=True) as src:  # asked for: that part's docs only
        assert isinstance(src, ShardSource) and src.index["part"]["index"] == 0


@pytest.mark.parametrize("part", ["2/2", "1", "-1/2", "a/b", "0/0"])
def test_bad_part_option_is_one_error(tmp_path, capsys, part):
    f = tmp_path / "x.txt"
    f.write_text("hello")
    assert cli.main(["build-shards", str(f), "--out", str(tmp_path / "o"), f"--part={part}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "0 <= K < N" in err


def test_a_whole_build_without_docs_is_an_error(tmp_path, capsys):
    f = tmp_path / "blank.jsonl"
    f.write_text("\n  \n")
    assert cli.main(["build-shards", str(f), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "hold no docs" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o") and os.listdir(tmp_path) == ["blank.jsonl"]  # nothing half-written


def test_analyze_takes_the_part_folders(part_dirs, tmp_path, capsys):
    out = tmp_path / "an"
    assert cli.main(["analyze", part_dirs["a2.1"], part_dirs["a2.0"], "--json", "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["analyze", part_dirs["plain"], "--json", "--out", str(tmp_path / "ref")]) == 0
    capsys.readouterr()
    stats = json.loads((out / "analyze.json").read_text())["stats"]
    assert stats == json.loads((tmp_path / "ref" / "analyze.json").read_text())["stats"]
    assert stats["docs"] > 50


def test_workers_read_a_bounded_number_of_chunks_ahead_and_report_errors(tmp_path):
    pulled = []

    def items():
        for i in range(40):
            pulled.append(i)
            yield b"x" * i

    for i, n in enumerate(ordered_map(len, items(), 2)):
        assert n == i  # in order
        assert len(pulled) - i <= 2 * 2 + 1  # items read but not yet handed back
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 30 + "{not json\n" + '{"text": "fine"}\n' * 30)
    with pytest.raises(ValueError, match=r"bad\.jsonl line 31: not JSON"):
        build_from_files([str(bad)], str(tmp_path / "out"), workers=2, chunk_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"bad\.jsonl line at byte 510: not JSON"):  # a range inside the file
        build_from_files([str(bad)], str(tmp_path / "out"), workers=2, chunk_bytes=100)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # a failed build leaves nothing behind


def test_a_range_inside_one_huge_line_reads_only_its_own_bytes(tmp_path, monkeypatch):
    import builtins

    big = tmp_path / "huge.jsonl"
    big.write_text('{"text": "a"}\n' + json.dumps({"text": "y" * 3_000_000}) + '\n{"text": "b"}\n')
    sizes = file_sizes([str(big)])
    real_open, reads = builtins.open, []

    class Counting:  # the real file, counting the bytes read through it
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            out = self.f.read(n)
            reads.append(len(out))
            return out

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr(builtins, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    assert list(read_docs([str(big)], sizes, 1_000_000, 1_100_000)) == []  # no line starts there
    assert 0 < sum(reads) <= 100_000 + (1 << 16)  # its range and one block, not the rest of the line
    monkeypatch.undo()
    b_at = sizes[0] - len(b'{"text": "b"}\n')
    docs = list(read_docs([str(big)], sizes, 20, sizes[0]))  # starts inside the huge line: the next line only
    assert len(docs) == 1 and docs[0].data == b'{"text": "b"}\n' and docs[0].where.endswith(f"line at byte {b_at}")


def test_the_loader_delivers_the_same_microbatches_from_the_parts(tmp_path):
    from balanced_loader.cost import CostModel
    from balanced_loader.loader import BalancedLoader

    files = _shape(tmp_path, "one-jsonl")
    build_from_files(files, str(tmp_path / "whole"))
    for k in range(3):
        build_from_files(files, str(tmp_path / f"p{k}"), part=(k, 3))
    cost = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                                "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 512})
    got = []
    for src in (str(tmp_path / "whole"), [str(tmp_path / f"p{k}") for k in (2, 0, 1)]):
        loader = BalancedLoader(src, policy="greedy", cost=cost, world_size=2, rank=1, global_batch_tokens=4000,
                                seed=3, epochs=1, shuffle=False)  # shuffling permutes shards, which differ
        got.append([(m.segments, m.input_ids.tolist()) for b in loader for m in b.microbatches])
        assert loader.state_dict()["lengths_fingerprint"] == loader.source.fingerprint()
    assert got[0] == got[1] and len(got[0]) > 3


def test_a_tokenizer_that_cannot_reach_workers_is_one_error(tmp_path):
    class Local:  # a class defined in a function does not pickle
        vocab_size = 256

        def encode(self, data):
            return np.frombuffer(bytes(data), dtype=np.uint8)

        def identity(self):
            return {"name": "local"}

    f = tmp_path / "a.txt"
    f.write_text("abc")
    with pytest.raises(ValueError, match="cannot be sent to worker processes"):
        build_from_files([str(f)], str(tmp_path / "o"), tokenizer=Local(), workers=2)
    meta = build_from_files([str(f)], str(tmp_path / "o"), tokenizer=Local())  # encode per doc, no encode_batch
    assert meta["num_docs"] == 1 and meta["num_tokens"] == 3


def test_part_folders_served_over_http_open_together(tmp_path, capsys):
    """``--part 0/2`` and ``1/2`` folders, each behind its own HTTP server, open as one source through their URLs
    and hold the docs of the local whole build. (A part without docs has no index, so it opens only as a local
    folder; both parts here have docs.)"""
    pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    from balanced_loader.diagnostics.range_server import RangeServer

    files = _shape(tmp_path, "many-files")
    whole, p0, p1 = (str(tmp_path / x) for x in ("whole", "p0", "p1"))
    assert cli.main(["build-shards", *files, "--out", whole, "--no-progress", "--docs-per-shard", "20"]) == 0
    for k, d in enumerate((p0, p1)):
        assert cli.main(["build-shards", *files, "--out", d, "--part", f"{k}/2", "--no-progress",
                         "--docs-per-shard", "20"]) == 0
    capsys.readouterr()
    with RangeServer(p0) as s0, RangeServer(p1) as s1:
        with ShardSource(whole) as ref, open_source([s1.url, s0.url]) as parts:  # any order: the parts say theirs
            assert isinstance(parts, PartsSource) and [p.remote for p in parts.parts] == [True, True]
            assert all(p.num_docs > 0 for p in parts.parts) and len(ref.shard_names) > 2
            assert parts.folders == [s0.url, s1.url]
            _same_docs(ref, parts)
            assert parts.fingerprint() == ref.index["lengths_fingerprint"]
        assert s0.total_bytes() > 0 and s1.total_bytes() > 0  # the tokens came over HTTP
