"""Context-parallel attention on packed varlen batches: ring, Ulysses and nested (HyDra) engines.

Every engine reads a lane's tokens in THE layout of :mod:`balanced_loader.materialize`: each
segment (of true length ``L``) is padded to ``P`` = a multiple of ``2 * degree`` and cut into
``2 * outer`` zigzag chunks; outer rank ``j`` owns chunks ``j`` and ``2*outer-1-j``, each split
evenly among the ``inner`` ranks; lane ``j*inner + i`` holds its sub-chunk of chunk ``j``
then of chunk ``2*outer-1-j``, segment after segment (``cu_seqlens`` over ``P / degree``).
An engine is bound to one microbatch (its segment lengths) with :meth:`ContextParallel.bind`
and the result is the ``attn(q, k, v) -> o`` callable the model calls in every layer.

* **ring** (``inner = 1``, :mod:`parallel_runtime.engines.ring`): K and V travel around the
  group with asynchronous point-to-point ops (``batch_isend_irecv``) posted before the compute
  of each step, so the next block arrives while the current one is processed. Every block runs
  through a tiled kernel that returns the log-sum-exp (flash-attention varlen on CUDA), partial
  results merge by log-sum-exp, and no score tensor larger than one tile exists. The backward
  re-runs the blocks with the final log-sum-exp and sends dK/dV around the ring behind K/V, so
  they end on their owner (r-1 hops each: the backward sends exactly twice the forward's
  bytes). Zigzag lets half of every off-diagonal block be skipped (a source lane ``< j`` only
  shows its first halves; for a source lane ``> j`` only the local second halves see anything).
* **Ulysses** (``outer = 1``): one all-to-all turns sequence-sharded q/k/v into head-sharded
  full padded docs (the degree must divide the KV heads per TP rank), local varlen
  attention runs, and a second all-to-all returns the output. Padding sits at the end of
  every doc, so causal attention never lets a real token read it.
* **nested** (HyDra): the inner all-to-all gathers each owned zigzag chunk from the inner
  group, which is exactly the ring layout of degree ``outer`` for ``H / inner`` heads; the
  ring then runs over the outer group.

All three are one core (:class:`_Bound`) with ``inner`` or ``outer`` equal to 1. Bytes sent
are counted per kind in a :class:`CommStats` (instrumentation for the benchmarks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from balanced_loader.materialize import cp_positions, padded_length
from parallel_runtime.engines.attention import varlen_attention
from parallel_runtime.engines.device import to_device
from parallel_runtime.engines.ring import CommStats, RingPass, ring_attention
from parallel_runtime.engines.tensor import via_host

__all__ = ["ENGINES", "CommStats", "ContextParallel", "LocalAttention", "NestedAttention", "PackedLayout",
           "RingAttention", "UlyssesAttention", "make_engine", "shard_microbatch"]
ENGINES = ("ring", "ulysses", "nested")
Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---- the layout, per microbatch ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PackedLayout:
    """The segments of one group's microbatch and how they are spread over its lanes."""

    lengths: tuple[int, ...]  # [num_segments] true lengths
    degree: int
    inner: int = 1

    def __post_init__(self) -> None:
        if self.degree < 1 or self.inner < 1 or self.degree % self.inner:
            raise ValueError(f"CP degree {self.degree} must be a positive multiple of the inner size {self.inner}")
        if not self.lengths or any(int(n) < 1 for n in self.lengths):
            raise ValueError(f"segment lengths must be positive, got {list(self.lengths)[:8]}")

    @property
    def outer(self) -> int:
        return self.degree // self.inner

    @property
    def padded(self) -> np.ndarray:  # [num_segments]
        return np.array([padded_length(int(n), self.degree) for n in self.lengths], dtype=np.int64)

    @property
    def lane_tokens(self) -> int:
        """Tokens each lane holds (``sum(P) / degree``)."""
        return int(self.padded.sum()) // self.degree

    def lane_positions(self, lane: int) -> tuple[np.ndarray, np.ndarray]:
        """(position in segment or -1, segment index) of each token of ``lane``: ``[lane_tokens]`` each."""
        pos = [cp_positions(int(n), self.degree, self.inner)[lane] for n in self.lengths]
        seg = [np.full(len(p), s, dtype=np.int64) for s, p in enumerate(pos)]
        return np.concatenate(pos), np.concatenate(seg)

    def ring_positions(self, outer_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions and segment index after the inner gather: the zigzag of ``outer`` ranks on ``P``."""
        pos, seg = [], []
        for s, (n, p) in enumerate(zip(self.lengths, self.padded)):
            x = np.arange(p, dtype=np.int64) if self.outer == 1 else cp_positions(int(p), self.outer, 1)[outer_rank]
            x = np.where(x < n, x, -1)
            pos.append(x)
            seg.append(np.full(len(x), s, dtype=np.int64))
        return np.concatenate(pos), np.concatenate(seg)

    def gather_index(self) -> np.ndarray:
        """Index into the inner all-to-all's output ``[inner * lane_tokens]`` (source inner rank
        major) that puts it in ring-layout order; ``[inner * lane_tokens]``."""
        u, c, r = self.inner, self.degree, self.outer
        t_lane = self.lane_tokens
        out = np.empty(u * t_lane, dtype=np.int64)
        off_lane = off_ring = 0
        for p in self.padded:
            sub = int(p) // (2 * c)
            for h in range(2):
                for i in range(u):
                    dst = off_ring + h * (int(p) // (2 * r)) + i * sub
                    src = i * t_lane + off_lane + h * sub
                    out[dst:dst + sub] = np.arange(src, src + sub)
            off_lane += int(p) // c
            off_ring += int(p) // r
        return out


def shard_microbatch(segment_tokens: Sequence[np.ndarray], degree: int, lane: int, *, inner: int = 1,
                     pad_id: int = 0) -> dict[str, np.ndarray]:
    """One lane's microbatch of a group, materialized in the CP layout (what the loader builds).

    For each segment in order: the tokens at this lane's positions (``pad_id`` on padding),
    ``labels`` = next token inside the segment (-100 on padding and at the segment's last
    token), ``position_ids`` = position inside the (padded) segment; ``cu_seqlens`` over
    ``P / degree`` per segment.
    """
    ids, labels, position_ids, bounds = [], [], [], [0]
    for toks in segment_tokens:
        toks = np.asarray(toks, dtype=np.int64)
        n = len(toks)
        p = padded_length(n, degree)
        raw = cp_positions(p, degree, inner)[lane] if degree > 1 else np.arange(n)  # padded coordinates
        valid = raw < n
        nxt = np.concatenate([toks[1:], [-100]])
        ids.append(np.where(valid, toks[np.minimum(raw, n - 1)], pad_id))
        labels.append(np.where(valid, nxt[np.minimum(raw, n - 1)], -100))
        position_ids.append(raw)
        bounds.append(bounds[-1] + len(raw))
    return {"input_ids": np.concatenate(ids), "labels": np.concatenate(labels),
            "position_ids": np.concatenate(position_ids), "cu_seqlens": np.asarray(bounds, dtype=np.int32),
            "lengths": np.asarray([len(t) for t in segment_tokens], dtype=np.int64)}


# ---- communication ------------------------------------------------------------------------


@dataclass(frozen=True)
class _A2A:
    """All-to-all over dim 0 (``[u, ...]``, chunk ``g`` goes to the lane with index ``g``)."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]  # [u] global ranks in lane order
    stats: CommStats

    def run(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        u = len(self.ranks)
        order = sorted(range(u), key=lambda g: self.ranks[g])  # group rank p <-> lane index order[p]
        identity = order == list(range(u))
        send = x if identity else x[order]
        send = send.contiguous()
        staged = via_host(send, self.group)
        buf = send.cpu() if staged else send
        out = torch.empty_like(buf)
        self.stats.add(kind, buf.numel() * buf.element_size() * (u - 1) // u)
        dist.all_to_all_single(out, buf, group=self.group)
        if staged:
            out = out.to(x.device)
        if not identity:
            inv = [0] * u
            for p, g in enumerate(order):
                inv[g] = p
            out = out[inv]
        return out


class _AllToAllFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, a2a: _A2A) -> torch.Tensor:
        ctx.a2a = a2a
        return a2a.run(x, "a2a_fwd")

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.a2a.run(g, "a2a_bwd"), None


# ---- engines -------------------------------------------------------------------------------


class _Bound:
    """An engine bound to one microbatch: the ``attn(q, k, v)`` callable for every layer."""

    def __init__(self, engine: ContextParallel, lengths: Sequence[int]) -> None:
        self.engine = engine
        self.layout = PackedLayout(lengths=tuple(int(n) for n in lengths), degree=engine.degree,
                                   inner=engine.inner)
        self._cache: dict[torch.device, tuple] = {}

    def _prepare(self, device: torch.device) -> tuple:
        if device not in self._cache:
            e, lay = self.engine, self.layout
            gather = inv = None
            if e.inner > 1:
                g = lay.gather_index()
                gather = to_device(g, device)
                inv = to_device(np.argsort(g), device)
            ring = None
            if e.outer > 1:
                ring = RingPass([lay.ring_positions(s) for s in range(e.outer)], lay.padded // (2 * e.outer),
                                e.outer_index, e.outer_group, e.outer_ranks, e.overlap, e.stats, device)
            host = np.concatenate([[0], np.cumsum(lay.padded)])  # [segments + 1] padded bounds
            self._cache[device] = (gather, inv, ring, (to_device(host, device), host, int(lay.padded.max())))
        return self._cache[device]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        e, lay = self.engine, self.layout
        q, k, v = (x.contiguous() for x in (q, k, v))  # views from the HF adapter: one copy here, none when local
        t, h, d = q.shape
        hkv = k.shape[1]
        if t != lay.lane_tokens:
            raise ValueError(f"this lane holds {t} tokens but segments {list(lay.lengths)[:8]} on degree "
                             f"{lay.degree} need {lay.lane_tokens} (padded lengths / degree)")
        u = e.inner
        if hkv % u:
            raise ValueError(f"Ulysses degree {u} must divide the KV heads per TP rank ({hkv}); use ring "
                             f"attention or a nested engine with a smaller inner size")
        gather, inv, ring, padded = self._prepare(q.device)
        if u > 1:  # sequence-sharded [T, H, D] -> head-sharded ring layout [u*T, H/u, D]
            parts = [x.reshape(t, u, x.shape[1] // u, d) for x in (q, k, v)]
            x = torch.cat(parts, dim=2).permute(1, 0, 2, 3)  # [u, T, (H+2Hkv)/u, D]
            x = _AllToAllFn.apply(x, e.inner_a2a).reshape(u * t, -1, d).index_select(0, gather)
            q, k, v = x.split([h // u, hkv // u, hkv // u], dim=1)
        if ring is not None:
            o = ring_attention(q, k, v, ring)
        else:
            cu, host, longest = padded
            o = varlen_attention(q, k, v, cu, impl=e.impl, max_seqlen=longest, host_cu_seqlens=host)
        if u > 1:  # back: [u*T, H/u, D] -> [u, T, H/u, D] -> a2a -> [T, H, D]
            o = o.index_select(0, inv).reshape(u, t, h // u, d)
            o = _AllToAllFn.apply(o, e.inner_a2a).permute(1, 0, 2, 3).reshape(t, h, d)
        return o


class ContextParallel:
    """Common interface: ``degree``, ``inner`` x ``outer`` and ``bind(segment_lengths) -> attn``."""

    kind = "local"

    def __init__(self, *, inner_group: dist.ProcessGroup | None = None, inner_ranks: Sequence[int] = (0,),
                 inner_index: int = 0, outer_group: dist.ProcessGroup | None = None,
                 outer_ranks: Sequence[int] = (0,), outer_index: int = 0, overlap: bool = True,
                 stats: CommStats | None = None, impl: str = "auto") -> None:
        self.inner_ranks, self.outer_ranks = tuple(inner_ranks), tuple(outer_ranks)
        self.inner, self.outer = len(self.inner_ranks), len(self.outer_ranks)
        self.inner_index, self.outer_index = inner_index, outer_index
        self.inner_group, self.outer_group = inner_group, outer_group
        self.overlap = overlap
        self.stats = stats if stats is not None else CommStats()
        self.impl = impl
        self.inner_a2a = _A2A(inner_group, self.inner_ranks, self.stats)

    @property
    def degree(self) -> int:
        return self.inner * self.outer

    @property
    def lane_index(self) -> int:
        return self.outer_index * self.inner + self.inner_index

    def bind(self, segment_lengths: Sequence[int]) -> Attn:
        """The attention callable for a microbatch of segments with these true lengths."""
        if self.degree == 1:
            lengths = np.asarray(segment_lengths, dtype=np.int64)
            host = np.concatenate([[0], np.cumsum(lengths)])  # [segments + 1]
            max_seqlen = int(lengths.max(initial=0))
            impl = self.impl
            cus: dict[torch.device, torch.Tensor] = {}  # one host-to-device copy per microbatch, not per layer

            def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                cu = cus.get(q.device)
                if cu is None:
                    cu = cus[q.device] = to_device(host, q.device)
                return varlen_attention(q, k, v, cu, impl=impl, max_seqlen=max_seqlen, host_cu_seqlens=host)

            return attn
        return _Bound(self, segment_lengths)


class LocalAttention(ContextParallel):
    """Degree 1: the lane holds whole docs."""

    def __init__(self, *, impl: str = "auto", stats: CommStats | None = None) -> None:
        super().__init__(impl=impl, stats=stats)


class RingAttention(ContextParallel):
    """Ring attention over ``ranks`` (lane order); this rank is lane ``lane_index``."""

    kind = "ring"

    def __init__(self, group: dist.ProcessGroup | None, ranks: Sequence[int], lane_index: int, *,
                 overlap: bool = True, stats: CommStats | None = None, impl: str = "auto") -> None:
        super().__init__(outer_group=group, outer_ranks=ranks, outer_index=lane_index, overlap=overlap,
                         stats=stats, impl=impl)


class UlyssesAttention(ContextParallel):
    """Ulysses all-to-all over ``ranks`` (lane order); the degree must divide the KV heads per TP rank."""

    kind = "ulysses"

    def __init__(self, group: dist.ProcessGroup | None, ranks: Sequence[int], lane_index: int, *,
                 stats: CommStats | None = None, impl: str = "auto") -> None:
        super().__init__(inner_group=group, inner_ranks=ranks, inner_index=lane_index, stats=stats, impl=impl)


class NestedAttention(ContextParallel):
    """HyDra's nested engine: Ulysses inside ``inner_ranks``, ring across ``outer_ranks``."""

    kind = "nested"

    def __init__(self, inner_group: dist.ProcessGroup | None, inner_ranks: Sequence[int],
                 outer_group: dist.ProcessGroup | None, outer_ranks: Sequence[int], lane_index: int, *,
                 overlap: bool = True, stats: CommStats | None = None, impl: str = "auto") -> None:
        u = len(inner_ranks)
        super().__init__(inner_group=inner_group, inner_ranks=inner_ranks, inner_index=lane_index % u,
                         outer_group=outer_group, outer_ranks=outer_ranks, outer_index=lane_index // u,
                         overlap=overlap, stats=stats, impl=impl)


def make_engine(kind: str, groups, cp_ranks: Sequence[int], rank: int, *, inner: int = 1, overlap: bool = True,
                stats: CommStats | None = None, impl: str = "auto") -> ContextParallel:
    """The engine of ``kind`` for the CP group ``cp_ranks`` (lane order) as seen by ``rank``.

    ``groups`` is a :class:`parallel_runtime.groups.GroupCache` holding the pre-created groups.
    """
    if kind not in ENGINES:
        raise ValueError(f"unknown CP engine '{kind}'; choose one of {', '.join(ENGINES)}")
    cp_ranks = tuple(int(r) for r in cp_ranks)
    if rank not in cp_ranks:
        raise ValueError(f"rank {rank} is not in CP group {cp_ranks}")
    lane = cp_ranks.index(rank)
    if len(cp_ranks) == 1:
        return LocalAttention(impl=impl, stats=stats)
    if kind == "ring":
        return RingAttention(groups.get(cp_ranks), cp_ranks, lane, overlap=overlap, stats=stats, impl=impl)
    if kind == "ulysses":
        return UlyssesAttention(groups.get(cp_ranks), cp_ranks, lane, stats=stats, impl=impl)
    if inner < 1 or len(cp_ranks) % inner:
        raise ValueError(f"nested CP: inner (Ulysses) size {inner} must divide the degree {len(cp_ranks)}")
    ng = groups.nested(cp_ranks, inner)
    return NestedAttention(ng.inner, ng.inner_ranks, ng.outer, ng.outer_ranks, lane, overlap=overlap,
                           stats=stats, impl=impl)
