"""A step's peak memory, measured without resetting any counter of the process's kernel accounting.

The runtime used to reset the kernel's resident-set high-water mark (``VmHWM``, by writing 5 to
``/proc/self/clear_refs``) at every step; that is also the counter ``getrusage``'s ``ru_maxrss``,
GNU ``time`` and a scheduler's accounting (SLURM's MaxRSS) read, so a user's own monitoring then
under-reported the run's peak. :class:`PeakProbe` leaves it alone:

* **CUDA**: torch's caching allocator's peak (``max_memory_allocated``, whose reset touches only
  torch's own statistics).
* **CPU**: the resident set (``/proc/self/statm``, one ``pread`` of a few microseconds) is sampled
  while a step runs, and the kernel's high-water mark is read (never written) at the step's start
  and end. If the step raised the high-water mark, the step's peak *is* the new mark (exact,
  ``exact`` true); otherwise it is the largest sample. Off Linux: 0. Samples come either from the
  step itself (``interval_s=None``, the trainer's choice: :meth:`PeakProbe.watch` hooks every module
  that holds parameters before its forward, every parameter after its gradient accumulates, and the
  trainer calls :meth:`PeakProbe.sample` between phases) or from a background thread every
  ``interval_s``. Why the hooks: a thread that wakes 50 times a second takes a busy rank's core (on
  a machine whose cores the ranks fill, each wake-up preempts a compute thread); a hook costs one
  ``pread`` on the thread that computes anyway. What either can miss: memory that is mapped and
  unmapped between two samples (an allocation above glibc's mmap threshold inside one module).

On CPU the sampling can also keep the C heap lean (``trim_bytes``, recipe key
``world.heap_trim_mb``): when the resident set, less what the heap has in use (``mallinfo2``), has
grown by ``trim_bytes`` since the step began or since the last trim, it hands glibc's free heap pages
back (``malloc_trim``). Why: measured in a 27M-parameter step, the bytes in use grow by ~40 MB while
the resident set grows by ~190 MB, since glibc serves each activation from whichever free chunk fits
and so touches, one after the other, the free holes between live tensors, whose pages then stay
resident. Only that growth counts: live activations growing (no recompute) trigger nothing, since a
trim costs every page it returns a fresh fault when it is reused (a trigger on the resident set alone
cost 13% of the step time against 3% for this one; figures in docs/results/runtime_speed.md). And
only near the process's highest mark (the largest sample of any step; ``margin_bytes`` below it at
most): a trim lowers the run's peak only where a new one would be set, while a trim below the mark
costs the faults without it (the trainer's trims between phases follow the same rule). The trainer's
margin is ``trim_bytes`` with ``train.recompute`` (small activations, recomputed and freed block by
block: the free holes are much of the resident set, trims within the margin took 38 MB off the
4-rank peak) and 0 without (live activations dominate; 2 ranks of the 27M model: 1.2M minor faults in
5 steps, as the plain loop, against 3.0M with the margin and 3.6M with trims at every phase boundary).
"""

from __future__ import annotations

import os
import threading

import torch

from parallel_runtime.training.heap import heap_in_use, release_free_memory

SAMPLE_INTERVAL_S = 0.02  # 50 wake-ups a second (was 200: each one may take a busy rank's core)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _hwm_bytes() -> int:
    """The kernel's resident-set high-water mark of this process (``VmHWM``), 0 off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """This process's resident set now, in bytes (``/proc/self/statm``; 0 off Linux)."""
    r = _RssReader()
    try:
        return r()
    finally:
        r.close()


