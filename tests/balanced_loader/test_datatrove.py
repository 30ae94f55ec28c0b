"""datatrove token files as a source: files written byte for byte as datatrove's TokenizedFile writes them
(struct-packed uint16/uint32 tokens, uint64 doc ends, the NAME|SIZE metadata), several files with 2- and
4-byte tokens; tokens equal the files, every token once per epoch on 4 ranks with exact resume, remote
folders, and one line for bad input."""

from __future__ import annotations

import json
import os
import pickle
import struct

import numpy as np
import pytest

from balanced_loader import cli
from balanced_loader.data.datatrove import DatatroveSource, write_datatrove
from balanced_loader.data.open import open_source
from tests.balanced_loader.test_megatron import WORLD, assert_each_token_once, epoch_pieces, make_loader


def datatrove_file(folder, name: str, docs, token_size: int, metadata: str | None = "auto") -> None:
    """As datatrove's TokenizedFile: tokens struct-packed (<H or <I), the index <Q doc ends, the metadata
    'TOKENIZER|SIZE', the token count and its humanized form."""
    fmt = "I" if token_size == 4 else "H"
    ends, total = [], 0
    with open(os.path.join(folder, name), "wb") as f:
        for d in docs:
            f.write(struct.pack(f"<{len(d)}{fmt}", *[int(t) for t in d]))
            total += len(d)
            ends.append(total)
    with open(os.path.join(folder, name + ".index"), "wb") as f:
        f.write(struct.pack(f"<{len(ends)}Q", *ends))
    if metadata is not None:
        first = f"meta-llama/Meta-Llama-3-8B|{token_size}" if metadata == "auto" else metadata
        with open(os.path.join(folder, name + ".metadata"), "w") as f:
            f.write("\n".join([first, str(total), f"{total / 1000:.1f}KT"]))


