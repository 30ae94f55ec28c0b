"""Shard folders: writer, length index (never built on open; ``balanced-loader index`` rebuilds it),
random-access reads, webdataset compatibility, corrupt and missing shards, the build-shards command and
the stdlib corpus."""

from __future__ import annotations

import json
import os
import sysconfig

import numpy as np
import pytest

from balanced_loader import cli
from balanced_loader.build.corpus import stdlib_py_files, stdlib_shards
from balanced_loader.build.writer import write_shards
from balanced_loader.data.index import INDEX_FILE, build_index
from balanced_loader.data.integrity import CHECK_BLOCK_BYTES
from balanced_loader.data.shards import ShardSource


def make_docs(n=60, seed=0, hi=2000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 65_000, size=int(k)).astype(np.uint16) for k in rng.integers(0, hi, size=n)]


@pytest.fixture
def folder(tmp_path):
    docs = make_docs()
    write_shards(docs, str(tmp_path), max_shard_bytes=20_000)
    return tmp_path, docs


def test_roundtrip_and_index(folder):
    path, docs = folder
    src = ShardSource(str(path))
    assert src.num_docs == len(docs) and src.lengths.tolist() == [len(d) for d in docs]
    assert isinstance(src.lengths.base, np.memmap) and not src.lengths.flags.owndata  # memory-mapped
    assert len(src.shard_names) > 3 and src.shard_bounds[-1] == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(src.tokens(i), d)
    src.bytes_read = 0
    big = int(np.argmax([len(d) for d in docs]))
    np.testing.assert_array_equal(src.read(big, 100, 50), docs[big][100:150])
    assert src.bytes_read == min(CHECK_BLOCK_BYTES, 2 * len(docs[big]))  # the range widened to its checksum block
    plain = ShardSource(str(path), verify="off")
    np.testing.assert_array_equal(plain.read(big, 100, 50), docs[big][100:150])
    assert plain.bytes_read == 100  # unchecked: exactly the bytes of the range, nothing else
    shard_path, offset = src.location(big)
    with open(shard_path, "rb") as f:  # the offset points at the raw token bytes inside the tar
        f.seek(offset)
        assert f.read(2 * len(docs[big])) == docs[big].tobytes()
    index = json.loads((path / INDEX_FILE).read_text())
    assert index["dtype"] == "<u2" and index["num_docs"] == len(docs)


def test_plain_webdataset_reads_the_shards(folder):
    wds = pytest.importorskip("webdataset")
    path, docs = folder
    urls = [str(path / n) for n in ShardSource(str(path)).shard_names]
    seen = 0
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode():
        np.testing.assert_array_equal(sample["npy"], docs[int(sample["__key__"])])
        seen += 1
    assert seen == len(docs)


def test_index_is_never_built_on_open_only_by_the_index_command(folder, capsys):
    path, docs = folder
    for f in os.listdir(path):
        if f.startswith("index") or f == "shards.json":
            os.remove(path / f)
    with pytest.raises(ValueError, match=r"has no length index \(index.json\); rebuild the index with: "
                                         r"balanced-loader index "):
        ShardSource(str(path))
    assert not (path / INDEX_FILE).exists()  # opening wrote nothing
    assert cli.main(["index", str(path), "--no-progress"]) == 0  # tars of "another tool": headers only
    out = capsys.readouterr().out
    assert "no shards.json" in out and f"{len(docs)} docs" in out
    src = ShardSource(str(path))
    assert src.lengths.tolist() == [len(d) for d in docs] and src.tokenizer is None  # identity unknown
    np.testing.assert_array_equal(src.tokens(5), docs[5])
    assert src.max_token_id == max(int(d.max()) for d in docs if len(d))  # the index command read every token


def test_added_shards_are_refused_not_taken_in(folder, tmp_path_factory):
    path, docs = folder
    extra = tmp_path_factory.mktemp("extra") / "x"
    write_shards([np.arange(5, dtype=np.uint16)], str(extra))
    os.replace(extra / "shard-000000.tar", path / "zz-extra.tar")
    with pytest.raises(ValueError, match=r"zz-extra.tar is not in index.json \(a stray or added shard\)"):
        ShardSource(str(path))
    with pytest.raises(ValueError, match=r"zz-extra.tar is not one of the shards shards.json records"):
        cli_index(path)
    (path / "shards.json").unlink()  # the folder is now tars of "another tool": the explicit index takes them in
    cli_index(path)
    src = ShardSource(str(path))
    assert src.num_docs == len(docs) + 1 and src.tokens(len(docs)).tolist() == [0, 1, 2, 3, 4]


def cli_index(path):
    from balanced_loader.build.reindex import reindex_folder

    return reindex_folder(str(path))