class _RssReader:
    """The current resident set in bytes from ``/proc/self/statm`` (kept open; 0 off Linux)."""

    def __init__(self) -> None:
        try:
            self.fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self.fd = None

    def __call__(self) -> int:
        if self.fd is None:
            return 0
        return int(os.pread(self.fd, 128, 0).split()[1]) * _PAGE  # fields: size resident shared ...

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class PeakProbe:
    """This process's peak memory in a step: :meth:`reset` at the step's start, :meth:`peak` at its end."""

    def __init__(self, device: torch.device, *, interval_s: float | None = SAMPLE_INTERVAL_S,
                 trim_bytes: int = 0, margin_bytes: int = 0) -> None:
        """``interval_s``: seconds between a background thread's samples; ``None``: no thread, samples come
        from :meth:`watch`'s hooks and :meth:`sample` calls. ``margin_bytes``: how far below the process's
        highest mark a trim may already run (0: only a resident set above the mark trims)."""
        if trim_bytes < 0 or margin_bytes < 0:
            raise ValueError(f"trim_bytes and margin_bytes must be >= 0 (0: never trim), "
                             f"got {trim_bytes}, {margin_bytes}")
        self.device = device
        self.interval_s = interval_s
        # trims need the heap's own figures (glibc >= 2.33): without them the resident set cannot tell
        # free pages from live ones
        self.trim_bytes = trim_bytes if device.type == "cpu" and heap_in_use() is not None else 0
        self.margin_bytes = margin_bytes
        self.trims = 0  # heap trims since the last reset
        self.base = 0  # bytes in use when the step began
        self.exact = device.type == "cuda"  # the last peak is the counter's own (not a sample)
        self._rss = None if device.type == "cuda" else _RssReader()
        self._hwm0 = 0
        self._top = 0  # largest sample since reset
        self._floor = 0  # the resident set when last checked against the heap (reset, trim, or growth)
        self._floor_unused: int | None = None  # resident bytes the heap did not have in use after the last trim
        self._high = 0  # the largest resident set sampled in this probe's life (every step, trims included)
        self._active = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched: dict[int, list] = {}  # id(model) -> its hook handles

    def watch(self, model: torch.nn.Module) -> None:
        """Sample before the forward of every module of ``model`` that holds parameters (recomputed blocks
        included) and after each parameter's gradient accumulates (idempotent; CPU only)."""
        if self._rss is None or id(model) in self._watched:
            return
        handles = []
        for m in model.modules():
            if next(m.parameters(recurse=False), None) is not None:
                handles.append(m.register_forward_pre_hook(lambda *_: self.sample()))
        for p in model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda _: self.sample()))
        self._watched[id(model)] = handles

    def sample(self) -> None:
        """One sample of the resident set while a step runs (and a heap trim when it is due)."""
        if self._rss is None or not self._active.is_set():
            return
        rss = self._rss()
        self._top = max(self._top, rss)
        if self.trim_bytes and rss > self._floor + self.trim_bytes:
            self._check_heap(rss)
        self._high = max(self._high, rss)

    def between_phases(self) -> None:
        """The trainer's call between a step's phases: a sample, and a heap trim if one is due (with
        ``trim_bytes`` 0, an unconditional trim: the free pages a phase left go back before the next)."""
        if self._rss is None:
            return
        rss = self._rss()
        if self._active.is_set():  # what the phase left resident counts before it goes back
            self._top = max(self._top, rss)
        if self.trim_bytes:
            self._check_heap(rss)  # whatever the growth since the last check
        else:
            release_free_memory()
        self._high = max(self._high, rss)

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        self.base = self._top = self._rss()
        self._floor = self.base
        if self.trim_bytes and self._floor_unused is None:
            self._floor_unused = self._unused(self.base)
        self.trims = 0
        self._hwm0 = _hwm_bytes()
        if self._thread is None and self.interval_s is not None:
            self._thread = threading.Thread(target=self._sample, name="peak-probe", daemon=True)
            self._thread.start()
        self._active.set()

    def peak(self) -> int:
        """Peak bytes since :meth:`reset` (sampling pauses until the next reset)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        self._active.clear()
        self._top = max(self._top, self._rss())
        hwm = _hwm_bytes()
        self.exact = hwm > self._hwm0  # the step set a new high for the process: the kernel's mark is its peak
        return hwm if self.exact else self._top

    def _unused(self, rss: int) -> int:
        """Resident bytes the heap does not have in use (only called with trims on: ``mallinfo2`` exists)."""
        return rss - heap_in_use()

    def _check_heap(self, rss: int) -> None:
        """Trim if the resident set is within ``margin_bytes`` of this process's highest mark and its free heap
        pages grew by ``trim_bytes`` since the last trim, else (live tensors, or room below the mark) wait
        for the next ``trim_bytes`` of growth. Why the mark: a trim lowers a peak only where the resident
        set would set a new one; below the mark, the pages it returns fault back in (a fresh zeroed page
        each) as the next microbatch reuses them, for no lower peak. ``mallinfo2`` walks every free chunk
        (ms on a fragmented heap), so it runs once per ``trim_bytes`` of growth, not per sample."""
        self._floor = rss
        if rss + self.margin_bytes < self._high:
            return
        unused = self._unused(rss)
        if self._floor_unused is None:  # a check before the first reset (the step-start trim)
            self._floor_unused = unused
        if unused > self._floor_unused + self.trim_bytes:
            release_free_memory()
            self.trims += 1
            self._floor = self._rss()
            self._floor_unused = self._unused(self._floor)

    def _sample(self) -> None:
        while not self._closed.is_set():
            if not self._active.wait(0.5):
                continue
            try:
                self.sample()
            except (OSError, ValueError, IndexError):
                return
            self._closed.wait(self.interval_s)

    def close(self) -> None:
        """Stop the sampler and remove the hooks (idempotent)."""
        for handles in self._watched.values():
            for h in handles:
                h.remove()
        self._watched.clear()
        self._closed.set()
        self._active.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._rss is not None:
            self._rss.close()
