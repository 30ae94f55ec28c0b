"""Numba kernels of the planning core: small functions, arrays in and arrays out.

Each kernel has a pure-Python reference with the same tie-breaking (in :mod:`balanced_loader.planning.packing`;
the repair, evaluate, polish and target-groups kernels keep theirs beside them); the tests compare them.
Callers should use the wrappers in ``packing.py`` where there is one,
which check their input; the kernels trust theirs (int64 / float64, 1-D, C order).

Modules, by family:

* :mod:`.order`: :func:`order_desc` (stable longest-first order; counting sort when the
  lengths are small integers, else a merge sort), :func:`order_by_pair` (stable order by two
  small integer keys, e.g. (microbatch, lane)), :func:`argsort_stable` and :func:`argsort_nonneg` (its order
  for non-negative float keys, a radix sort for large n).
* :mod:`.fit`: :func:`ffd_kernel` (first-fit-decreasing over a max segment tree of bin
  rooms) and :func:`bfd_kernel` (best-fit-decreasing over a tree of room values).
* :mod:`.repair`: :func:`repair_round` / :func:`repair_kernel`, a pass after FFD/BFD that pools
  the loosest bins and trades their items into the others, for inputs where FFD is above the
  lower bound (many items over half the capacity).
* :mod:`.place`: :func:`cost_pack_kernel`, :func:`block_place_kernel` (lazy versioned heaps),
  :func:`fill_passes_kernel`.
* :mod:`.karmarkar_karp`: :func:`kk_kernel`, k-way largest differencing, and :func:`grouped_kk_kernel`, verl's
  equal-size variant (its reference ``verl_kk_reference`` beside it; :func:`balanced_loader.balance` starts
  from it).
* :mod:`.heaps`: binary min-heaps in plain arrays, ordered by ``(key, index)`` (``push2`` / ``pop2`` /
  ``sift_down2``; ``heap_push`` / ``heap_pop`` with a version per entry, for lazy heaps).
* :mod:`.evaluate`: :func:`items_step_kernel`, the contract-2 step time of a per-item plan (hydra's portfolio
  compares candidates with it before building any contract-1 object).
* :mod:`.polish`: ``polish_tail_kernel``, a local search over the one-lane passes that end each lane, and
  ``polish_groups_kernel``, moves and swaps of docs between the groups of a whole plan; in
  :mod:`.place` also ``target_groups_kernel`` (groups of their own degree filled to a time target).
"""

from __future__ import annotations

from balanced_loader.planning.kernels.evaluate import items_step_kernel
from balanced_loader.planning.kernels.fit import bfd_kernel, ffd_kernel
from balanced_loader.planning.kernels.karmarkar_karp import grouped_kk_kernel, kk_kernel
from balanced_loader.planning.kernels.order import argsort_nonneg, argsort_stable, order_by_pair, order_desc
from balanced_loader.planning.kernels.place import block_place_kernel, cost_pack_kernel, fill_passes_kernel
from balanced_loader.planning.kernels.repair import repair_kernel, repair_round

__all__ = ["argsort_nonneg", "argsort_stable", "bfd_kernel", "block_place_kernel", "cost_pack_kernel", "ffd_kernel",
           "fill_passes_kernel", "grouped_kk_kernel", "items_step_kernel", "kk_kernel", "order_by_pair", "order_desc",
           "repair_kernel", "repair_round"]