def test_missing_shard_is_one_clear_error(folder):
    path, _ = folder
    os.remove(path / "shard-000002.tar")
    with pytest.raises(ValueError, match=r"shard .*shard-000002.tar listed in index.json is missing"):
        ShardSource(str(path))


def test_truncated_shard_is_one_clear_error(folder):
    path, _ = folder
    victim = path / "shard-000001.tar"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"shard .*shard-000001.tar has \d+ bytes but index.json recorded"):
        ShardSource(str(path))
    os.remove(path / INDEX_FILE)  # re-indexing checks against the writer's record
    with pytest.raises(ValueError, match=r"shard .*shard-000001.tar is (corrupt|not a readable tar)"):
        cli_index(path)
    assert not (path / INDEX_FILE).exists()


def test_garbage_shard_is_one_clear_error(tmp_path):
    (tmp_path / "bad.tar").write_bytes(b"this is not a tar file" * 100)
    with pytest.raises(ValueError, match=r"has no length index"):
        ShardSource(str(tmp_path))
    with pytest.raises(ValueError, match=r"shard .*bad.tar is not a readable tar file"):
        cli_index(tmp_path)


def test_shard_truncated_after_open_names_the_file(folder):
    path, docs = folder
    src = ShardSource(str(path))
    doc = max(range(len(docs)), key=lambda i: len(docs[i]))
    shard, offset = src.location(doc)
    os.truncate(shard, offset + 10)
    with pytest.raises(ValueError, match=rf"shard {shard} is truncated: doc {doc}"):
        src.tokens(doc)


def test_writer_refuses_a_folder_with_shards(folder):
    path, _ = folder
    with pytest.raises(ValueError, match="already holds files"):
        write_shards([np.arange(3)], str(path))
    with pytest.raises(ValueError, match="do not fit uint16"):
        write_shards([np.array([70_000])], str(path / "sub"))


def test_index_without_write_permission_stays_in_memory(folder):
    path, docs = folder
    idx = build_index(str(path), write=False)
    assert idx["_arrays"]["lengths"].tolist() == [len(d) for d in docs]


def test_source_pickles(folder):
    import pickle

    path, docs = folder
    src = pickle.loads(pickle.dumps(ShardSource(str(path))))
    np.testing.assert_array_equal(src.tokens(3), docs[3])


def test_build_shards_command(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.py").write_text("print('a')\n")
    (tmp_path / "in" / "b.txt").write_text("")
    (tmp_path / "in" / "__pycache__").mkdir()
    (tmp_path / "in" / "__pycache__" / "a.pyc").write_bytes(b"\0\1")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "héllo"}) + "\n" + json.dumps({"text": "yo"}) + "\n")
    out = tmp_path / "shards"
    rc = cli.main(["build-shards", str(tmp_path / "in"), str(tmp_path / "*.jsonl"), "--out", str(out),
                   "--no-progress"])
    assert rc == 0 and "4 docs, 19 tokens" in capsys.readouterr().out
    src = ShardSource(str(out))
    assert src.lengths.tolist() == [11, 0, 6, 2] and src.dtype == np.uint8
    assert src.tokens(0).tobytes() == b"print('a')\n" and src.tokens(2).tobytes() == "héllo".encode()
    assert src.tokenizer == {"name": "bytes", "vocab_size": 256}
    assert cli.main(["build-shards", str(tmp_path / "nothing*.txt"), "--out", str(tmp_path / "o2")]) == 2
    assert "matches no files" in capsys.readouterr().err
    assert cli.main(["build-shards", str(tmp_path / "in"), "--out", str(out)]) == 2
    assert "already holds files" in capsys.readouterr().err


def test_stdlib_corpus_files():
    files = stdlib_py_files()
    root = sysconfig.get_paths()["stdlib"]
    assert len(files) > 1000 and files == stdlib_py_files()
    assert all(f.startswith(root) and f.endswith(".py") for f in files)
    assert not any("site-packages" in f or "__pycache__" in f for f in files)
    rel = [os.path.relpath(f, root) for f in files]
    assert rel == sorted(rel) and "os.py" in rel


def test_stdlib_shards_built_once_and_reused(tmp_path):
    src = stdlib_shards(str(tmp_path), limit=40, max_shard_bytes=50_000)
    files = stdlib_py_files(40)
    assert src.num_docs == 40 and len(src.shard_names) > 1
    with open(files[3], "rb") as f:
        assert src.tokens(3).tobytes() == f.read()
    mtime = os.path.getmtime(tmp_path / INDEX_FILE)
    again = stdlib_shards(str(tmp_path), limit=40, max_shard_bytes=50_000)
    assert again.num_docs == 40 and os.path.getmtime(tmp_path / INDEX_FILE) == mtime  # reused
    rebuilt = stdlib_shards(str(tmp_path), limit=45, max_shard_bytes=50_000)
    assert rebuilt.num_docs == 45
