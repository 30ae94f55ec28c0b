"""Balanced RL rollouts: per-rank microbatches of an in-memory batch, the drop-in for verl's two functions.

RL frameworks hold each step's rollouts in memory and split them over the data-parallel ranks
(verl: ``get_seqlen_balanced_partitions``, Karmarkar-Karp on ``24576 s + s^2``, equal rollout
counts per rank) and then into microbatches under a token cap (verl: ``rearrange_micro_batches``,
the count all-reduced to the largest). :func:`balance` does both in one pure function of the
lengths, so every rank computes the same answer without a collective:

1. **Ranks**: by the cost model's work ``q s^2 + l s`` (default: verl's ``24576 s + s^2``), two
   starts, verl's own equal-size Karmarkar-Karp partition (reproduced exactly, in numba:
   :func:`~balanced_loader.planning.kernels.karmarkar_karp.grouped_kk_kernel`) and a longest-processing-time
   placement (:func:`~balanced_loader.planning.packing.lpt`) improved by moves and swaps that
   lower the heaviest rank (:func:`~balanced_loader.planning.rl.kernels.exchange_kernel`); when
   that is heavier than verl's partition, verl's partition improved by the same exchanges wins, so
   the heaviest rank is never above verl's. Ranks may end with different
   rollout counts: only their work is balanced.
2. **Microbatches**: each rank's rollouts packed under ``max_tokens_per_microbatch``
   (first-fit-decreasing with repair, :func:`~balanced_loader.planning.packing.pack`) to find the
   count it needs; with ``equal_counts`` every rank then uses the largest count, filled
   longest-first into the microbatch of least work with room
   (:func:`~balanced_loader.planning.packing.cost_pack`), so the cap always holds.

:func:`balance_batch` applies it to a padded or nested batch of tensors and packs each
microbatch padding-free (``input_ids``, ``position_ids``, ``cu_seqlens`` and every per-token
field sliced alike), with the inverse permutation that restores the batch order.

**Inputs** (each mistake one ``ValueError`` line): ``world_size`` in 1..2**20 (as the loader's);
lengths and the cap in 1..2**40 tokens, integers (a float must hold an integer: ``inf`` and ``3.5``
are refused, and so are 16-bit floats, exact only up to 256 / 2048); no meta tensors (they hold no
values); ``pad_id`` a token id (0..2**32 - 1). In :func:`balance_batch` per-rollout fields may be
torch tensors of any dtype, numpy arrays (verl keeps its ``uid`` strings so) or lists, and the
batch a padded tensor or a nested one, strided or jagged. Planning time is near-linear in the
rollouts and the ranks (``docs/results/reliability3.md``: 10^7 rollouts on 64 ranks, 10^5 ranks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from balanced_loader.cost import CostModel
from balanced_loader.loader_args import MAX_RANKS, MAX_TOKEN_ID, MAX_TOKENS
from balanced_loader.planning.rl.kernels import balance_kernel
from balanced_loader.presets import resolve_cost

# verl's calculate_workload (a 7B model: 12 h^2 s + 2 h s^2 with h = 4096, divided by 2 h): 24576 s + s^2
DEFAULT_LINEAR = 24576.0
DEFAULT_QUADRATIC = 1.0
EXCHANGE_ROUNDS_PER_RANK = 1  # exchange rounds at most, per rank (each one strictly lowers the sorted loads)

__all__ = ["BalancedBatch", "balance", "balance_batch", "rollout_work"]


def _check_int(name: str, value: Any, minimum: int = 1, maximum: int = MAX_TOKENS) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum:,}, got {int(value):,}")
    return int(value)


def _host(t: Any, what: str) -> Any:
    """A torch tensor's values on the host (a meta tensor has none: refused)."""
    if getattr(getattr(t, "device", None), "type", None) == "meta":
        raise ValueError(f"{what} is a meta tensor: it has a shape but no values; pass a tensor with data")
    return t.detach().cpu()


