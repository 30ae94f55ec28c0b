"""A step's peak memory, measured without resetting any counter of the process's kernel accounting.

The runtime used to reset the kernel's resident-set high-water mark (``VmHWM``, by writing 5 to
``/proc/self/clear_refs``) at every step; that is also the counter ``getrusage``'s ``ru_maxrss``,
GNU ``time`` and a scheduler's accounting (SLURM's MaxRSS) read, so a user's own monitoring then
under-reported the run's peak. :class:`PeakProbe` leaves it alone:

* **CUDA**: torch's caching allocator's peak (``max_memory_allocated``, whose reset touches only
  torch's own statistics).
* **CPU**: a background thread samples the resident set (``/proc/self/statm``, one ``pread``)
  every ``interval_s`` while a step runs, and the kernel's high-water mark is read (never written)
  at the step's start and end. If the step raised the high-water mark, the step's peak *is* the new
  mark (exact, ``exact`` true); otherwise it is the largest sample (a peak shorter than the interval
  can be missed; activations live for tens of milliseconds at least). Off Linux: 0.
"""

from __future__ import annotations

import os
import threading

import torch

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

    def __init__(self, device: torch.device, *, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.device = device
        self.interval_s = interval_s
        self.base = 0  # bytes in use when the step began
        self.exact = device.type == "cuda"  # the last peak is the counter's own (not a sample)
        self._rss = None if device.type == "cuda" else _RssReader()
        self._hwm0 = 0
        self._top = 0  # largest sample since reset
        self._active = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        self.base = self._top = self._rss()
        self._hwm0 = _hwm_bytes()
        if self._thread is None:
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

    def _sample(self) -> None:
        while not self._closed.is_set():
            if not self._active.wait(0.5):
                continue
            try:
                self._top = max(self._top, self._rss())
            except (OSError, ValueError, IndexError):
                return
            self._closed.wait(self.interval_s)

    def close(self) -> None:
        """Stop the sampler (idempotent)."""
        self._closed.set()
        self._active.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._rss is not None:
            self._rss.close()
