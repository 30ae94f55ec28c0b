"""Live device bytes by kind while a rank's real step runs on fake tensors (``python -m parallel_runtime estimate``).

:class:`MemoryTracker` is a dispatch mode entered inside ``FakeTensorMode``: every tensor an op returns
is looked at once per storage, its bytes are counted as live until the storage is freed (a weak
finalizer on the storage: fake tensors have real storage objects, without data), and each storage has
a *kind*: the innermost :meth:`MemoryTracker.kind` context when it was made (``parameters``,
``gradients``, ``optimizer``, ``buckets``, ``attention`` workspace, else ``temporaries``), changed to
``activations`` when autograd saves a tensor on it for the backward (:meth:`saved_hooks`). The peak of
the total is kept with its parts by kind (what a device with the caching allocator's slack removed
would have allocated at its worst moment), and every kind's own peak.

It also counts the step's reads of device values on the host (``.item()``, ``float(t)``, ``.tolist()``,
whose element reads count once: on a GPU each waits for the device), answering them with zeros, which
the runtime only uses for figures it reports (a loss, a norm), never for control flow.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

KINDS = ("parameters", "gradients", "optimizer", "buckets", "activations", "attention", "temporaries")
_SCALAR = torch.ops.aten._local_scalar_dense.default


class MemoryTracker(TorchDispatchMode):
    """Live bytes per storage, by kind, with the peak and its parts (enter inside ``FakeTensorMode``)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list] = {}  # id(storage) -> [bytes, kind]
        self._refs: dict[int, weakref.ref] = {}  # id(storage) -> its storage (the kind of a saved tensor moves)
        self._kinds: list[str] = ["temporaries"]
        self.now: Counter[str] = Counter()  # live bytes by kind
        self.total = 0
        self.peak = 0
        self.peak_parts: dict[str, int] = {}  # bytes by kind at the peak of the total
        self.kind_peaks: Counter[str] = Counter()  # each kind's own peak
        self.host_reads = 0  # reads of device values on the host (a run of element reads, as .tolist(), is one)
        self._reading = False  # the last op was such a read

    # ---- kinds --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def kind(self, name: str) -> Iterator[None]:
        """Storages made inside belong to ``name`` (one of :data:`KINDS`)."""
        assert name in KINDS, name
        self._kinds.append(name)
        try:
            yield
        finally:
            self._kinds.pop()

    def retag(self, t: torch.Tensor, kind: str) -> None:
        """The storage of ``t`` belongs to ``kind`` from now on (e.g. saved for backward)."""
        entry = self._live.get(id(t.untyped_storage()))
        if entry is None or entry[1] == kind or entry[1] in ("parameters", "gradients", "optimizer", "buckets"):
            return
        self._move(entry, kind)

    def saved_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks that mark what autograd keeps for the backward as ``activations``."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.retag(t, "activations")
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    # ---- accounting -----------------------------------------------------------------------------
    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        s = t.untyped_storage()
        key = id(s)
        if key in self._live:
            return
        n = s.nbytes()
        entry = [n, self._kinds[-1]]
        self._live[key] = entry
        self.now[entry[1]] += n
        self.total += n
        weakref.finalize(s, self._free, key)
        self._note()

    def _move(self, entry: list, kind: str) -> None:
        self.now[entry[1]] -= entry[0]
        entry[1] = kind
        self.now[kind] += entry[0]
        self._note()

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.now[entry[1]] -= entry[0]
            self.total -= entry[0]

    def _note(self) -> None:
        for k, v in self.now.items():
            if v > self.kind_peaks[k]:
                self.kind_peaks[k] = v
        if self.total > self.peak:
            self.peak = self.total
            self.peak_parts = {k: v for k, v in self.now.items() if v}

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.total
        self.peak_parts = {k: v for k, v in self.now.items() if v}
        self.kind_peaks = Counter({k: v for k, v in self.now.items() if v})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _SCALAR:  # a device value read on the host
            self.host_reads += not self._reading
            self._reading = True
            return False if args[0].dtype == torch.bool else 0
        self._reading = False
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out
