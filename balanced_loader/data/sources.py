"""Contract 4 sources: a length index (``lengths[doc_id]``) plus, where there is data, token reads.

* a folder of webdataset ``.tar`` shards with a memory-mapped length index (:mod:`.shards`);
* a ``.jsonl`` file with a text field, tokenized on open (an offset index per line);
* an in-memory list/array of lengths, or a length file (``.npy``, ``.txt``, ``.txt.gz``; planning only).

Every source reads a doc's tokens through ``read(doc_id, start, length)``, counting the bytes
it reads in ``bytes_read`` (the loader benchmark compares them with the bytes needed).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from balanced_loader.data.integrity import lengths_fingerprint
from balanced_loader.data.lengths import MAX_DOC_TOKENS, scan_lengths, sum_lengths


class Source(ABC):
    """Base of every source: ``lengths`` ([num_docs] int64) and token reads by doc_id."""

    lengths: np.ndarray  # [num_docs] int64
    shard_bounds: np.ndarray | None = None  # [num_shards + 1] doc offsets, when docs live in shards
    bytes_read: int = 0
    # the vocabulary the tokens come from (ids 0..vocab_size - 1), when the source knows it
    vocab_size: int | None = None
    # the largest token id in the data, when recorded (a shard index keeps it); None: unknown
    max_token_id: int | None = None

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    @property
    def has_tokens(self) -> bool:
        return True

    def describe(self) -> str:
        return type(self).__name__

    @property
    def num_tokens(self) -> int:
        """Tokens of all docs: one streamed pass over ``lengths``, made once (sources that know it override)."""
        n = self.__dict__.get("_num_tokens")
        if n is None:
            n = self._num_tokens = sum_lengths(self.lengths)
        return n

    def tokens(self, doc_id: int) -> np.ndarray:
        """All token ids of one doc (``[length]``, the stored unsigned dtype)."""
        return self.read(doc_id, 0, int(self.lengths[self._check_doc(doc_id)]))

    @abstractmethod
    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of one doc."""

    def prefetch(self, reads: Iterable[tuple[int, int, int]]) -> None:  # noqa: B027 (a hint; most sources ignore it)
        """Hint: ``read(doc_id, start, length)`` for each of ``reads`` follows soon (a remote source fetches
        them concurrently). ``reads`` may be a lazy iterable: a source that ignores the hint leaves it unread."""

    def close(self) -> None:  # noqa: B027 (sources without files have nothing to release)
        """Release file handles (reads reopen them)."""

    def fingerprint(self) -> str:
        """A hash of the length index (doc order included), computed once; loader states carry it."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            fp = self._fingerprint = lengths_fingerprint(np.asarray(self.lengths))
        return fp

    def tokens_fingerprint(self) -> str | None:
        """A hash that changes with the tokens, not only the lengths (loader states carry it): a shard
        folder's from its shards' crc32s, a ``.jsonl``'s from its bytes and tokenizer; ``None`` where the
        source cannot tell cheaply (lengths only, a wrapped dataset)."""
        return None


    def _check_doc(self, doc_id: int) -> int:
        d = int(doc_id)
        if not 0 <= d < self.num_docs:
            raise ValueError(f"doc_id {d} is outside 0..{self.num_docs - 1} of {self.describe()}")
        return d

    def _check_range(self, doc_id: int, start: int, length: int) -> tuple[int, int, int]:
        d = self._check_doc(doc_id)
        start, length = int(start), int(length)
        n = int(self.lengths[d])
        if start < 0 or length < 0 or start + length > n:
            raise ValueError(f"tokens [{start}, {start + length}) are outside doc {d} "
                             f"({n} tokens) of {self.describe()}")
        return d, start, length

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def as_lengths(values: Any, where: str = "lengths") -> np.ndarray:
    """A validated ``[num_docs]`` int64 array of non-negative token counts.

    A 1-D int64 array (a memory map included) is returned as is, not copied, after a check
    streamed in blocks (a memory map's pages are released as it goes), so resident memory does
    not grow with the number of docs; anything else is converted.
    """
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype == np.dtype(np.int64):
        negative, over, top = scan_lengths(values)
        if over is not None:  # the same errors, in the same order, as the converting path below
            raise ValueError(f"{where}: doc {top} has length {values[top]}, over the limit of "
                             f"{MAX_DOC_TOKENS:,} tokens")
        if negative is not None:
            raise ValueError(f"{where}: doc {negative} has a negative length {int(values[negative])}")
        return np.asarray(values)  # [num_docs] the caller's array (a plain view of a memory map)
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not an array of integers ({e})") from None
    if arr.ndim != 1:
        raise ValueError(f"{where}: expected a 1-D list of token counts, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer) and (
            not np.issubdtype(arr.dtype, np.floating) or not np.all(np.floor(arr) == arr)):
        raise ValueError(f"{where}: token counts must be integers (dtype {arr.dtype})")
    if arr.size and float(arr.max()) > MAX_DOC_TOKENS:  # before the cast, which would wrap 2**63 to negative
        i = int(np.argmax(arr))
        raise ValueError(f"{where}: doc {i} has length {arr[i]}, over the limit of {MAX_DOC_TOKENS:,} tokens")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{where}: doc {i} has a negative length {int(arr[i])}")
    return arr


def tokenizer_key(tok: Any) -> Any:
    """A tokenizer identity without its path (the same tokenizer.json may live elsewhere on each machine)."""
    return {k: v for k, v in tok.items() if k != "path"} if isinstance(tok, dict) else tok


def jsonl_text(line: bytes | str, text_field: str, where: str) -> str:
    """The ``text_field`` string of one ``.jsonl`` line; one ``ValueError`` naming ``where`` otherwise."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(obj, dict) or text_field not in obj:
        raise ValueError(f"{where}: no '{text_field}' field; pass the key that holds the text "
                         f"(text_field=, --text-field)")
    text = obj[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: '{text_field}' is not a string")
    return text


class LengthSource(Source):
    """Only lengths: enough to plan, not to materialize microbatches."""

    def __init__(self, lengths: Any, name: str = "a list of lengths", *, checked: bool = False) -> None:
        """``checked``: ``lengths`` is a ``[num_docs]`` int64 array already validated (``read_lengths``)."""
        if checked:
            assert isinstance(lengths, np.ndarray) and lengths.ndim == 1 and lengths.dtype == np.dtype(np.int64)
            self.lengths = np.asarray(lengths)
        else:
            self.lengths = as_lengths(lengths)  # an int64 array or memory map is kept as is (no copy)
        self._name = name

    @property
    def has_tokens(self) -> bool:
        return False

    def describe(self) -> str:
        return self._name

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        raise ValueError(f"{self.describe()} holds lengths only (planning only); open a shard folder or "
                         f"a .jsonl file to read tokens")


class JsonlSource(Source):
    """A ``.jsonl`` file, one doc per non-blank line, text in ``text_field``.

    Tokenized once on open to get the lengths; a read re-tokenizes that line (the last few
    docs are cached, so the segments of a split doc do not re-tokenize it each time).
    """

    def __init__(self, path: str, *, text_field: str = "text", tokenizer: Any = None, cache_docs: int = 8) -> None:
        from balanced_loader.data.tokenizers import get_tokenizer

        self.path = os.fspath(path)
        self.text_field = text_field
        self.tokenizer = get_tokenizer(tokenizer)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_docs = cache_docs
        self._lock = threading.Lock()
        offsets: list[int] = []
        sizes: list[int] = []
        lengths: list[int] = []
        digest = hashlib.blake2b(digest_size=16)  # the file's bytes and the tokenizer: the tokens' identity
        digest.update(json.dumps(tokenizer_key(self.tokenizer.identity()), sort_keys=True).encode())
        top = -1
        try:
            f = open(self.path, "rb")  # noqa: SIM115 (closed by the with below)
        except OSError as e:
            raise ValueError(f"cannot read {self.path}: {e.strerror}") from None
        with f:
            pos = 0
            for lineno, line in enumerate(f, 1):
                digest.update(line)
                if line.strip():
                    toks = self._encode_line(line, lineno)
                    offsets.append(pos)
                    sizes.append(len(line))
                    lengths.append(len(toks))
                    if len(toks):
                        top = max(top, int(np.max(toks)))
                pos += len(line)
        self._tokens_fp = digest.hexdigest()
        self._max_id = top if top >= 0 else None
        self._offsets = np.asarray(offsets, dtype=np.int64)  # [num_docs] byte offset of each line
        self._sizes = np.asarray(sizes, dtype=np.int64)  # [num_docs] bytes of each line
        self.lengths = np.asarray(lengths, dtype=np.int64)  # [num_docs]
        self._fd: int | None = None

    def describe(self) -> str:
        return f"jsonl file {self.path}"

    def tokens_fingerprint(self) -> str | None:
        return self._tokens_fp

    @property
    def vocab_size(self) -> int | None:
        return int(self.tokenizer.vocab_size)

    @property
    def max_token_id(self) -> int | None:
        return self._max_id

    def _encode_line(self, line: bytes, lineno: int) -> np.ndarray:
        return self.tokenizer.encode(jsonl_text(line, self.text_field, f"{self.path} line {lineno}"))

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        d, start, length = self._check_range(doc_id, start, length)
        with self._lock:
            toks = self._cache.get(d)
            if toks is None:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY)
                n = int(self._sizes[d])
                line = os.pread(self._fd, n, int(self._offsets[d]))
                if len(line) != n:
                    raise ValueError(f"{self.path} is shorter than when it was opened (doc {d}); reopen it")
                self.bytes_read += n
                try:
                    toks = self._encode_line(line, d + 1)
                except ValueError:
                    toks = None
                if toks is None or len(toks) != int(self.lengths[d]):
                    raise ValueError(f"{self.path} changed since it was opened (doc {d}); reopen it")
                self._cache[d] = toks
                while len(self._cache) > self._cache_docs:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(d)
        return toks[start:start + length]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_fd=None, _lock=None, _cache=OrderedDict())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
