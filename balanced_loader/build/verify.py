"""A full check of a shard folder (``balanced-loader verify DIR``): reads every byte once, changes nothing.

Checks, in order: the index lists exactly the ``.tar`` files present with their sizes; the index
arrays equal a fresh scan of the tar headers; the lengths fingerprint; each shard's crc32;
every doc's member headers and block checksums (the same checks a read does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from balanced_loader.data.index import INDEX_FILE, build_index, index_problems, read_index_json, reindex_hint
from balanced_loader.data.integrity import file_crc32, lengths_fingerprint
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

    def summary(self) -> str:
        state = f"{len(self.problems)} problem(s)" if self.problems else "no problems"
        return (f"{self.folder}: {self.shards} shards, {self.docs:,} docs, {self.tokens:,} tokens, "
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


def verify_folder(folder: str) -> Report:
    """Check a shard folder fully (see the module doc); never raises for a corrupt folder."""
    folder = os.fspath(folder)
    if is_url(folder):
        raise ValueError(f"{folder}: verify checks a local folder (it reads every byte); run it before uploading, "
                         f"or on a downloaded copy (reading from the URL checks every doc it reads anyway)")
    if not os.path.isdir(folder):
        raise ValueError(f"shard folder {folder} does not exist")
    r = Report(folder=folder)
    if not _index_problems(folder, r):
        return r
    try:
        src = ShardSource(folder, verify="full", allow_part=True)
    except ValueError as e:
        r.problems.append(str(e))
        return r
    r.shards, r.docs, r.tokens = len(src.shard_names), src.num_docs, src.num_tokens
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
