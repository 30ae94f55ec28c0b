"""ShardWriter output: the length index it writes itself equals the scan of its tars byte for byte, and
every file equals what the tarfile-based writer wrote (checked-in sha256 of a fixed input)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tarfile

import numpy as np
import pytest

from balanced_loader.build.reindex import reindex_folder
from balanced_loader.build.writer import ShardWriter
from balanced_loader.data.index import INDEX_FILE, IndexWriter
from balanced_loader.data.members import NpyHeaders, tar_end, tar_member_header, tar_padding
from balanced_loader.data.shards import ShardSource

DTYPES = ("uint8", "uint16", "uint32")


def fixed_docs(dtype: str, n: int = 90) -> list[np.ndarray]:
    """Docs from integer arithmetic only (no random generator whose stream could change between numpy
    versions): an empty doc, one-token docs, docs of exactly one checksum block, multi-block docs."""
    dt = np.dtype(dtype)
    top = np.iinfo(dt).max
    docs = []
    for i in range(n):
        k = (i * 7919 + 13) % 1700 if i % 11 else [0, 1, 1024 // dt.itemsize, 2048 // dt.itemsize + 1][i // 11 % 4]
        toks = (np.arange(k, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(i * 40503)) % np.uint64(top + 1)
        docs.append(toks.astype(dt))
    return docs


WRITER_KW = {"max_shard_bytes": 9_000, "max_docs_per_shard": 7, "tokenizer": {"name": "test", "vocab_size": 300},
             "extra": {"inputs": {"files": 1, "bytes": 5, "sha256": "ab"}, "part": {"index": 0, "count": 1}}}


def write_fixed(folder: str, dtype: str, **kw) -> list[np.ndarray]:
    docs = fixed_docs(dtype)
    with ShardWriter(folder, dtype=dtype, **{**WRITER_KW, **kw}) as w:
        for d in docs:
            w.add(d)
    return docs


def folder_files(folder: str) -> dict[str, bytes]:
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}


# sha256 over (name, content) of every file of write_fixed's folder, recorded from the tarfile-based writer
# (commit f9bfb4e): the tars, shards.json, shards.crc.npy, index.json and index.*.npy
EXPECTED_SHA256 = {
    "uint8": "fecb9b70390a32cac90eea2c91af40ac28762c2daabe5e0d4063d8eaf93a7558",
    "uint16": "059fb14428b2216db8ab4a81909897fdf9abf2d02418296761c55cdb1b9cc533",
    "uint32": "81f82994bfb7eaebbb1cfb096911a91d2e2be1856770dd8ba7abb9f50bba9998",
}


def folder_sha256(files: dict[str, bytes]) -> str:
    """The recorded hash's form: ``index.json`` without ``max_token_id`` (added after the recording; the
    rest of the index is dumped the same way, so removing it gives the recorded bytes back)."""
    files = dict(files)
    if "index.json" in files:
        index = json.loads(files["index.json"])
        assert isinstance(index.pop("max_token_id"), int)
        files["index.json"] = (json.dumps(index, indent=1) + "\n").encode()
    return hashlib.sha256(b"".join(hashlib.sha256(k.encode()).digest() + hashlib.sha256(v).digest()
                                   for k, v in files.items())).hexdigest()


@pytest.mark.parametrize("dtype", DTYPES)
def test_written_index_equals_the_scan_byte_for_byte(tmp_path, dtype):
    folder = str(tmp_path / "w")
    docs = write_fixed(folder, dtype)
    files = folder_files(folder)
    assert sum(f.endswith(".tar") for f in files) >= 10 and any(len(d) == 0 for d in docs)
    assert not [f for f in files if f.startswith(".")]  # no temporary file left behind
    rescanned = str(tmp_path / "scan")
    shutil.copytree(folder, rescanned)
    for f in os.listdir(rescanned):
        if f.startswith("index."):
            os.remove(os.path.join(rescanned, f))
    reindex_folder(rescanned)  # the explicit index command: a header scan, checksums, the largest token id
    again = folder_files(rescanned)
    assert sorted(again) == sorted(files)
    for name, data in files.items():
        assert again[name] == data, name
    src = ShardSource(folder)
    assert src.dtype == np.dtype(dtype) and src.num_docs == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(src.tokens(i), d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_files_equal_the_tarfile_writer(tmp_path, dtype):
    write_fixed(str(tmp_path), dtype)
    assert folder_sha256(folder_files(str(tmp_path))) == EXPECTED_SHA256[dtype]


def test_member_headers_equal_tarfile_and_numpy():
    for name, size in [("0000000000.npy", 0), ("0000000007.npy", 128), ("x" * 100, 511),
                       ("12345678901.npy", 8 ** 11 - 1), ("a.npy", 8 ** 11), ("b.npy", 2 ** 45 + 3)]:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = size, 0, 0o644
        assert tar_member_header(name, size) == info.tobuf(tarfile.GNU_FORMAT), (name, size)
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        tar_member_header("y" * 101, 1)
    for dtype in DTYPES:
        headers = NpyHeaders(np.dtype(dtype))
        for n in [0, 1, 9, 10, 99, 12345, 10 ** 9, 2 ** 40 + 1, 10 ** 15]:
            buf = HeaderOnly()
            with contextlib.suppress(HeaderOnly.Done):  # numpy writes its header, then the data (stopped there)
                np.lib.format.write_array(buf, np.broadcast_to(np.zeros(1, dtype), (n,)), version=(1, 0))
            assert buf.writes[0] == headers(n), (dtype, n)
    buf = HeaderOnly()
    with pytest.raises(HeaderOnly.Done):  # and np.save, the index arrays' writer, picks version 1.0 too
        np.save(buf, np.broadcast_to(np.zeros(1, np.int64), (10 ** 12,)))
    assert buf.writes[0] == NpyHeaders(np.dtype(np.int64))(10 ** 12)


class HeaderOnly:
    """A file that takes one write (numpy's header) and stops the next (the array data, never materialized)."""

    class Done(Exception):
        pass

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, b) -> int:
        if self.writes:
            raise HeaderOnly.Done
        self.writes.append(bytes(b))
        return len(b)