def docs_of(seed: int, n: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = np.where(rng.random(n) < 0.15, rng.integers(3_000, 15_000, n), rng.integers(0, 900, n))
    return [rng.integers(0, vocab, int(k)) for k in lens]


@pytest.fixture(scope="module", params=[2, 4])
def folder(request, tmp_path_factory):
    """Three files of one tokenizer (2-byte tokens, or 4-byte ones above 65,535), written out of name order."""
    ts = request.param
    vocab = 50_000 if ts == 2 else 128_256
    d = tmp_path_factory.mktemp(f"dt{ts}")
    files = {"train_00002_shuffled.ds": docs_of(3, 40, vocab), "train_00000_shuffled.ds": docs_of(1, 60, vocab),
             "train_00001_shuffled.ds": docs_of(2, 50, vocab)}
    for name, docs in files.items():
        datatrove_file(d, name, docs, ts)
    flat = [t for name in sorted(files) for t in files[name]]
    return str(d), flat, ts


def test_lengths_and_tokens_equal_the_files(folder):
    path, flat, ts = folder
    src = open_source(path)
    assert isinstance(src, DatatroveSource) and len(src.files) == 3 and src.dtype.itemsize == ts
    assert src.tokenizer == "meta-llama/Meta-Llama-3-8B"
    assert np.asarray(src.lengths).tolist() == [len(d) for d in flat]
    for i, d in enumerate(flat):
        assert np.array_equal(src.tokens(i), d)
    assert src.shard_bounds.tolist() == [0, 60, 110, 150]  # name order, each file a shard
    # the raw bytes: doc 70 is doc 10 of the second file
    raw = np.fromfile(os.path.join(path, "train_00001_shuffled.ds"), dtype=f"<u{ts}")
    ends = np.fromfile(os.path.join(path, "train_00001_shuffled.ds.index"), dtype="<u8")
    assert np.array_equal(src.tokens(70), raw[ends[9]:ends[10]])
    assert np.array_equal(src.read(70, 2, 3), flat[70][2:5])
    again = pickle.loads(pickle.dumps(src))  # DataLoader workers get the source pickled
    assert again.fingerprint() == src.fingerprint() and np.array_equal(again.tokens(70), flat[70])


def test_four_ranks_every_token_once_and_exact_resume(folder):
    path, flat, _ = folder
    src = open_source(path)
    pieces = epoch_pieces([make_loader(path, r) for r in range(WORLD)], src.read)
    assert_each_token_once(pieces, np.asarray(src.lengths))

    def sig(b):
        return b.plan.fingerprint(), [(m.segments, m.input_ids.tobytes()) for m in b.microbatches]

    ref = [sig(b) for b in make_loader(path, 1, epochs=2)]
    k = len(ref) // 2
    ld = make_loader(path, 1, epochs=2)
    assert [sig(b) for _, b in zip(range(k), ld)] == ref[:k]
    fresh = make_loader(path, 1, epochs=2)
    fresh.load_state_dict(json.loads(json.dumps(ld.state_dict())))
    assert [sig(b) for b in fresh] == ref[k:]


def test_metadata_forms_and_token_size_inference(tmp_path):
    docs = docs_of(5, 20, 60_000)
    datatrove_file(tmp_path, "a.ds", docs, 2, metadata="gpt2")  # datatrove before token sizes: uint16
    datatrove_file(tmp_path, "b.ds", docs, 4, metadata="Unknown Tokenizer|4|4")  # its name-less form
    datatrove_file(tmp_path, "c.ds", docs, 4, metadata=None)  # no metadata: from the file size
    for name, ts in (("a.ds", 2), ("b.ds", 4), ("c.ds", 4)):
        src = open_source(str(tmp_path / name))
        assert src.dtype.itemsize == ts and all(np.array_equal(src.tokens(i), d) for i, d in enumerate(docs))
    assert DatatroveSource(str(tmp_path / "c.ds"), token_size=4).num_docs == 20
    with pytest.raises(ValueError, match="holds 2-byte tokens but .*b.ds 4-byte"):
        DatatroveSource([str(tmp_path / "a.ds"), str(tmp_path / "b.ds")])


def test_remote_folder_and_files(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    from balanced_loader.diagnostics.range_server import RangeServer

    docs = docs_of(7, 30, 60_000)
    write_datatrove(str(tmp_path), "x_00000", docs[:12])
    write_datatrove(str(tmp_path), "x_00001", docs[12:])
    # a listed remote folder (fsspec's memory://, as s3:// or gs:// list)
    mem = fsspec.filesystem("memory")
    for name in os.listdir(tmp_path):
        mem.pipe(f"/dt/{name}", (tmp_path / name).read_bytes())
    src = open_source("memory://dt")
    assert src.num_docs == 30 and all(np.array_equal(src.tokens(i), d) for i, d in enumerate(docs))
    # HTTP files given one by one (a plain server lists no folder): exact byte ranges
    with RangeServer(str(tmp_path)) as server:
        src = open_source([f"{server.url}/x_00000.ds", f"{server.url}/x_00001.ds"])
        server.reset()
        assert np.array_equal(src.read(20, 5, 100), docs[20][5:105])
        served = server.bytes_served  # the 100 tokens, and the 16-byte Range probe of the file's index
        assert served == {"/x_00001.ds": 200, "/x_00001.ds.index": 16}
        # the loader on 4 ranks over HTTP: every token once, the .ds bytes served within 1.05x of those read
        server.reset()
        urls = [f"{server.url}/x_00000.ds", f"{server.url}/x_00001.ds"]
        local = open_source(str(tmp_path))
        pieces = epoch_pieces([make_loader(urls, r) for r in range(WORLD)], local.read)
        assert_each_token_once(pieces, np.asarray(local.lengths))
        ds_served = sum(v for k, v in server.bytes_served.items() if k.endswith(".ds"))
        needed = 2 * sum(length for ps in pieces.values() for _, length in ps)
        assert needed <= ds_served <= 1.05 * needed


def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys):
    docs = docs_of(9, 10, 60_000)
    cases = {}
    for case in ("missing index", "odd size", "truncated", "bad metadata"):
        d = tmp_path / case.replace(" ", "_")
        d.mkdir()
        p = write_datatrove(str(d), "t_00000", docs)
        if case == "missing index":
            os.remove(p + ".index")
            cases[case] = (str(d), p + ".index")
        elif case == "odd size":
            with open(p, "ab") as f:
                f.write(b"\x00")
            cases[case] = (str(d), p)
        elif case == "truncated":
            with open(p, "r+b") as f:
                f.truncate(os.path.getsize(p) - 4)
            cases[case] = (str(d), p)
        else:
            with open(p + ".metadata", "w") as f:
                f.write("gpt2|3\n12\n12T")
            cases[case] = (str(d), p + ".metadata")
    for case, (path, named) in cases.items():
        with pytest.raises(ValueError) as e:
            open_source(path)
        msg = str(e.value)
        assert named in msg and "\n" not in msg, case
        if case == "odd size":
            assert "not a multiple of its token size 2" in msg
        rc = cli.main(["plan", "--source", path, "--world-size", "2", "--cost", "hydra-gpt7b-a100",
                       "--policy", "greedy"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and named in err and len(err.splitlines()) == 1, case
        assert cli.main(["verify", path]) == 2
    capsys.readouterr()
    ok = tmp_path / "ok"
    write_datatrove(str(ok), "t", docs)
    assert cli.main(["verify", str(ok)]) == 0
    assert "1 datatrove files, 10 docs" in capsys.readouterr().out