def _as_rollout_lengths(lengths: Any) -> np.ndarray:
    if hasattr(lengths, "detach"):  # a torch tensor (one copy of n integers to the host)
        if str(lengths.dtype) in ("torch.bfloat16", "torch.float16"):
            raise ValueError(f"lengths are {str(lengths.dtype)[6:]}, which holds integers exactly only up to "
                             f"{256 if 'bfloat' in str(lengths.dtype) else 2048}; pass an integer tensor (e.g. "
                             f"attention_mask.sum(-1) of an integer or bool mask)")
        lengths = _host(lengths, "lengths").numpy()
    try:
        arr = np.asarray(lengths)
    except (ValueError, TypeError):
        raise ValueError("lengths must be a 1-D sequence of rollout token counts (integers)") from None
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D sequence of rollout token counts, got shape {arr.shape}; "
                         f"for a padded batch pass attention_mask.sum(-1) or use balance_batch")
    if arr.size == 0:
        raise ValueError("lengths is empty: there are no rollouts to balance")
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr)) if arr.dtype.itemsize > 2 else np.ones(arr.shape, bool)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"lengths must be integers: rollout {i} has {float(arr[i])!r} tokens")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    with np.errstate(invalid="ignore"):
        over = arr > MAX_TOKENS  # before the cast: a uint64 or a float above int64 would wrap
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise ValueError(f"rollout {i} has {arr[i]:,.0f} tokens, more than {MAX_TOKENS:,} (2**40)")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.min() < 1:
        i = int(np.argmin(arr))
        raise ValueError(f"rollout {i} has {int(arr[i])} tokens; every rollout needs at least 1 token")
    return arr


def rollout_work(lengths: np.ndarray, cost: CostModel | None = None) -> np.ndarray:
    """Work of each rollout, ``q s^2 + l s`` (``[n]`` float64): the cost model's tp=pp=1 shape, or verl's
    ``24576 s + s^2`` when ``cost`` is None."""
    s = np.asarray(lengths, dtype=np.float64)
    if cost is None:
        return DEFAULT_QUADRATIC * s * s + DEFAULT_LINEAR * s
    return np.asarray(cost.base.compute_ms(s), dtype=np.float64)


def _resolve_cost(cost: Any, world_size: int) -> CostModel | None:
    if cost is None or isinstance(cost, CostModel):
        return cost
    return resolve_cost(cost, world_size)  # a preset name or a cost file


def balance(lengths: Any, *, world_size: int, max_tokens_per_microbatch: int, cost: Any = None,
            equal_counts: bool = True) -> list[list[list[int]]]:
    """Each rank's microbatches as lists of indices into ``lengths``: ``out[rank][k] = [i, ...]``.

    Every index appears exactly once; no microbatch holds more than ``max_tokens_per_microbatch``
    tokens; with ``equal_counts`` every rank has the same number of microbatches (a rank with
    fewer rollouts than that count gets empty ones: ``[]``). Ranks are balanced by the work
    ``q s^2 + l s`` of ``cost`` (a :class:`~balanced_loader.CostModel`, preset name or cost file;
    ``None``: verl's ``24576 s + s^2``). Indices inside a microbatch are ascending. A pure function
    of its arguments: every rank computes the same answer.
    """
    world = _check_int("world_size", world_size, maximum=MAX_RANKS)
    cap = _check_int("max_tokens_per_microbatch", max_tokens_per_microbatch)
    lens = _as_rollout_lengths(lengths)
    if int(lens.max()) > cap:
        i = int(np.argmax(lens))
        raise ValueError(f"rollout {i} has {int(lens[i])} tokens, more than max_tokens_per_microbatch={cap}; "
                         f"raise the cap or truncate the rollout")
    work = rollout_work(lens, _resolve_cost(cost, world))  # [n]
    # one kernel call (see balance_kernel): the microbatches as index runs, rank-major
    _, _, counts, items, bounds = balance_kernel(lens, work, world, cap, bool(equal_counts),
                                                 EXCHANGE_ROUNDS_PER_RANK * world)
    idx, cut = items.tolist(), bounds.tolist()
    flat = [idx[a:b] for a, b in zip(cut[:-1], cut[1:])]  # [slots] index lists
    out, s = [], 0
    for c in counts.tolist():
        out.append(flat[s:s + c])
        s += c
    return out


# ------------------------------------------------------------------------------------------
# tensors
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BalancedBatch:
    """:func:`balance_batch`'s answer."""

    microbatches: list[list[dict[str, Any]]]  # [world][count] packed microbatch dicts of each rank
    indices: list[list[list[int]]]  # [world][count][k] rollout indices of each microbatch (balance's answer)
    inverse: Any  # [B] int64 tensor: rows in (rank, microbatch) order, indexed by it, come back in batch order

    def restore(self, per_rollout: Any) -> Any:
        """Rows in (rank, microbatch, index) order (``[B, ...]``: a tensor, a numpy array or a list) back in
        the batch order."""
        if hasattr(per_rollout, "index_select"):
            return per_rollout[self.inverse.to(per_rollout.device)]
        if isinstance(per_rollout, np.ndarray):
            return per_rollout[self.inverse.numpy()]
        return [per_rollout[i] for i in self.inverse.tolist()]


