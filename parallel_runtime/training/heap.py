"""The C heap of a CPU process: glibc's mmap threshold and ``malloc_trim`` (no-ops off glibc).

Not set here, measured (docs/results/runtime_speed.md): torch's transparent huge pages for large CPU
tensors (``THP_MEM_ALLOC_ENABLE=1``, an environment variable torch reads at its first allocation)
made one process 0.93x the step time, but two ranks on one machine no faster and 100 MB larger; a
user who wants them sets the variable before starting the run.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere). glibc
    raises its mmap threshold after large frees, so later tensors of a few MB come from the heap,
    whose freed pages stay resident: without this the resident set keeps every step's transients."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    # glibc >= 2.33 (malloc.h): the heap's figures as size_t (mallinfo's ints wrap above 2 GiB)
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out and not had back (every arena's chunks in use plus its own
    mappings: ``mallinfo2`` ``uordblks + hblkhd``); ``None`` off glibc or before 2.33."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return int(m.uordblks + m.hblkhd)


def set_heap_mmap_threshold(nbytes: int) -> bool:
    """Give every C allocation of at least ``nbytes`` its own mapping, returned to the OS when freed
    (glibc ``mallopt(M_MMAP_THRESHOLD)``; ``0`` or a non-glibc C library: no change). Returns whether
    it was set. Why: glibc's default threshold rises to the size of the largest freed block (up to
    32 MiB), after which a step's activations and gradient temporaries of a few MB come from the heap
    and their pages stay resident when freed, fragmented between live tensors (docs/results/runtime.md)."""
    if nbytes <= 0 or _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, int(nbytes)))


def _libc():
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.malloc_trim  # noqa: B018 - glibc only
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallInfo2
