"""A Hugging Face ``datasets.Dataset`` as a contract-4 source, read straight from its Arrow memory map.

``HFDatasetSource(ds, token_field="input_ids")`` reads a ``list<int>`` / ``large_list<int>`` column:

* a read is a numpy view of the column's values buffer (the Arrow list offsets give where a row's
  tokens start), so no token is copied; when the stored values are signed or wider than the ids
  need, only the read slice is cast to the smallest unsigned dtype that holds every id;
* the lengths (``[num_docs]`` int64) come from the list offsets in one vectorized pass (plus, for
  signed values, one min/max pass to choose the dtype), computed once and cached next to the
  dataset's own cache files, keyed by its fingerprint and the column name
  (``balanced-loader-lengths-<fingerprint>-<column>.npy`` + ``.json``, written atomically); the
  next open memory-maps them. A dataset without cache files (built in memory) keeps them in memory;
* rows selected by ``ds.select`` / ``ds.filter`` / ``ds.shuffle`` (an indices mapping) are the docs
  in that order; a null row is an empty doc (length 0, skipped by the loader like any empty doc).

A text-only dataset is an error saying how to tokenize it with ``ds.map`` (the tokenized dataset
is cached by ``datasets`` itself, so this module never tokenizes). ``datasets`` is imported only
when such a source is opened (an optional dependency: ``pip install 'balanced-loader[datasets]'``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from typing import Any

import numpy as np

from balanced_loader.data.integrity import lengths_fingerprint
from balanced_loader.data.sources import Source
from balanced_loader.data.tokenizers import token_dtype
from balanced_loader.outputs.files import atomic_write, write_json

log = logging.getLogger("balanced_loader")

CACHE_PREFIX = "balanced-loader-lengths"
CACHE_FORMAT = "balanced-loader/hf-lengths"
CACHE_VERSION = 2  # 2: a None row is refused, never cached as an empty doc
_ZERO_COPY = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))  # served as stored, no id check
TOKENIZE_HINT = ('tokenize it first, e.g. ds = ds.map(lambda b: tok(b["text"]), batched=True) with a '
                 'transformers tokenizer (the result is cached by datasets), then open_source(ds)')


def hf_kind(obj: Any) -> str | None:
    """``"dataset"``, ``"dict"`` (a DatasetDict), ``"iterable"`` (an IterableDataset or its dict), or None.

    Never imports ``datasets``: an object of its types exists only once it was imported.
    """
    mod = sys.modules.get("datasets")
    if mod is None:
        return None
    if isinstance(obj, mod.Dataset):
        return "dataset"
    if isinstance(obj, mod.DatasetDict):
        return "dict"
    if isinstance(obj, (mod.IterableDataset, mod.IterableDatasetDict)):
        return "iterable"
    return None


def check_dataset(ds: Any) -> None:
    """One clear ``ValueError`` for a ``datasets`` object that is not a single map-style ``Dataset``."""
    kind = hf_kind(ds)
    if kind == "dict":
        splits = list(ds)
        first = splits[0] if splits else "train"
        raise ValueError(f"a DatasetDict holds the splits {splits}; pick one, e.g. open_source(ds[{first!r}])")
    if kind == "iterable":
        raise ValueError("a streaming IterableDataset has no random access and is unsupported; load it without "
                         "streaming=True (load_dataset(..., streaming=False)), or write it to shards with "
                         "balanced-loader build-shards")
    if kind != "dataset":
        raise ValueError(f"expected a datasets.Dataset, got {type(ds).__name__}")


def _safe(name: str) -> str:
    """A column name as a file-name fragment (the exact name is checked in the ``.json``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]