def _is_nested(t: Any) -> bool:
    return bool(getattr(t, "is_nested", False))


def _valid_mask(tensors: Mapping[str, Any], key: str, mask_key: str) -> tuple[Any, Any]:
    """(``[B, S]`` bool mask of real tokens or None for a nested batch, ``[B]`` lengths)."""
    import torch

    ids = tensors[key]
    if _is_nested(ids):  # jagged: the offsets; strided (torch's default nested layout): each row's length
        if ids.layout == torch.jagged:
            return None, ids.offsets().diff()
        return None, torch.tensor([len(r) for r in ids.unbind()], dtype=torch.long)
    if ids.dim() != 2:
        raise ValueError(f"tensors[{key!r}] must be [batch, seq] (padded) or a nested tensor, "
                         f"got shape {tuple(ids.shape)}")
    if mask_key in tensors:
        mask = tensors[mask_key]
        if tuple(getattr(mask, "shape", ())) != tuple(ids.shape) or not hasattr(mask, "bool"):
            raise ValueError(f"tensors[{mask_key!r}] has shape {tuple(getattr(mask, 'shape', ()))} but {key!r} has "
                             f"{tuple(ids.shape)}; they must match")
        mask = mask.bool()
    else:
        mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    return mask, mask.sum(-1)


def _take(t: Any, idx: list[int], sel: Any) -> Any:
    """Rows ``idx`` of a per-rollout field: a tensor (any dtype), a numpy array or a list."""
    if hasattr(t, "index_select"):
        return t.index_select(0, sel.to(t.device)) if not _is_nested(t) else [t.unbind()[i] for i in idx]
    if isinstance(t, np.ndarray):
        return t[np.asarray(idx, dtype=np.int64)]
    return [t[i] for i in idx]