def test_tar_end_equals_tarfile(tmp_path):
    for sizes in [[], [0], [1], [511, 512, 513], [10 * 1024 - 512 - 1024 - 512]]:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for i, size in enumerate(sizes):
                info = tarfile.TarInfo(f"{i}.npy")
                info.size, info.mtime, info.mode = size, 0, 0o644
                tar.addfile(info, io.BytesIO(b"\1" * size))
        ours = b"".join(tar_member_header(f"{i}.npy", s) + b"\1" * s + tar_padding(s) for i, s in enumerate(sizes))
        assert ours + tar_end(len(ours)) == buf.getvalue(), sizes


def test_an_empty_writer_and_a_failed_writer_leave_nothing(tmp_path):
    with pytest.raises(ValueError, match="given no docs"), ShardWriter(str(tmp_path / "a"), dtype="uint16"):
        pass
    assert not os.path.exists(tmp_path / "a")  # the folder is published whole or not at all
    with ShardWriter(str(tmp_path / "b"), dtype="uint16", allow_empty=True) as w:
        pass
    assert sorted(os.listdir(tmp_path / "b")) == ["shards.crc.npy", "shards.json"] and w.close()["num_docs"] == 0
    with pytest.raises(RuntimeError, match="boom"), \
            ShardWriter(str(tmp_path / "c"), dtype="uint16", max_docs_per_shard=2) as w:
        for d in fixed_docs("uint16", 9):
            w.add(d)
        raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["b"]  # neither "c" nor its staging folder (with 4 finished shards)
    with pytest.raises(ValueError, match="failed"):
        w.add(np.zeros(3, np.uint16))


def test_index_streams_in_chunks(tmp_path, monkeypatch):
    """More docs than one buffered chunk (the chunk made small): the same bytes as a scan."""
    monkeypatch.setattr(IndexWriter, "CHUNK", 5)
    monkeypatch.setattr(ShardWriter, "CRC_CHUNK", 7)
    folder = str(tmp_path / "w")
    write_fixed(folder, "uint16")
    assert folder_sha256(folder_files(folder)) == EXPECTED_SHA256["uint16"]
    with open(os.path.join(folder, INDEX_FILE)) as f:
        index = json.load(f)
    assert index["num_docs"] == 90 and index["member_names"] == "doc_id"