class HFDatasetSource(Source):
    """A ``datasets.Dataset`` token column (``token_field``) as a source; reads are zero-copy views.

    ``cache=False`` never writes the length cache (it is still read when present). ``vocab_size``:
    the ids' range, when known, for a column of signed (or 64-bit) ids: it sets the dtype without
    the one min/max pass over the values, and each read checks its own ids instead.
    Attributes: ``dtype`` (the returned token dtype), ``cache_path`` (the length cache file, or
    None), ``lengths_computed`` (True when this open computed the lengths instead of reading them).
    """

    def __init__(self, dataset: Any, *, token_field: str = "input_ids", cache: bool = True,
                 vocab_size: int | None = None) -> None:
        check_dataset(dataset)
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or not 1 <= vocab_size <= 1 << 32):
            raise ValueError(f"vocab_size must be an integer in 1..2**32, got {vocab_size!r}")
        self.dataset = dataset
        self.token_field = token_field
        self.vocab_size = vocab_size
        self.bytes_read = 0
        self._mapped = False  # lengths memory-mapped from the cache file
        self._attach()
        self.cache_path = self._cache_path() if dataset.cache_files else None
        meta = self._load_cache()
        self.lengths_computed = meta is None
        if meta is None:
            lengths, meta = self._compute()
            self.lengths = lengths
            if self.cache_path is not None and cache and self._save_cache(lengths, meta):
                self._load_cache()  # the saved file, memory-mapped: its pages can be dropped, a worker re-maps it
        elif self._needs_range() and "max_id" not in meta:  # cached by an open that had vocab_size
            meta.update(self._id_range())
            if cache:
                self._save_meta(meta)
        self._meta = meta
        self._fingerprint = meta["lengths_fingerprint"]
        self.dtype = self._dtype(meta)

    # ---- the Arrow column ------------------------------------------------------------
    def _attach(self) -> None:
        """Column checks and per-chunk row starts (O(chunks)); the chunk views are made on first read."""
        import pyarrow as pa  # datasets depends on pyarrow; imported only on this path

        ds, field = self.dataset, self.token_field
        table = ds.data.table
        if field not in table.column_names:
            hint = f"; {TOKENIZE_HINT}" if "text" in table.column_names else " (pass token_field=)"
            raise ValueError(f"the dataset has no token column '{field}' (columns: {table.column_names}){hint}")
        typ = table.schema.field(field).type
        if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not pa.types.is_integer(typ.value_type):
            raise ValueError(f"column '{field}' is {typ}, not a list of integer token ids (list<int> or "
                             f"large_list<int>); pass token_field= naming the token column, or {TOKENIZE_HINT}")
        self._column = table.column(field)  # pa.ChunkedArray of list arrays, memory-mapped
        self._starts = np.cumsum([0] + [len(c) for c in self._column.chunks], dtype=np.int64)  # [chunks + 1]
        self._values_dtype = np.dtype(typ.value_type.to_pandas_dtype())
        self._views: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # chunk -> (offsets, values) views
        self._indices = None
        if ds._indices is not None:  # select/filter/shuffle: doc d is table row indices[d]
            col = ds._indices.column(0)
            self._indices = col
            self._index_starts = np.cumsum([0] + [len(c) for c in col.chunks], dtype=np.int64)
            self._index_views: dict[int, np.ndarray] = {}
        if len(ds) != (len(self._indices) if self._indices is not None else table.num_rows):
            raise ValueError("the dataset's row count does not match its Arrow table; call ds.flatten_indices()")

    def _chunk(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        v = self._views.get(k)
        if v is None:
            arr = self._column.chunk(k)
            vals = arr.values  # the whole child array (ignores the chunk's slice offset; offsets index it)
            if vals.null_count:
                raise ValueError(f"column '{self.token_field}' holds null token ids (chunk {k}); fill or drop them")
            # zero-copy numpy views of the memory-mapped Arrow buffers
            v = (arr.offsets.to_numpy(zero_copy_only=True), vals.to_numpy(zero_copy_only=True))
            self._views[k] = v
        return v

    def _row(self, d: int) -> int:
        if self._indices is None:
            return d
        k = int(np.searchsorted(self._index_starts, d, side="right")) - 1
        view = self._index_views.get(k)
        if view is None:
            view = self._index_views[k] = self._indices.chunk(k).to_numpy(zero_copy_only=True)
        return int(view[d - self._index_starts[k]])

    # ---- lengths: computed once, cached next to the dataset ------------------------------
    def _cache_path(self) -> str:
        folder = os.path.dirname(os.path.abspath(self.dataset.cache_files[0]["filename"]))
        return os.path.join(folder, f"{CACHE_PREFIX}-{self.dataset._fingerprint}-{_safe(self.token_field)}.npy")

    def _load_cache(self) -> dict[str, Any] | None:
        """The cached metadata with ``self.lengths`` memory-mapped, or None when absent or stale."""
        if self.cache_path is None:
            return None
        meta_path = self.cache_path[:-len(".npy")] + ".json"
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            want = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "fingerprint": self.dataset._fingerprint,
                    "token_field": self.token_field, "num_docs": len(self.dataset)}
            if any(meta.get(k) != v for k, v in want.items()):
                return None
            lengths = np.load(self.cache_path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return None
        if lengths.dtype != np.int64 or lengths.shape != (len(self.dataset),):
            return None
        self.lengths = np.asarray(lengths)  # [num_docs] int64, memory-mapped (a plain view: fast indexing)
        self._mapped = True
        return meta

    def _compute(self) -> tuple[np.ndarray, dict[str, Any]]:
        """Lengths from the list offsets (vectorized), and the id range when the values are not unsigned."""
        import pyarrow.compute as pc  # see _attach

        col = self._column
        if col.null_count:  # a None row is not an empty doc (a None id is refused too): one line naming it
            row = int(pc.index(pc.is_null(col), True).as_py())
            raise ValueError(f"row {row} of column '{self.token_field}' is None (null) ({col.null_count} such "
                             f"row(s)); fill or drop them (e.g. ds.filter(lambda r: r['{self.token_field}'] "
                             f"is not None)): an empty doc is an empty list")
        lengths = pc.list_value_length(col).to_numpy().astype(np.int64)  # [num_rows]
        if self._indices is not None:
            lengths = lengths[self._indices.to_numpy()]  # [num_docs]
        meta: dict[str, Any] = {"format": CACHE_FORMAT, "version": CACHE_VERSION,
                                "fingerprint": self.dataset._fingerprint, "token_field": self.token_field,
                                "num_docs": len(lengths), "num_tokens": int(lengths.sum()),
                                "lengths_fingerprint": lengths_fingerprint(lengths)}
        if self._needs_range():
            meta.update(self._id_range())
        return lengths, meta

    def _needs_range(self) -> bool:
        return self._values_dtype not in _ZERO_COPY and self.vocab_size is None

    def _id_range(self) -> dict[str, Any]:
        """The smallest dtype needs the largest id: one min/max pass over the values (of every row,
        selected or not); it touches every page of the column once (then the lengths cache has it)."""
        import pyarrow.compute as pc  # see _attach

        mm = pc.min_max(pc.list_flatten(self._column)).as_py()
        return {"min_id": mm["min"], "max_id": mm["max"]}

    def _save_meta(self, meta: dict[str, Any]) -> None:
        if self.cache_path is not None and os.path.exists(self.cache_path):
            try:
                write_json(self.cache_path[:-len(".npy")] + ".json", meta)
            except OSError as e:
                log.warning("cannot update the length cache of %s (%s)", self.describe(), e)

    def _save_cache(self, lengths: np.ndarray, meta: dict[str, Any]) -> bool:
        """The ``.npy`` first, then the ``.json`` that marks it complete; a read-only folder keeps them in memory."""
        assert self.cache_path is not None
        try:
            with atomic_write(self.cache_path, "wb") as f:
                np.save(f, lengths)
            write_json(self.cache_path[:-len(".npy")] + ".json", meta)
        except OSError as e:
            log.warning("cannot cache the lengths of %s (%s); they stay in memory", self.describe(), e)
            return False
        return True

    def _dtype(self, meta: dict[str, Any]) -> np.dtype:
        vals = self._values_dtype
        if self.vocab_size is not None:
            dt = token_dtype(self.vocab_size)
            # a read checks its ids when the stored values could hold one the dtype cannot
            self._check_reads = vals.kind != "u" or vals.itemsize > dt.itemsize
            return dt
        self._check_reads = False
        if vals in _ZERO_COPY:
            return vals
        lo, hi = meta.get("min_id"), meta.get("max_id")
        if lo is None:  # no token at all
            return np.dtype(np.uint8)
        if lo < 0:
            raise ValueError(f"column '{self.token_field}' holds a negative token id ({lo}); token ids must be >= 0")
        if hi >= 1 << 32:
            raise ValueError(f"column '{self.token_field}' holds token id {hi}, over the 32-bit limit")
        return token_dtype(hi + 1)

    # ---- Source -------------------------------------------------------------------------
    def tokens_fingerprint(self) -> str | None:
        """The dataset's own fingerprint (``datasets`` changes it with every transform) and the column."""
        return f"hf:{self.dataset._fingerprint}:{self.token_field}"

    @property
    def max_token_id(self) -> int | None:
        v = self._meta.get("max_id")
        return int(v) if v is not None else None

    def describe(self) -> str:
        return f"Hugging Face dataset ({len(self.lengths)} rows, column '{self.token_field}')"

    @property
    def num_tokens(self) -> int:
        return int(self._meta["num_tokens"])

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        d, start, length = self._check_range(doc_id, start, length)
        row = self._row(d)
        k = int(np.searchsorted(self._starts, row, side="right")) - 1
        offsets, values = self._chunk(k)
        a = int(offsets[row - self._starts[k]]) + start
        out = values[a:a + length]  # [length] a view of the Arrow buffer
        self.bytes_read += out.nbytes
        if self._check_reads and out.size and (int(out.min()) < 0 or int(out.max()) >= self.vocab_size):
            bad = out[(out < 0) | (out >= self.vocab_size)][0]
            raise ValueError(f"doc {d} of {self.describe()} holds token id {bad}, outside vocab_size {self.vocab_size}")
        if out.dtype != self.dtype:  # ids were range-checked (on open, or just above): only this slice is cast
            out = out.astype(self.dtype)
        return out

    def __getstate__(self) -> dict[str, Any]:
        # the Arrow objects and views are rebuilt from the dataset (which pickles its memory-mapped
        # files by path); cached lengths are re-mapped, in-memory ones travel as they are
        return {"dataset": self.dataset, "token_field": self.token_field, "vocab_size": self.vocab_size,
                "meta": self._meta,
                "cache_path": self.cache_path, "lengths": None if self._mapped else self.lengths}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dataset, self.token_field, self.vocab_size = state["dataset"], state["token_field"], state["vocab_size"]
        self.cache_path, self._meta = state["cache_path"], state["meta"]
        self.bytes_read = 0
        self.lengths_computed = self._mapped = False
        self._attach()
        if state["lengths"] is not None:
            self.lengths = state["lengths"]
        elif self._load_cache() is None:
            raise ValueError(f"the length cache {self.cache_path} of a Hugging Face dataset disappeared; reopen it")
        self._fingerprint = self._meta["lengths_fingerprint"]
        self.dtype = self._dtype(self._meta)