def _pack_one(tensors: Mapping[str, Any], idx: list[int], key: str, mask_key: str, mask: Any, nested: bool,
              batch: int, seq: int, pad_id: int) -> dict[str, Any]:
    import torch

    ids = tensors[key]
    dev = ids.device
    out: dict[str, Any] = {}
    if not idx:  # an empty microbatch (a rank with fewer rollouts than the count): one pad token, no rollout
        out["input_ids"] = torch.full((1, 1), pad_id, dtype=torch.long, device=dev)
        out["position_ids"] = torch.zeros((1, 1), dtype=torch.long, device=dev)
        out["cu_seqlens"] = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        out["max_seqlen"] = 1
        out["indices"] = torch.zeros(0, dtype=torch.long, device=dev)
        out["padding"] = True
        for name, t in tensors.items():
            if name in (key, mask_key):
                continue
            if _per_token(t, nested, batch, seq):
                out[name] = torch.zeros((1, 1), dtype=t.dtype, device=dev) if hasattr(t, "dtype") and \
                    not isinstance(t, np.ndarray) else np.zeros((1, 1), dtype=t.dtype)
            else:
                out[name] = t[:0]
        return out
    sel = torch.tensor(idx, dtype=torch.long, device=dev)  # [k]
    if nested:
        parts = ids.unbind()
        lens = torch.tensor([len(parts[i]) for i in idx], dtype=torch.long, device=dev)
    else:
        m = mask.index_select(0, sel)  # [k, S]
        lens = m.sum(-1)
    cu = torch.zeros(len(idx) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    total = int(cu[-1])
    # positions restart at 0 in every rollout: 0..len-1 of its real tokens, whatever the padding side
    starts = torch.repeat_interleave(cu[:-1].long(), lens)
    pos = torch.arange(total, device=dev) - starts

    def packed(t: Any) -> Any:
        if nested:
            rows = t.unbind()
            return torch.cat([rows[i] for i in idx])[None]
        if isinstance(t, np.ndarray):  # row-major: rollouts back to back, in idx order
            return t[np.asarray(idx, dtype=np.int64)][m.cpu().numpy()][None]
        return t.index_select(0, sel)[m][None]

    out["input_ids"] = packed(ids)
    out["position_ids"] = pos[None]
    out["cu_seqlens"] = cu
    out["max_seqlen"] = int(lens.max())
    out["indices"] = sel
    out["padding"] = False
    for name, t in tensors.items():
        if name in (key, mask_key):
            continue
        out[name] = packed(t) if _per_token(t, nested, batch, seq) else _take(t, idx, sel)
    return out


def _per_token(t: Any, nested: bool, batch: int, seq: int) -> bool:
    """A per-token field: nested like ``input_ids``, or ``[B, S, ...]`` (a tensor or a numpy array) in a padded
    batch; anything else (a ``[B, ...]`` tensor or array, a list) is per rollout."""
    if nested:
        return _is_nested(t)
    shape = getattr(t, "shape", None)
    return shape is not None and len(shape) >= 2 and shape[0] == batch and shape[1] == seq


def _check_fields(tensors: Mapping[str, Any], key: str, batch: int) -> None:
    """Every field holds the ``batch`` rollouts on dim 0 (tensors of any dtype, numpy arrays, lists)."""
    for name, t in tensors.items():
        if getattr(getattr(t, "device", None), "type", None) == "meta":
            raise ValueError(f"tensors[{name!r}] is a meta tensor: it has a shape but no values; pass a tensor with "
                             f"data")
        if _is_nested(t):
            rows = t.size(0)
        elif isinstance(t, (list, tuple)):
            rows = len(t)
        elif hasattr(t, "shape") and len(t.shape) >= 1:
            rows = int(t.shape[0])
        else:
            raise ValueError(f"tensors[{name!r}] must be a tensor, a numpy array or a list with the {batch} rollouts "
                             f"on dim 0, got {type(t).__name__} of shape {tuple(getattr(t, 'shape', ()))}")
        if rows != batch:
            raise ValueError(f"tensors[{name!r}] must hold the {batch} rollouts on dim 0, got {rows} "
                             f"({type(t).__name__} of shape {tuple(getattr(t, 'shape', (rows,)))})")
    import torch

    ids = tensors[key]
    if not hasattr(ids, "index_select"):
        raise ValueError(f"tensors[{key!r}] must be a torch tensor of token ids (padded [batch, seq] or nested), "
                         f"got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"tensors[{key!r}] must hold integer token ids, got {str(ids.dtype)[6:]}")


def balance_batch(tensors: Mapping[str, Any], *, world_size: int, max_tokens_per_microbatch: int,
                  cost: Any = None, equal_counts: bool = True, key: str = "input_ids",
                  mask_key: str = "attention_mask", pad_id: int = 0) -> BalancedBatch:
    """:func:`balance` on a batch of tensors; each rank's microbatches packed padding-free.

    ``tensors`` maps names to fields with the rollouts on dim 0: ``tensors[key]`` is ``[B, S]``
    (padded; real tokens where ``tensors[mask_key]`` is nonzero, every position when it is absent,
    left or right padding alike) or a nested tensor (jagged or strided). Every field shaped ``[B, S, ...]``
    (or nested) is per token (advantages, log-probs, masks) and is packed like ``input_ids``; any other
    field is per rollout and gathered (``[k, ...]``): a tensor of any dtype, a numpy array (e.g. uid
    strings) or a list. Each microbatch dict holds ``input_ids`` and ``position_ids`` ``[1, T]``
    (positions restart at 0 per rollout), ``cu_seqlens`` ``[k + 1]`` int32, ``max_seqlen``, ``indices``
    ``[k]`` (its rollouts, ascending), ``padding`` and the fields. ``attention_mask`` is dropped (packed
    rows need none: pass ``position_ids`` or ``cu_seqlens`` to the attention instead).
    """
    if not isinstance(tensors, Mapping) or key not in tensors:
        raise ValueError(f"tensors must be a mapping with a {key!r} entry (the rollouts' token ids)")
    import torch

    if isinstance(pad_id, (bool, np.bool_)) or not isinstance(pad_id, (int, np.integer)) or \
            not 0 <= pad_id <= MAX_TOKEN_ID:
        raise ValueError(f"pad_id must be a token id in 0..{MAX_TOKEN_ID:,}, got {pad_id!r}")
    ids = tensors[key]
    batch = int(ids.size(0)) if hasattr(ids, "size") and callable(ids.size) else len(ids)
    _check_fields(tensors, key, batch)
    nested = _is_nested(ids)
    mask, lengths = _valid_mask(tensors, key, mask_key)
    seq = 0 if nested else int(ids.shape[1])
    plan = balance(lengths, world_size=world_size, max_tokens_per_microbatch=max_tokens_per_microbatch, cost=cost,
                   equal_counts=equal_counts)
    micro = [[_pack_one(tensors, idx, key, mask_key, mask, nested, batch, seq, int(pad_id)) for idx in rank]
             for rank in plan]
    flat = [i for rank in plan for idx in rank for i in idx]  # [B] the (rank, microbatch) order
    inverse = torch.empty(batch, dtype=torch.long)
    inverse[torch.tensor(flat, dtype=torch.long)] = torch.arange(batch)
    return BalancedBatch(microbatches=micro, indices=plan, inverse=inverse)
