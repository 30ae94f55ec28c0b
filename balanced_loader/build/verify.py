"""A full check of a dataset (``balanced-loader verify DIR|PREFIX``): reads every byte once, changes nothing
(except ``--write-checksums``, which adds a Megatron checksum sidecar).

A shard folder, in order: the index lists exactly the ``.tar`` files present with their sizes; the
index arrays equal a fresh scan of the tar headers; the doc and token counts of ``index.json`` equal
the arrays'; the lengths fingerprint; each shard's crc32; every doc's member headers and block
checksums (the same checks a read does).

A Megatron dataset (:func:`verify_prefix`): the ``.idx`` header and size, every sequence pointer
against the lengths before it (``pointers[i] = sum(lengths[:i]) * itemsize``), non-negative lengths,
the document indices (from 0 to the sequence count, never decreasing), the ``.bin`` size, and the
crc32 of every sequence when ``PREFIX.crc32.npy`` exists (:func:`verify_prefix` with
``write_checksums=True`` writes it, after the structure checks pass). A folder of datatrove token
files: every file's index, size and token size (what opening checks), then every doc read.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field

import numpy as np

from balanced_loader.data.index import INDEX_FILE, build_index, index_problems, read_index_json, reindex_hint
from balanced_loader.data.integrity import file_crc32, lengths_fingerprint
from balanced_loader.data.lengths import CHECK_DOCS, LENGTH_SUFFIXES, release_pages, sum_lengths
from balanced_loader.data.shards import ShardSource
from balanced_loader.data.stores import is_url

MAX_DOC_LINES = 100  # problem lines of single docs before the rest are counted only


@dataclass(kw_only=True, slots=True)
class Report:
    """What :func:`verify_folder` found: ``problems`` (wrong data), ``notes`` (what could not be checked)."""

    folder: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    shards: int = 0
    docs: int = 0
    tokens: int = 0
    bytes: int = 0
    files: str = "shards"  # what ``shards`` counts: shards, Megatron prefixes, datatrove files

    def summary(self) -> str:
        state = f"{len(self.problems)} problem(s)" if self.problems else "no problems"
        return (f"{self.folder}: {self.shards} {self.files}, {self.docs:,} docs, {self.tokens:,} tokens, "
                f"{self.bytes / 2**20:,.1f} MiB checked: {state}")


def _index_problems(folder: str, r: Report) -> bool:
    """Index present, agreeing with the shards there (:func:`~.index.index_problems`); False when reading
    must stop."""
    path = os.path.join(folder, INDEX_FILE)
    if not os.path.exists(path):
        r.problems.append(f"{path} is missing; {reindex_hint(folder)}")
        return False
    try:
        index = read_index_json(path)
    except ValueError as e:
        r.problems.append(str(e))
        return False
    problems = index_problems(folder, index)
    r.problems.extend(problems)
    return not problems


def _compare(r: Report, src: ShardSource, fresh: dict[str, np.ndarray]) -> None:
    """Index arrays against a fresh scan of the tar headers."""
    mine = src.index_arrays()
    for k, want in fresh.items():
        if k not in mine:
            continue
        have = np.asarray(mine[k])
        if len(have) != len(want):
            r.problems.append(f"index.{k}.npy has {len(have)} entries, the shards hold {len(want)} docs")
            continue
        bad = np.flatnonzero(have != want)
        if bad.size:
            d = int(bad[0])
            r.problems.append(f"index.{k}.npy differs from the shards at {bad.size} doc(s) (first: doc {d}, "
                              f"{int(have[d])} in the index, {int(want[d])} in the shards)")


def _totals(r: Report, src: ShardSource) -> None:
    """The doc and token counts ``index.json`` records against its length array (a count edited by hand, or
    an index of another folder, would otherwise pass: the loader trusts ``num_tokens``)."""
    n, total = len(src.lengths), sum_lengths(src.lengths)
    for key, have in (("num_docs", n), ("num_tokens", total)):
        rec = src.index.get(key)
        if rec is not None and rec != have:
            r.problems.append(f"{INDEX_FILE} records {key} {rec:,} but index.lengths.npy holds {have:,}: the index "
                              f"was edited or belongs to other shards; {reindex_hint(src.folder)}")
    shard_docs = sum(int(s.get("docs", 0)) for s in src.index.get("shards", []))
    if shard_docs != n:
        r.problems.append(f"{INDEX_FILE} lists {shard_docs:,} docs over its shards but index.lengths.npy holds "
                          f"{n:,}; {reindex_hint(src.folder)}")
    r.tokens = total


def verify(path: str, *, write_checksums: bool = False) -> Report:
    """Check a dataset fully: a shard folder, a Megatron dataset (``PREFIX``, ``PREFIX.idx`` or ``.bin``) or a
    folder of datatrove token files; one ``ValueError`` for a path that is none of them."""
    from balanced_loader.data.datatrove import is_datatrove_folder
    from balanced_loader.data.megatron import prefixes_in, resolve_prefix

    path = os.fspath(path)
    if is_url(path):
        raise ValueError(f"{path}: verify checks local files (it reads every byte); run it before uploading, "
                         f"or on a downloaded copy (reading from the URL checks every doc it reads anyway)")
    prefix = resolve_prefix(path)
    if prefix is None and os.path.isdir(path) and not is_datatrove_folder(path):
        found = prefixes_in(path)
        if found:
            return _merge(path, [verify_prefix(p, write_checksums=write_checksums) for p in found])
    if write_checksums and prefix is None:
        raise ValueError(f"--write-checksums is for a Megatron dataset (PREFIX of PREFIX.bin + PREFIX.idx); {path} "
                         f"is not one (shard folders carry their own checksums)")
    if prefix is not None:
        return verify_prefix(prefix, write_checksums=write_checksums)
    if os.path.isdir(path) and is_datatrove_folder(path):
        return verify_datatrove(path)
    if os.path.isfile(path):
        if path.endswith(LENGTH_SUFFIXES):
            raise ValueError(f"{path} is a length file (lengths only, no tokens): there is nothing to verify; verify "
                             f"checks a shard folder, a Megatron dataset PREFIX or a folder of datatrove .ds files "
                             f"(balanced-loader analyze {path} reads a length file)")
        if path.endswith(".ds"):
            return verify_datatrove(path)
        raise ValueError(f"{path} is a file; verify checks a shard folder (balanced-loader build-shards), a Megatron "
                         f"dataset PREFIX (of PREFIX.bin + PREFIX.idx) or a folder of datatrove .ds files")
    return verify_folder(path)


def _merge(folder: str, reports: list[Report]) -> Report:
    r = Report(folder=folder, files="Megatron prefixes", shards=len(reports))
    for x in reports:
        r.problems += x.problems
        r.notes += x.notes
        r.docs, r.tokens, r.bytes = r.docs + x.docs, r.tokens + x.tokens, r.bytes + x.bytes
    return r


def verify_folder(folder: str) -> Report:
    """Check a shard folder fully (see the module doc); never raises for a corrupt folder."""
    folder = os.fspath(folder)
    if is_url(folder):
        raise ValueError(f"{folder}: verify checks a local folder (it reads every byte); run it before uploading, "
                         f"or on a downloaded copy (reading from the URL checks every doc it reads anyway)")
    if not os.path.isdir(folder):
        raise ValueError(f"{folder} does not exist; verify checks a shard folder, a Megatron dataset PREFIX (of "
                         f"PREFIX.bin + PREFIX.idx) or a folder of datatrove .ds files")
    r = Report(folder=folder)
    if not _index_problems(folder, r):
        return r
    try:
        src = ShardSource(folder, verify="full", allow_part=True)
    except ValueError as e:
        r.problems.append(str(e))
        return r
    r.shards, r.docs = len(src.shard_names), src.num_docs
    _totals(r, src)
    try:
        fresh = build_index(folder, write=False)
        _compare(r, src, fresh["_arrays"])
    except ValueError as e:
        r.problems.append(str(e))
    recorded = src.index.get("lengths_fingerprint")
    if recorded is None:
        r.notes.append(f"{INDEX_FILE} records no lengths fingerprint (an index from before fingerprints)")
    elif recorded != lengths_fingerprint(src.lengths):
        r.problems.append(f"index.lengths.npy does not match the lengths fingerprint in {INDEX_FILE} "
                          f"(the length index was changed)")
    for i, s in enumerate(src.index["shards"]):
        path = src.shard_path(i)
        r.bytes += s["bytes"]
        if "crc32" not in s:
            continue
        got = file_crc32(path)
        if got != s["crc32"]:
            r.problems.append(f"shard {path}: crc32 {got:08x} differs from the recorded {s['crc32']:08x} "
                              f"(the file was changed or replaced)")
    no_crc = [s["name"] for s in src.index["shards"] if "crc32" not in s]
    if no_crc:
        r.notes.append(f"checksums missing: {len(no_crc)} of {len(src.shard_names)} shards have no recorded "
                       f"crc32 (a folder from before checksums, or tars written by another tool); "
                       f"rebuild with balanced-loader build-shards to protect them")
    if not src.has_checksums:
        r.notes.append("checksums missing: no per-doc checksums, so token bytes were checked against the "
                       "tar and .npy headers only")
    bad_docs = 0
    for d in range(src.num_docs):
        try:
            src.tokens(d)
        except ValueError as e:
            bad_docs += 1
            if bad_docs <= MAX_DOC_LINES:
                r.problems.append(str(e))
    if bad_docs > MAX_DOC_LINES:
        r.problems.append(f"... and {bad_docs - MAX_DOC_LINES} more docs with problems")
    src.close()
    return r


_CRC_CHUNK = 1 << 26  # bytes of a .bin read at once while checksumming sequences


def sequence_crcs(bin_path: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> np.ndarray:
    """``[S]`` uint32: the crc32 of each sequence's bytes in a ``.bin`` (contiguous sequences; read in chunks of
    about 64 MiB, one read per chunk)."""
    n = len(lengths)
    out = np.empty(n, dtype=np.uint32)  # [S]
    with open(bin_path, "rb") as f:
        fd = f.fileno()
        for a in range(0, n, CHECK_DOCS):
            ln = np.asarray(lengths[a:a + CHECK_DOCS], dtype=np.int64) * itemsize  # [block] bytes
            ptr = np.asarray(pointers[a:a + CHECK_DOCS], dtype=np.int64)  # [block]
            i = 0
            while i < len(ln):
                # sequences i..j-1 of the block in one read (at least one, however long)
                j = max(i + 1, int(np.searchsorted(ptr + ln, ptr[i] + _CRC_CHUNK, side="right")))
                buf = memoryview(os.pread(fd, int(ptr[j - 1] + ln[j - 1] - ptr[i]), int(ptr[i])))
                base = int(ptr[i])
                for k in range(i, j):
                    o = int(ptr[k]) - base
                    out[a + k] = zlib.crc32(buf[o:o + int(ln[k])])
                i = j
            release_pages(lengths)
            release_pages(pointers)
    return out


def verify_prefix(prefix: str, *, write_checksums: bool = False) -> Report:
    """Check a Megatron dataset fully (see the module doc); ``write_checksums``: write ``PREFIX.crc32.npy``
    when its structure is sound (replacing one that disagrees). Never raises for a damaged dataset."""
    from balanced_loader.outputs.files import atomic_write
    from balanced_loader.data.megatron import CHECKSUM_HINT, CRC_SUFFIX, MegatronSource

    r = Report(folder=prefix, files="Megatron prefix", shards=1)
    for p in (prefix + ".idx", prefix + ".bin"):
        if not os.path.isfile(p):
            r.problems.append(f"{p} is missing: a Megatron dataset is PREFIX.bin + PREFIX.idx")
    if r.problems:
        return r
    try:
        src = MegatronSource(prefix, verify="off")  # the header, file sizes, document index ends
    except ValueError as e:
        r.problems.append(str(e))
        return r
    part = src.parts[0]
    item, n = part.itemsize, part.num_docs
    r.docs, r.bytes = n, os.path.getsize(part.idx_path) + part.bin_size
    r.tokens = sum_lengths(part.lengths)
    expect = 0
    for a in range(0, n, CHECK_DOCS):
        ln = np.asarray(part.lengths[a:a + CHECK_DOCS], dtype=np.int64)  # [block]
        ptr = np.asarray(part.pointers[a:a + CHECK_DOCS], dtype=np.int64)  # [block]
        if ln.min() < 0:
            i = a + int(np.flatnonzero(ln < 0)[0])
            r.problems.append(f"{part.idx_path}: sequence {i} has a negative length {int(part.lengths[i])}")
            break
        want = expect + np.concatenate([[0], np.cumsum(ln[:-1] * item)])  # [block] where each should start
        bad = np.flatnonzero(ptr != want)
        if bad.size:
            i = int(bad[0])
            r.problems.append(f"{part.idx_path}: sequence {a + i} points at byte {int(ptr[i]):,} of {part.bin_name} "
                              f"but the lengths before it end at byte {int(want[i]):,} ({bad.size} such sequence(s) "
                              f"in this block); the index is damaged, rebuild it")
            break
        expect = int(want[-1] + ln[-1] * item)
        release_pages(part.lengths)
        release_pages(part.pointers)
    di = np.asarray(part.doc_index)
    if di.size > 1 and np.any(np.diff(di) < 0):
        i = int(np.flatnonzero(np.diff(di) < 0)[0])
        r.problems.append(f"{part.idx_path}: document index {i + 1} ({int(di[i + 1])}) is below the one before it "
                          f"({int(di[i])}); the index is damaged, rebuild it")
    crc_path = prefix + CRC_SUFFIX
    if r.problems:
        src.close()
        return r
    if os.path.exists(crc_path) and not write_checksums:
        try:
            recorded = MegatronSource(prefix).parts[0].crc
        except ValueError as e:
            r.problems.append(str(e))
            return r
        got = sequence_crcs(part.bin_path, part.lengths, part.pointers, item)
        bad = np.flatnonzero(got != recorded)
        for i in bad[:MAX_DOC_LINES].tolist():
            r.problems.append(f"{part.bin_path}: sequence {i} has crc32 {int(got[i]):08x}, "
                              f"{os.path.basename(crc_path)} says {int(recorded[i]):08x} (the .bin is corrupt or "
                              f"changed since)")
        if bad.size > MAX_DOC_LINES:
            r.problems.append(f"... and {bad.size - MAX_DOC_LINES} more sequences with problems")
    elif write_checksums:
        crcs = sequence_crcs(part.bin_path, part.lengths, part.pointers, item)
        with atomic_write(crc_path, "wb") as f:
            np.save(f, crcs, allow_pickle=False)
        r.notes.append(f"wrote {crc_path}: the crc32 of each of the {n:,} sequences; reads check them from now on")
    else:
        r.notes.append(f"no checksums: a Megatron dataset has none of its own, so token bytes were checked against "
                       f"the index's sizes only; write a sidecar that reads check ({CHECKSUM_HINT})")
    src.close()
    return r


def verify_datatrove(path: str) -> Report:
    """Check datatrove token files: what opening checks (each index, file size and token size), then every
    file read once (datatrove records no checksums, so the bytes themselves cannot be checked)."""
    from balanced_loader.data.datatrove import DatatroveSource

    r = Report(folder=path, files="datatrove files")
    try:
        src = DatatroveSource(path)
    except ValueError as e:
        r.problems.append(str(e))
        return r
    r.shards, r.docs, r.tokens = len(src.files), src.num_docs, int(src.lengths.sum())
    for f in src.files:
        try:
            file_crc32(f.path)
        except OSError as e:
            r.problems.append(f"{f.path} cannot be read: {e.strerror}")
        r.bytes += int(f.lengths.sum()) * f.token_size
    r.notes.append("no checksums: datatrove token files record none, so token bytes were checked against the "
                   "indexes' sizes only")
    src.close()
    return r
