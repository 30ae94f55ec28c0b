"""``balanced_loader.wrap``: an existing torch ``DataLoader`` or map-style ``Dataset`` as a BalancedLoader.

The dataset keeps its samples; the BalancedLoader takes over ordering, batching and the
split across ranks (the DataLoader's own sampler, batch size and collate function are not
used, so nothing is sharded twice). Lengths come from ``lengths=`` (fastest), a
``length_fn(sample)``, or the length of each sample's tokens (one pass over the dataset).
A Hugging Face ``datasets.Dataset`` (without those arguments) is opened as
``open_source(ds)`` instead: its ``input_ids`` column is read from the Arrow files, no pass.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from balanced_loader.data.hf_datasets import HFDatasetSource, hf_kind
from balanced_loader.data.sources import Source, as_lengths
from balanced_loader.loader_args import MAX_TOKEN_ID


def default_tokens(sample: Any) -> np.ndarray:
    """Token ids of a sample: an array, tensor or list; a dict's ``input_ids``; a tuple's first item."""
    if isinstance(sample, dict):
        if "input_ids" not in sample:
            raise ValueError(f"sample dict has no 'input_ids' (keys {sorted(sample)}); pass tokens_fn=")
        sample = sample["input_ids"]
    elif isinstance(sample, tuple) and sample:
        sample = sample[0]
    if hasattr(sample, "detach") and hasattr(sample, "cpu"):  # a torch tensor, without importing torch
        sample = sample.detach().cpu().numpy()
    arr = np.asarray(sample)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"a sample's tokens must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}; "
                         f"pass tokens_fn= to extract them")
    return arr


class DatasetSource(Source):
    """A map-style dataset (``len`` and ``__getitem__``) whose samples hold token ids."""

    def __init__(self, dataset: Any, *, lengths: Any = None, length_fn: Callable[[Any], int] | None = None,
                 tokens_fn: Callable[[Any], Any] | None = None, cache_docs: int = 8,
                 vocab_size: int | None = None) -> None:
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or not 1 <= vocab_size <= MAX_TOKEN_ID + 1):
            raise ValueError(f"vocab_size must be an integer in 1..2**32, got {vocab_size!r}")
        self.vocab_size = vocab_size
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(f"{type(dataset).__name__} is not a map-style dataset (needs __len__ and "
                             f"__getitem__); for a stream, build shards with balanced-loader build-shards")
        self.dataset = dataset
        self.tokens_fn = tokens_fn or default_tokens
        n = len(dataset)
        if lengths is None:
            if length_fn is not None:
                lengths = [int(length_fn(self._sample(i))) for i in range(n)]
            else:
                lengths = [len(self._tokens_of(self._sample(i), i)) for i in range(n)]
        self.lengths = as_lengths(lengths, where="dataset lengths")
        if len(self.lengths) != n:
            raise ValueError(f"{len(self.lengths)} lengths given for a dataset of {n} samples")
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_docs = cache_docs
        self._lock = threading.Lock()
        self.bytes_read = 0

    def describe(self) -> str:
        return f"dataset {type(self.dataset).__name__}"

    def _sample(self, i: int) -> Any:
        """``dataset[i]``, with a lookup failure as one clear line (a dict or a stream is not indexable by 0..n-1)."""
        try:
            return self.dataset[i]
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{self.describe()}: dataset[{i}] raised {type(e).__name__}: {e}; wrap needs a "
                             f"map-style dataset whose samples are dataset[0] .. dataset[len - 1]") from None

    def _tokens_of(self, sample: Any, i: int) -> np.ndarray:
        toks = np.asarray(self.tokens_fn(sample))
        if toks.ndim != 1:
            raise ValueError(f"sample {i}: tokens_fn returned shape {toks.shape}; expected 1-D token ids")
        if toks.size:  # token ids are vocabulary indices: never negative, never past the vocabulary
            if not np.issubdtype(toks.dtype, np.integer):
                raise ValueError(f"sample {i}: token ids must be integers, got dtype {toks.dtype}")
            lo, hi = int(toks.min()), int(toks.max())
            top = (self.vocab_size - 1) if self.vocab_size is not None else MAX_TOKEN_ID
            if lo < 0 or hi > top:
                bad = lo if lo < 0 else hi
                where = f"vocab_size {self.vocab_size}" if self.vocab_size is not None else "the 32-bit id range"
                raise ValueError(f"sample {i} holds token id {bad}, outside {where} (ids 0..{top}); fix the "
                                 f"dataset or its tokens_fn")
        return toks

    def read(self, doc_id: int, start: int, length: int) -> np.ndarray:
        d, start, length = self._check_range(doc_id, start, length)
        with self._lock:
            toks = self._cache.get(d)
            if toks is not None:
                self._cache.move_to_end(d)
        if toks is None:
            toks = self._tokens_of(self._sample(d), d)
            if len(toks) != int(self.lengths[d]):
                raise ValueError(f"sample {d} has {len(toks)} tokens but its length is {int(self.lengths[d])}; "
                                 f"the lengths do not match the dataset")
            with self._lock:
                self.bytes_read += toks.nbytes
                self._cache[d] = toks
                while len(self._cache) > self._cache_docs:
                    self._cache.popitem(last=False)
        return toks[start:start + length]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_lock=None, _cache=OrderedDict())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def wrap(data: Any, *, lengths: Any = None, length_fn: Callable[[Any], int] | None = None,
         tokens_fn: Callable[[Any], Any] | None = None, vocab_size: int | None = None, **loader_kwargs: Any):
    """A :class:`~balanced_loader.loader.BalancedLoader` over a torch ``DataLoader``/``Dataset``.

    ``loader_kwargs`` are the BalancedLoader's (``policy``, ``cost``, ``world_size``, ``rank``,
    ``global_batch_tokens``, ``cp``, ...); they are checked before any pass over the data. A
    DataLoader contributes only its dataset, which must be map-style (an ``IterableDataset`` has
    no random access; build shards instead). A dict of columns uses its ``input_ids`` column
    (one token sequence per sample). Token ids are checked as samples are read: negative ids, or ids at
    or past ``vocab_size`` (default: the 32-bit range), are one ``ValueError`` naming the sample.
    """
    import inspect

    from balanced_loader.loader import BalancedLoader

    known = [k for k in inspect.signature(BalancedLoader.__init__).parameters if k not in ("self", "source")]
    unknown = sorted(set(loader_kwargs) - set(known))
    if unknown:
        raise ValueError(f"wrap: unknown keyword(s) {unknown}; it takes lengths, length_fn, tokens_fn and the "
                         f"BalancedLoader's {known}")
    if "global_batch_tokens" not in loader_kwargs:
        raise ValueError("wrap: global_batch_tokens is required (tokens per optimizer step)")
    if isinstance(data, Source):
        return BalancedLoader(data, **loader_kwargs)
    # every argument checked on a one-token stand-in source first: a bad value fails before the length pass
    BalancedLoader([1], **loader_kwargs).close()
    kind = hf_kind(data)
    if kind is not None and (kind != "dataset" or (lengths is None and length_fn is None and tokens_fn is None)):
        # a datasets.Dataset is read from its Arrow column (open_source(ds)); a DatasetDict or stream is an error
        return BalancedLoader(HFDatasetSource(data), **loader_kwargs)
    if isinstance(data, Mapping):
        cols = data.get("input_ids")
        if cols is None or isinstance(cols, (str, bytes)) or not hasattr(cols, "__getitem__"):
            raise ValueError(f"wrap got a dict with keys {sorted(map(str, data))} and no 'input_ids' column; pass "
                             f"a dataset of samples (a list, a torch Dataset, a datasets.Dataset)")
        data = cols
    if hasattr(data, "dataset") and hasattr(data, "batch_sampler"):  # a torch DataLoader
        data = data.dataset
    torch_data = sys.modules.get("torch.utils.data")  # not imported: data cannot be a torch dataset
    if torch_data is not None and isinstance(data, torch_data.IterableDataset):
        raise ValueError("wrap needs a map-style dataset; an IterableDataset has no random access "
                         "(write it to shards with balanced-loader build-shards and open the folder)")
    source = DatasetSource(data, lengths=lengths, length_fn=length_fn, tokens_fn=tokens_fn, vocab_size=vocab_size)
    return BalancedLoader(source, **loader_kwargs)
