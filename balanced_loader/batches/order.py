"""The doc order of one epoch, a pure function of (seed, epoch), evaluated lazily by position.

:class:`FeistelPermutation` is a seeded bijection of ``[0, n)`` evaluated on any positions without
building it; :class:`EpochOrder` lays docs out as permuted blocks (shards, or runs of doc ids) shuffled
inside windows; :func:`epoch_order` is the whole-array form for small inputs and tests.
"""

from __future__ import annotations

import numpy as np

from balanced_loader.batches.kernels import feistel_walk


class FeistelPermutation:
    """A seeded bijection of ``[0, n)``, evaluated on any positions without building it.

    A balanced Feistel network over ``2h`` bits (``2**(2h) < 4n``) permutes ``[0, 2**(2h))``;
    cycle-walking (re-encrypting until the value is below ``n``) restricts it to ``[0, n)``
    (fewer than 4 rounds of walking in expectation). Evaluated by a numba kernel
    (:func:`~balanced_loader.batches.kernels.feistel_walk`) over arrays of positions.
    """

    ROUNDS = 6

    def __init__(self, n: int, key: list[int]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        self.half = (max(2, (self.n - 1).bit_length()) + 1) // 2
        self.keys = np.random.SeedSequence(key).generate_state(self.ROUNDS, dtype=np.uint64)  # [rounds]

    def __call__(self, pos: np.ndarray) -> np.ndarray:
        """``perm[pos]`` for an array of positions (``[k]`` int64)."""
        return self._walk(pos, False)

    def inverse(self, values: np.ndarray) -> np.ndarray:
        """The positions holding ``values`` (``[k]`` int64)."""
        return self._walk(values, True)

    def _walk(self, pos: np.ndarray, inverse: bool) -> np.ndarray:
        x = np.ascontiguousarray(pos, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"positions must lie in [0, {self.n})")
        return feistel_walk(x, self.keys, self.half, self.n, inverse)


_ORDER_TAG, _WINDOW_TAG = 0x5EED, 0x3A1D


class EpochOrder:
    """The doc order of one epoch, a pure function of (seed, epoch), evaluated lazily by position.

    Docs are laid out as contiguous blocks of doc_ids in a permuted block order, then shuffled
    inside consecutive windows of ``window`` positions. The blocks are the shards
    (``shard_bounds``, ``[num_shards + 1]`` doc offsets, permuted with a seeded generator) or,
    without shards, runs of ``max(1, window // 16)`` doc_ids permuted by a
    :class:`FeistelPermutation`, so a window mixes docs from 16 places of the file while every
    read stays a contiguous run (each touched run maps its page-cache folio, up to 2 MB, into
    resident memory: few runs per window keep that small). ``docs(a, b)`` costs ``O(window + b - a)`` time and
    memory, whatever the number of docs; ``shuffle=False`` is the file order.
    """

    def __init__(self, num_docs: int, *, seed: int, epoch: int, shuffle: bool = True,
                 shard_bounds: np.ndarray | None = None, window: int = 1 << 16) -> None:
        if window < 1:
            raise ValueError(f"shuffle window must be >= 1, got {window}")
        self.num_docs = int(num_docs)
        self.shuffle = bool(shuffle) and self.num_docs > 1
        self.window = int(window)
        self._key = [int(seed), int(epoch)]
        self._cache: tuple[int, np.ndarray] | None = None  # (window index, its doc_ids)
        if not self.shuffle:
            return
        if shard_bounds is not None:
            bounds = np.asarray(shard_bounds, dtype=np.int64)  # [num_shards + 1]
            if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != self.num_docs or (np.diff(bounds) < 0).any():
                raise ValueError(f"shard_bounds must rise from 0 to num_docs {self.num_docs}")
            perm = np.random.default_rng([*self._key, _ORDER_TAG]).permutation(len(bounds) - 1)  # [num_shards]
            self._shard_lo = bounds[perm]  # [num_shards] first doc_id of the shard in each slot
            self._slot_start = np.concatenate([[0], np.cumsum(np.diff(bounds)[perm])])  # [num_shards + 1]
            self._blocks: FeistelPermutation | None = None
            return
        self.block = max(1, self.window // 16)
        nb = -(-self.num_docs // self.block)
        self._blocks = FeistelPermutation(nb, [*self._key, _ORDER_TAG])
        # only the last block is short (r docs); its slot S shifts the slots after it by block - r
        self._short_len = self.num_docs - (nb - 1) * self.block
        self._short_slot = int(self._blocks.inverse(np.asarray([nb - 1]))[0])

    def _unshuffled(self, a: int, b: int) -> np.ndarray:
        """doc_ids at positions ``[a, b)`` of the block order, before the window shuffle (``[b - a]``)."""
        p = np.arange(a, b, dtype=np.int64)
        if self._blocks is None:  # shards: slot starts are explicit
            slot = np.searchsorted(self._slot_start, p, side="right") - 1
            return self._shard_lo[slot] + (p - self._slot_start[slot])
        bs, s = self.block, self._short_slot
        tail = s * bs + self._short_len  # end of the short block's slot
        slot = np.where(p < tail, p // bs, s + 1 + (p - tail) // bs)  # [b - a] nondecreasing
        offset = p - np.where(slot <= s, slot * bs, tail + (slot - s - 1) * bs)
        first = int(slot[0]) if len(slot) else 0
        blocks = self._blocks(np.arange(first, int(slot[-1]) + 1 if len(slot) else first))  # one call per block
        return blocks[slot - first] * bs + offset

    def _window(self, w: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != w:
            a, b = w * self.window, min(self.num_docs, (w + 1) * self.window)
            rng = np.random.default_rng([*self._key, w, _WINDOW_TAG])
            self._cache = (w, self._unshuffled(a, b)[rng.permutation(b - a)])
        return self._cache[1]

    def docs(self, a: int, b: int) -> np.ndarray:
        """doc_ids at epoch positions ``[a, b)`` (``[b - a]`` int64)."""
        a, b = max(0, int(a)), min(self.num_docs, int(b))
        if b <= a:
            return np.zeros(0, dtype=np.int64)
        if not self.shuffle:
            return np.arange(a, b, dtype=np.int64)
        parts = []
        for w in range(a // self.window, (b - 1) // self.window + 1):
            lo = w * self.window
            parts.append(self._window(w)[max(a, lo) - lo:min(b, lo + self.window) - lo])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def epoch_order(num_docs: int, *, seed: int, epoch: int, shuffle: bool = True,
                shard_bounds: np.ndarray | None = None, window: int = 1 << 16) -> np.ndarray:
    """The whole order of an :class:`EpochOrder` as one ``[num_docs]`` array (small inputs, tests, tools)."""
    return EpochOrder(num_docs, seed=seed, epoch=epoch, shuffle=shuffle, shard_bounds=shard_bounds,
                      window=window).docs(0, num_docs)
