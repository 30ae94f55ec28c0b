"""The explicit re-index (``balanced-loader index DIR``): a shard folder's length index rebuilt from its
tars, checked against every checksum the folder holds before anything is written.

Readers never build an index (:class:`~balanced_loader.data.shards.ShardSource` refuses a folder
without one, or whose index disagrees with its shards); this is the one way to write one for a
folder that has tars but no (or a damaged) index: tars written by another tool, or an index that
was deleted. The checks, in order, all before the first byte is written:

1. ``shards.json`` (the build's record), when there, lists exactly the ``.tar`` files present: a
   stray or missing shard is an error (indexing what is there would silently change the dataset);
2. a scan of the tar headers (:func:`~.index.build_index`) agrees with ``shards.json``'s docs and
   bytes per shard;
3. each shard's crc32 equals the recorded one (every byte read once);
4. each doc's token bytes equal its recorded crc32 and block crc32s (``shards.crc.npy``).

Tars without any record (another tool's) are indexed from their headers alone, with a note. The
largest token id is taken while the tokens are read and stored in ``index.json``
(``max_token_id``), so a trainer checks its vocabulary before any step. The folder is locked
(:class:`~.locks.OutputLock`) while it is indexed.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field

import numpy as np

from balanced_loader.outputs.files import write_json
from balanced_loader.data.index import (
    INDEX_FILE,
    META_FILE,
    array_path,
    build_index,
    list_shards,
    read_index_json,
    save_array,
)
from balanced_loader.data.integrity import file_crc32
from balanced_loader.outputs.locks import OutputLock


@dataclass(kw_only=True, slots=True)
class IndexReport:
    """What :func:`reindex_folder` wrote and checked."""

    folder: str
    shards: int = 0
    docs: int = 0
    tokens: int = 0
    shard_crcs: int = 0  # shards checked against a recorded crc32
    doc_crcs: int = 0  # docs checked against recorded checksums
    max_token_id: int | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        checked = (f"checked {self.shard_crcs} shard crc32(s) and {self.doc_crcs:,} doc checksum(s)"
                   if self.shard_crcs or self.doc_crcs else "no recorded checksums to check")
        return (f"{self.folder}: indexed {self.shards} shards, {self.docs:,} docs, {self.tokens:,} tokens; "
                f"{checked}; largest token id {self.max_token_id}")


def _check_listed(folder: str, meta: dict | None) -> None:
    """``shards.json``'s shards are exactly the tars present (one ``ValueError`` naming the first difference)."""
    if meta is None:
        return
    present = set(list_shards(folder))
    recorded = [s["name"] for s in meta.get("shards", [])]
    for name in recorded:
        if name not in present:
            raise ValueError(f"shard {os.path.join(folder, name)} recorded in {META_FILE} is missing: restore it "
                             f"(an index of the remaining shards would silently drop its docs)")
    for name in sorted(present - set(recorded)):
        raise ValueError(f"{os.path.join(folder, name)} is not one of the shards {META_FILE} records (a stray or "
                         f"added shard): remove it (to index tars of another tool, remove {META_FILE} as well)")


def _read_docs(folder: str, index: dict, arrays: dict[str, np.ndarray], crcs: np.ndarray | None,
               report: IndexReport) -> None:
    """Every doc's token bytes read once: checked against its recorded checksums, the largest id kept."""
    names = [s["name"] for s in index["shards"]]
    dtype = np.dtype(index["dtype"])
    block = int(index.get("check_block_bytes") or 0)
    lengths, shard, offset = arrays["lengths"], arrays["shard"], arrays["offset"]
    start = arrays.get("crc_start")
    top = -1
    fds: dict[int, int] = {}
    try:
        for d in range(len(lengths)):
            s = int(shard[d])
            if s not in fds:
                fds[s] = os.open(os.path.join(folder, names[s]), os.O_RDONLY)
            n = int(lengths[d]) * dtype.itemsize
            buf = os.pread(fds[s], n, int(offset[d]))
            if len(buf) != n:
                raise ValueError(f"shard {os.path.join(folder, names[s])} is truncated at doc {d}")
            if crcs is not None and start is not None:
                k0 = int(start[d])
                want = [int(zlib.crc32(buf))] + ([zlib.crc32(buf[i:i + block]) for i in range(0, n, block)]
                                                 if n > block else [int(zlib.crc32(buf))] if n else [])
                have = crcs[k0:int(start[d + 1])].tolist()
                if have != want:
                    raise ValueError(f"doc {d} in shard {os.path.join(folder, names[s])} does not match its "
                                     f"recorded checksums (the token data or shards.crc.npy was changed); restore "
                                     f"the folder or build it again")
                report.doc_crcs += 1
            if n:
                top = max(top, int(np.frombuffer(buf, dtype=dtype.newbyteorder("<")).max()))
    finally:
        for fd in fds.values():
            os.close(fd)
    report.max_token_id = top if top >= 0 else None


def reindex_folder(folder: str, *, progress: bool = False) -> IndexReport:
    """Rebuild ``folder``'s length index from its tars after checking every recorded checksum (see the
    module doc); one ``ValueError`` for the first disagreement, and then nothing is written."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"shard folder {folder} does not exist")
    with OutputLock(folder, "shard folder"):
        meta_path = os.path.join(folder, META_FILE)
        meta = read_index_json(meta_path) if os.path.exists(meta_path) else None
        _check_listed(folder, meta)
        index = build_index(folder, write=False, progress=progress)  # headers vs shards.json's docs and bytes
        arrays = index.pop("_arrays")
        report = IndexReport(folder=folder, shards=len(index["shards"]), docs=int(index["num_docs"]),
                             tokens=int(index["num_tokens"]))
        for s in index["shards"]:
            if "crc32" in s:
                path = os.path.join(folder, s["name"])
                got = file_crc32(path)
                if got != int(s["crc32"]):
                    raise ValueError(f"shard {path}: crc32 {got:08x} differs from the {s['crc32']:08x} {META_FILE} "
                                     f"recorded (the file was changed or replaced); restore it or build again")
                report.shard_crcs += 1
        crcs = np.load(os.path.join(folder, "shards.crc.npy"), mmap_mode="r") if "crc_start" in arrays else None
        _read_docs(folder, index, arrays, crcs, report)
        if meta is None:
            report.notes.append("no shards.json: tars of another tool, indexed from their headers (no checksums "
                                "to check or to protect reads)")
        elif crcs is None:
            report.notes.append("shards.json does not cover per-doc checksums: reads check headers only")
        index["max_token_id"] = report.max_token_id
        for k, arr in arrays.items():
            save_array(array_path(folder, k), arr)
        write_json(os.path.join(folder, INDEX_FILE), index, indent=1)  # last: its presence marks the index complete
    return report
