"""Tokenizing input files into a shard folder (``balanced-loader build-shards``).

Docs: one per file, or one per non-blank line of a ``.jsonl`` file, in input order. The input is
cut into byte ranges of ``CHUNK_BYTES`` (the docs of a range: those whose first byte lies in it,
the rule of parts below); ``workers`` processes each read, parse and tokenize whole ranges (a
Hugging Face tokenizer with batch calls) and the parent writes the results in range order, so the
folder is byte-identical whatever the number of workers. At most ``2 * workers + 1`` ranges are in
flight, so memory stays bounded for any corpus size, and the parent never reads the input.

Parts (``part=(K, N)``, ``--part K/N``) split one build over machines with no coordination.
The rule: the input files, in order, form one byte stream of ``B`` bytes; part ``K`` owns the
byte range ``[K*B//N, (K+1)*B//N)`` (the last part runs to the end), and a doc belongs to the
part whose range holds its first byte (a ``.jsonl`` line's first byte, a whole file's first byte).
So each machine reads only its range (a big ``.jsonl`` is entered at its range with one seek),
the parts are contiguous runs of the whole build's doc stream, and opened together in part order
(``open_source([dir0, dir1, ...])``) they hold exactly the docs of one whole build, in its order.
A part whose range starts no doc (more parts than docs) is an empty folder with only
``shards.json``; readers of parts count it as 0 docs.
"""

from __future__ import annotations

import bisect
import fnmatch
import glob
import hashlib
import itertools
import json
import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from balanced_loader.outputs.files import remove_partials
from balanced_loader.data.index import META_FILE, read_index_json
from balanced_loader.outputs.locks import OutputLock
from balanced_loader.build.writer import ShardWriter
from balanced_loader.data.sources import jsonl_text
from balanced_loader.data.tokenizers import encode_many, get_tokenizer, token_dtype

CHUNK_BYTES = 4 << 20  # input bytes per task: a worker reads and tokenizes the docs that start in them
CHUNK_DOCS = 512  # most docs per batch call of the tokenizer
DECODE_ERRORS = ("error", "replace")


def expand_inputs(specs: list[str]) -> list[str]:
    """Files from paths, folders (every file under them but hidden ones and ``__pycache__``) and globs,
    in order, without repeats (one file reached by two paths, e.g. through a symlink, counts once)."""
    out: list[str] = []
    for spec in specs:
        if os.path.isdir(spec):
            found = []
            for root, dirs, files in os.walk(spec):  # does not follow symlinked folders: no loops
                dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
                found.extend(os.path.join(root, f) for f in files if not f.startswith("."))
            found.sort()
        elif os.path.isfile(spec):
            found = [spec]
        elif any(c in spec for c in "*?["):
            found = sorted(p for p in glob_files(spec) if os.path.isfile(p))
            if not found:
                raise ValueError(f"the pattern {spec} matches no files")
        else:
            raise ValueError(f"input {spec} does not exist")
        out.extend(found)
    seen: set[tuple[int, int]] = set()
    unique = []
    for p in out:
        st = os.stat(p)
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            unique.append(p)
    return unique


def _match(pattern: list[str], parts: list[str]) -> bool:
    """Whether path components ``parts`` match glob components ``pattern`` (``**``: any number of
    folders; a name starting with ``.`` only matches a pattern starting with ``.``, as in ``glob``)."""
    if not pattern:
        return not parts
    head = pattern[0]
    if head == "**":
        for i in range(len(parts) + 1):
            if i and parts[i - 1].startswith("."):
                return False
            if _match(pattern[1:], parts[i:]):
                return True
        return False
    if not parts or (parts[0].startswith(".") and not head.startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and _match(pattern[1:], parts[1:])


def glob_files(spec: str) -> list[str]:
    """``glob.glob(spec, recursive=True)``, but a ``**`` walk that follows a symlink to a folder it is
    already inside (a loop, which makes ``glob`` run for hours) or has seen visits it once."""
    if "**" not in spec:
        return glob.glob(spec)  # one level per component: no recursion, no loop
    comps = spec.split(os.sep)
    k = next(i for i, c in enumerate(comps) if any(ch in c for ch in "*?["))
    root = os.sep.join(comps[:k]) or ("." if not spec.startswith(os.sep) else os.sep)
    if not os.path.isdir(root):
        return []
    pattern = comps[k:]
    seen: set[tuple[int, int]] = set()
    out = []
    for dirpath, dirs, files in os.walk(root, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:  # a loop or a second way into a folder: not again
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = os.path.relpath(dirpath, root)
        base = [] if rel == "." else rel.split(os.sep)
        out.extend(os.path.join(dirpath, f) for f in files if _match(pattern, [*base, f]))
    return out


# ---------------------------------------------------------------------------------------------
# The input set and its parts
# ---------------------------------------------------------------------------------------------


def parse_part(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``0 <= K < N``; one ``ValueError`` otherwise."""
    k, sep, n = str(text).partition("/")
    try:
        kk, nn = int(k, 10), int(n, 10)
    except ValueError:
        kk = nn = -1
    if not sep or nn < 1 or not 0 <= kk < nn or nn > 1 << 20:
        raise ValueError(f"--part must be K/N with 0 <= K < N (e.g. 0/4 for the first of 4 machines), got {text!r}")
    return kk, nn


def file_sizes(files: list[str]) -> list[int]:
    sizes = []
    for path in files:
        try:
            sizes.append(os.path.getsize(path))
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
    return sizes


def input_identity(files: list[str], sizes: list[int], text_field: str) -> dict[str, Any]:
    """What identifies the input set of a build: file names relative to their common folder, sizes and the
    text field, hashed (so parts built on machines that mount the data at different roots still agree)."""
    absolute = [os.path.abspath(f) for f in files]
    root = os.path.dirname(absolute[0]) if len(absolute) == 1 else os.path.commonpath(absolute)
    names = [os.path.relpath(f, root).replace(os.sep, "/") for f in absolute]
    blob = json.dumps({"files": list(zip(names, sizes, strict=True)), "text_field": text_field}, sort_keys=True)
    return {"files": len(files), "bytes": int(sum(sizes)), "sha256": hashlib.sha256(blob.encode()).hexdigest()}


class ContentHash:
    """A blake2b of every byte of the input files (each file's size, then its bytes, in order), computed in a
    background thread while the build runs: what a part records so that parts of builds from inputs that
    changed in between (same names and sizes, other bytes) refuse to combine. Each part reads all the
    input once more for it (hashing runs at memory speed, beside the tokenizer)."""

    CHUNK = 1 << 20

    def __init__(self, files: list[str]) -> None:
        self.files = list(files)
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="balanced-loader-input-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        h = hashlib.blake2b(digest_size=16)
        try:
            for path in self.files:
                with open(path, "rb") as f:
                    h.update(f"{os.fstat(f.fileno()).st_size}:".encode())
                    while block := f.read(self.CHUNK):
                        if self._stop.is_set():
                            return
                        h.update(block)
        except OSError as e:
            self._error = e
            return
        self._digest = h.hexdigest()

    def result(self) -> str:
        self._thread.join()
        if self._digest is None:
            e = self._error
            raise ValueError(f"cannot read the input to hash it: {getattr(e, 'strerror', None) or e}")
        return self._digest

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def part_range(total_bytes: int, k: int, n: int) -> tuple[int, int]:
    """Input-stream bytes ``[lo, hi)`` whose docs part ``k`` of ``n`` owns (``hi`` of the last part: no limit)."""
    lo = k * total_bytes // n
    hi = (k + 1) * total_bytes // n if k < n - 1 else sys.maxsize
    return lo, hi


@dataclass(frozen=True, kw_only=True)
class RawDoc:
    """One doc as read: its bytes (a ``.jsonl`` line or a whole file) and where it came from, for errors."""

    data: bytes
    jsonl: bool
    where: str


class InputStream:
    """The input files, in order, as one byte stream: ``docs(lo, hi)`` are the docs whose first byte lies in
    ``[lo, hi)`` (a ``.jsonl`` line's first byte, a whole file's first byte)."""

    def __init__(self, files: list[str], sizes: list[int]) -> None:
        self.files = list(files)
        self.sizes = [int(x) for x in sizes]
        self.starts = list(itertools.accumulate([0, *self.sizes[:-1]]))  # [files] where each file starts
        self.total = sum(self.sizes)

    def docs(self, lo: int = 0, hi: int = sys.maxsize) -> Iterator[RawDoc]:
        """Those docs in order, reading only their bytes (a line that starts before ``lo`` is skipped with
        block reads that stop at ``hi``, so a range inside one huge line reads at most its own bytes)."""
        i = max(0, bisect.bisect_left(self.starts, lo) - 1)  # the file holding byte lo (or the first after it)
        for path, first, size in zip(self.files[i:], self.starts[i:], self.sizes[i:], strict=True):
            if first >= hi:
                return
            if not path.endswith(".jsonl"):
                if first >= lo:
                    yield RawDoc(data=_read_file(path), jsonl=False, where=path)
            elif first + size > lo:
                yield from _jsonl_docs(path, max(0, lo - first), hi - first)


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None


def _next_line_start(f: Any, pos: int, end: int) -> int | None:
    """The first line start at or after ``pos > 0`` (just after a newline at ``pos - 1`` or later); ``None``
    when there is none before ``end`` or the end of the file."""
    at = pos - 1
    f.seek(at)
    while at < end:
        block = f.read(1 << 16)
        if not block:
            return None
        k = block.find(b"\n")
        if k >= 0:
            return at + k + 1 if at + k + 1 < end else None
        at += len(block)
    return None


def _jsonl_docs(path: str, pos: int, end: int) -> Iterator[RawDoc]:
    """The non-blank lines of one ``.jsonl`` file that start in its bytes ``[pos, end)``."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed by the with below)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    with f:
        lineno = 1 if pos == 0 else None  # line numbers are known only when the file is read from its start
        if pos:
            start = _next_line_start(f, pos, end)
            if start is None:
                return
            pos = start
            f.seek(pos)
        while pos < end:
            line = f.readline()
            if not line:
                return
            if line.strip():
                yield RawDoc(data=line, jsonl=True,
                             where=f"{path} line {lineno}" if lineno is not None else f"{path} line at byte {pos}")
            pos += len(line)
            if lineno is not None:
                lineno += 1


def read_docs(files: list[str], sizes: list[int], lo: int = 0, hi: int = sys.maxsize) -> Iterator[RawDoc]:
    """The docs whose first byte lies in ``[lo, hi)`` of the input stream, in order."""
    return InputStream(files, sizes).docs(lo, hi)


def sub_ranges(lo: int, hi: int, total: int, step: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` cut every ``step`` bytes (the last piece keeps ``hi``); empty: ``[(lo, hi)]``."""
    a = lo
    while a + step < min(hi, total):
        yield a, a + step
        a += step
    yield a, hi


# ---------------------------------------------------------------------------------------------
# Reading and tokenizing byte ranges, in this process or in workers
# ---------------------------------------------------------------------------------------------


class RangeEncoder:
    """Reads and tokenizes the docs of one input byte range: ``(tokens, lengths, input_bytes, decode_errors)``,
    all docs' ids concatenated (one array: cheap to send back from a worker), ``[docs]`` int64 lengths and
    the number of docs whose bytes were not valid UTF-8 (replaced, with ``decode_errors="replace"``).

    Text is decoded strictly: a ``.jsonl`` line, or a whole file for a tokenizer that reads text (a
    Hugging Face one), that is not valid UTF-8 is one ``ValueError`` naming it and the byte, unless
    ``decode_errors="replace"`` (invalid bytes become U+FFFD, and the doc is counted)."""

    def __init__(self, stream: InputStream, tokenizer: Any, text_field: str, batch_docs: int,
                 decode_errors: str = "error") -> None:
        self.stream = stream
        self.tok = tokenizer
        self.text_field = text_field
        self.batch_docs = batch_docs
        self.decode_errors = decode_errors
        self.text = bool(getattr(tokenizer, "reads_text", False))  # the byte tokenizer takes a file's raw bytes

    def _decode(self, data: bytes, where: str) -> tuple[str, bool]:
        """``(text, whether invalid bytes were replaced)``."""
        try:
            return data.decode("utf-8"), False
        except UnicodeDecodeError as e:
            if self.decode_errors == "replace":
                return data.decode("utf-8", errors="replace"), True
            raise ValueError(f"{where} is not valid UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                             f"fix the file, or pass --decode-errors replace (decode_errors='replace') to replace "
                             f"invalid bytes with U+FFFD (the docs are counted)") from None

    def _doc(self, d: RawDoc) -> tuple[Any, bool]:
        if d.jsonl:
            text, bad = self._decode(d.data, d.where)
            return jsonl_text(text, self.text_field, d.where), bad
        return self._decode(d.data, d.where) if self.text else (d.data, False)

    def __call__(self, rng: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, int, int]:
        ids: list[np.ndarray] = []
        nbytes = bad = 0
        batch: list[Any] = []
        for d in itertools.chain(self.stream.docs(*rng), [None]):
            if d is not None:
                doc, replaced = self._doc(d)
                batch.append(doc)
                bad += replaced
                nbytes += len(d.data)
            if batch and (d is None or len(batch) >= self.batch_docs):  # one batch call of the tokenizer
                ids.extend(np.asarray(a) for a in encode_many(self.tok, batch))
                batch = []
        lengths = np.array([len(a) for a in ids], dtype=np.int64)  # [docs]
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint8)  # [sum(lengths)]
        return flat, lengths, nbytes, bad


_worker_fn: Any = None


def _init_worker(fn: Any) -> None:
    global _worker_fn
    # the processes are the parallelism: keep each HF batch call on one thread (read when the tokenizer runs)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_fn = fn


def _call_worker_fn(item: Any) -> Any:
    return _worker_fn(item)


def ordered_map(fn: Any, items: Iterator[Any], workers: int) -> Iterator[Any]:
    """``fn(item)`` for each item, in order, computed in ``workers`` processes (``fn`` is pickled once to each)
    with at most ``2 * workers + 1`` items in flight: an ordered imap that reads ahead a bounded amount."""
    methods = multiprocessing.get_all_start_methods()
    # never fork: the parent may hold threads (a tokenizer's pool, tqdm) that a forked child would inherit locked
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(fn,)) as pool:
        pending: deque[Future] = deque()
        try:
            for item in items:
                pending.append(pool.submit(_call_worker_fn, item))
                if len(pending) > 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()


# ---------------------------------------------------------------------------------------------
# The build
# ---------------------------------------------------------------------------------------------


def build_from_files(files: list[str], out_dir: str, *, tokenizer: Any = None, text_field: str = "text",
                     max_shard_bytes: int = 256 << 20, max_docs_per_shard: int = 100_000,
                     progress: bool = False, workers: int = 1, part: tuple[int, int] | str | None = None,
                     chunk_docs: int = CHUNK_DOCS, chunk_bytes: int = CHUNK_BYTES,
                     decode_errors: str = "error") -> dict[str, Any]:
    """Tokenize files into a shard folder (one doc per file, or per line of a ``.jsonl``); returns its metadata
    (``shards.json``) plus ``"build"``: ``{"seconds", "docs", "input_bytes", "docs_per_s", "mb_per_s",
    "workers"}`` (not stored: the folder does not depend on timing).

    ``workers``: processes that read, parse and tokenize (the same folder for any number). ``part``: ``(K, N)`` or
    ``"K/N"``: build only part ``K`` of ``N`` (see the module doc for the rule); ``shards.json`` and
    ``index.json`` then record ``part``, and always ``inputs`` (the input set's identity). ``chunk_bytes``:
    input bytes per task (a worker reads and tokenizes the docs that start in them); ``chunk_docs``: most
    docs per batch call of the tokenizer. ``decode_errors``: ``"error"`` (default: text that is not valid
    UTF-8 is refused, naming the file) or ``"replace"`` (U+FFFD, counted in ``shards.json`` and the summary).

    ``out_dir`` is locked while it is written (a second build on it fails at once, naming this one) and
    published whole at the end (:class:`~balanced_loader.data.shards.ShardWriter`): a failed build leaves
    it as it was. A part (``part=``) records a content hash of every input byte (``inputs.content``),
    so parts of builds from inputs that changed in between refuse to combine.
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 1024:
        raise ValueError(f"workers must be an integer in 1..1024, got {workers!r}")
    k, n = parse_part(part) if isinstance(part, str) else (part if part is not None else (0, 1))
    if part is not None and not (isinstance(k, int) and isinstance(n, int) and 0 <= k < n):
        raise ValueError(f"part must be (K, N) with 0 <= K < N, got {part!r}")
    if decode_errors not in DECODE_ERRORS:
        raise ValueError(f"decode_errors must be one of {', '.join(DECODE_ERRORS)}, got {decode_errors!r}")
    if chunk_docs < 1 or chunk_bytes < 1:
        raise ValueError(f"chunk_docs and chunk_bytes must be >= 1, got {chunk_docs} and {chunk_bytes}")
    tok = get_tokenizer(tokenizer)
    if not files:
        raise ValueError("no input files to build shards from")
    if workers > 1:
        try:  # workers get the tokenizer pickled
            pickle.dumps(tok)
        except Exception as e:  # pickling raises many types (PicklingError, TypeError, AttributeError)
            raise ValueError(f"the tokenizer {type(tok).__name__} cannot be sent to worker processes ({e}); "
                             f"use workers=1 or a picklable tokenizer") from None
    with OutputLock(out_dir, "--out"):
        remove_partials(out_dir)  # staging folders of a killed build of this --out (no one else is writing it)
        return _build(files, out_dir, tok, text_field=text_field, max_shard_bytes=max_shard_bytes,
                      max_docs_per_shard=max_docs_per_shard, progress=progress, workers=workers, part=part, k=k, n=n,
                      chunk_docs=chunk_docs, chunk_bytes=chunk_bytes, decode_errors=decode_errors)


def _build(files: list[str], out_dir: str, tok: Any, *, text_field: str, max_shard_bytes: int,
           max_docs_per_shard: int, progress: bool, workers: int, part: Any, k: int, n: int, chunk_docs: int,
           chunk_bytes: int, decode_errors: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    sizes = file_sizes(files)
    inputs = input_identity(files, sizes, text_field)
    lo, hi = part_range(inputs["bytes"], k, n)
    extra: dict[str, Any] = {"inputs": inputs}
    if part is not None:
        extra["part"] = {"index": k, "count": n, "input_bytes": [lo, min(hi, inputs["bytes"])]}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=min(hi, inputs["bytes"]) - lo, desc="building shards" + (f" (part {k}/{n})" if part else ""),
                   unit="B", unit_scale=True)
    read_bytes = bad_docs = 0
    hasher = ContentHash(files) if part is not None else None  # every input byte, beside the build (a thread)
    stream = InputStream(files, sizes)
    encoder = RangeEncoder(stream, tok, text_field, chunk_docs, decode_errors)
    ranges = sub_ranges(lo, hi, stream.total, chunk_bytes)
    results = map(encoder, ranges) if workers == 1 else ordered_map(encoder, ranges, workers)
    try:
        with ShardWriter(out_dir, dtype=token_dtype(tok.vocab_size), tokenizer=tok.identity(),
                         max_shard_bytes=max_shard_bytes, max_docs_per_shard=max_docs_per_shard,
                         extra=extra, allow_empty=part is not None) as w:
            for flat, lengths, nbytes, bad in results:  # in range order, whatever the number of workers
                ends = np.cumsum(lengths)
                for i, e in enumerate(ends.tolist()):
                    w.add(flat[e - int(lengths[i]):e])
                read_bytes += nbytes
                bad_docs += bad
                if bar is not None:
                    bar.update(nbytes)
                    bar.set_postfix(docs=w.num_docs, tokens=w.num_tokens, refresh=False)
            if not w.num_docs and part is None:
                raise ValueError(f"the {len(files)} input file(s) hold no docs (every .jsonl line is blank)")
            if hasher is not None:
                w.extra["inputs"] = {**inputs, "content": hasher.result()}
            if bad_docs:
                w.extra["decode_errors"] = {"docs": bad_docs, "replaced_with": "U+FFFD"}
    finally:
        if hasattr(results, "close"):  # stop the workers now when the writer failed
            results.close()
        if hasher is not None:
            hasher.stop()
        if bar is not None:
            bar.close()
    meta = read_index_json(os.path.join(out_dir, META_FILE))
    dt = max(time.perf_counter() - t0, 1e-9)
    meta["build"] = {"seconds": dt, "docs": meta["num_docs"], "input_bytes": read_bytes,
                     "docs_per_s": meta["num_docs"] / dt, "mb_per_s": read_bytes / 2**20 / dt, "workers": workers,
                     "decode_errors": bad_docs}
    return meta
