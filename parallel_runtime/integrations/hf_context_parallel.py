"""Dynamic context parallelism for a transformers model in the user's own loop (accelerate, DDP, torchrun).

``bind = enable_context_parallel(model)`` makes every attention layer of ``model`` run through the
runtime's CP engines (ring, Ulysses or nested: :mod:`parallel_runtime.engines.context`), registered
in transformers' ``AttentionInterface`` as ``"bl_cp"`` (:mod:`parallel_runtime.hf.attention`), and
creates, once and in the same order on every rank, the process groups of every aligned block of
lanes the loader's default (hydra) plans may use (:class:`parallel_runtime.groups.GroupCache`).
Then, for each microbatch of a :class:`~balanced_loader.BalancedLoader` (default plans: CP groups
of several lanes, a different degree per microbatch)::

    mbs = bind.microbatches(batch)                   # this rank's, at least one
    for i, mb in enumerate(mbs):                     # all-reduce once, after the rank's last microbatch
        sync = contextlib.nullcontext() if i == len(mbs) - 1 else accelerator.no_sync(model)
        with sync, bind(mb, plan=batch.plan):        # this microbatch's group and engine
            out = model(**mb.to_hf(), num_items_in_batch=batch.num_valid_tokens)
            accelerator.backward(out.loss * accelerator.num_processes)

**No silent deadlock.** The ranks of a step may run different numbers of microbatches (a CP group
of 4 lanes is one microbatch on each of them, a lane of its own may run three). Under DDP a loop
that all-reduces after every microbatch (``batch.microbatches`` without ``no_sync``, as with
``cp=1``) then waits forever on every rank. So when a forward runs under DDP with its gradient
all-reduce on (``require_backward_grad_sync``), the binding checks it against the step's plan
(identical on every rank: no collective): an all-reduce before this rank's last microbatch, or a
step whose ranks run different counts without ``bind.microbatches`` (which gives a rank without
a microbatch its one padding backward), or no plan to check against, is refused in one line
naming ``bind.microbatches`` and ``no_sync``, on every rank at its first forward of the step.

``mb.to_hf()`` of a CP lane shard holds the lane's tokens in the CP layout, their true
``position_ids`` and ``shift_labels`` (the next token, shifted before sharding: a lane's tokens are
not contiguous, so the model must not shift them); the engine knows every doc's bounds, so no mask
is built. The loss of each rank is its tokens' sum over the step's global valid tokens, and the
engines send each K/V gradient back to its owner, so the gradients summed over the ranks (DDP's
all-reduce, times the number of processes) are exactly those of one process.

The binding lives on the model (a forward pre-hook that passes the bound engine down as the
``bl_attn`` keyword), so two models never share it. ``bind.disable()`` restores the model's own
attention. Lanes map to ranks by the plan's pool (one pool of tp = pp = 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from balanced_loader.materialize import Microbatch, padding_microbatch, rank_place
from balanced_loader.plan import StepPlan
from parallel_runtime.engines.context import LocalAttention, make_engine
from parallel_runtime.groups import GroupCache
from parallel_runtime.hf.attention import BOUND_KWARG, NAME, register
from parallel_runtime.hf.config import check_hf_config
from parallel_runtime.topology import Topology
from parallel_runtime.training.step import engine_kind

__all__ = ["ContextParallelBinding", "enable_context_parallel"]


class ContextParallelBinding:
    """What :func:`enable_context_parallel` returns: ``bind(mb)`` is the context a microbatch runs in."""

    def __init__(self, model: torch.nn.Module, groups: GroupCache | None, rank: int, world_size: int,
                 impl: str) -> None:
        self.model = model
        self.groups = groups
        self.rank = rank
        self.world_size = world_size
        self.impl = impl
        self._attn = None  # the bound engine of the microbatch in flight
        self._sync: tuple[Any, ...] | None = None  # (mb, plan, index, count, listed) of the microbatch in flight
        # bind.microbatches' last (plan, {id(mb): index}, count, the microbatches: kept, so no id is reused)
        self._listed: tuple[Any, dict[int, int], int, tuple] | None = None
        self._counts: tuple[Any, dict[int, int]] | None = None  # (plan, microbatches per rank) of the last plan
        self._previous = model.config._attn_implementation
        self._hook = model.register_forward_pre_hook(self._inject, with_kwargs=True)

    def _inject(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        if self._attn is None:
            raise ValueError("this model runs its attention through context-parallel engines: call it inside "
                             "`with bind(mb):` (bind = enable_context_parallel(model)), or bind.disable() first")
        if kwargs.get("attention_mask") is not None:
            raise ValueError("attention_mask with enable_context_parallel: the engines take every doc's bounds from "
                             "the microbatch; pass mb.to_hf() (no mask)")
        if kwargs.get("use_cache", getattr(module.config, "use_cache", False)):
            raise ValueError("use_cache=True with enable_context_parallel: pass use_cache=False (mb.to_hf() does)")
        ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)  # set in DDP's forward
        if ddp is not None and torch.is_grad_enabled() and getattr(ddp, "require_backward_grad_sync", False):
            self._check_sync()
        kwargs[BOUND_KWARG] = self._attn
        return args, kwargs

    def _rank_counts(self, plan: StepPlan) -> dict[int, int]:
        """Microbatches of every rank in ``plan`` (the groups its lane is in; 0 for a rank in none)."""
        if self._counts is not None and self._counts[0] is plan:
            return self._counts[1]
        counts = dict.fromkeys(range(plan.world_size), 0)
        for pool in plan.pools:
            per_lane: dict[int, int] = {}
            for mb in pool.microbatches:
                for g in mb:
                    for lane in g.lanes:
                        per_lane[lane] = per_lane.get(lane, 0) + 1
            for lane, c in per_lane.items():
                for stage in pool.ranks:
                    for t in range(pool.tp):
                        counts[stage[lane * pool.tp + t]] = c
        self._counts = (plan, counts)
        return counts

    def _check_sync(self) -> None:
        """Refuse a DDP all-reduce that some rank would never match (module docstring: no silent deadlock)."""
        mb, plan, index, count, listed = self._sync  # type: ignore[misc]
        fix = ("iterate bind.microbatches(batch) and run every microbatch but the rank's last under no_sync "
               "(accelerator.no_sync(model) or model.no_sync()), so that each rank all-reduces once per step")
        if plan is None:
            raise ValueError(f"microbatch {mb.k}: a DDP gradient all-reduce with no plan to check it against (ranks "
                             f"may run different numbers of microbatches, and a mismatch waits forever): pass "
                             f"bind(mb, plan=batch.plan) and {fix}")
        if index < count - 1:
            raise ValueError(f"step {plan.step}: rank {self.rank} would all-reduce its gradients after microbatch "
                             f"{index} of its {count}, while ranks run {self._spread(plan)} microbatches: DDP's "
                             f"all-reduces would never match (a hang); {fix}")
        counts = self._rank_counts(plan)
        if not listed and len(set(counts.values())) > 1:
            raise ValueError(f"step {plan.step}: ranks run {self._spread(plan)} microbatches and this loop does not "
                             f"take them from bind.microbatches (a rank with none would never all-reduce: a hang); "
                             f"{fix}")

    def _spread(self, plan: StepPlan) -> str:
        counts = self._rank_counts(plan)
        lo, hi = min(counts.values()), max(counts.values())
        return f"{lo}" if lo == hi else f"{lo} to {hi} (rank {min(counts, key=counts.get)}: {lo}, rank " \
                                        f"{max(counts, key=counts.get)}: {hi})"

    def _cp_ranks(self, mb: Microbatch, plan: StepPlan | None) -> tuple[int, ...]:
        if plan is None:
            if mb.lane != self.rank:
                raise ValueError(f"microbatch {mb.k} is lane {mb.lane} but this is rank {self.rank}; pass the step's "
                                 f"plan, bind(mb, plan=batch.plan), to map lanes to ranks")
            return tuple(mb.lanes)
        pool = plan.pools[mb.pool]
        if pool.tp > 1 or pool.pp > 1:
            raise ValueError(f"a pool of tp={pool.tp}, pp={pool.pp}: enable_context_parallel runs whole models on "
                             f"tp=1, pp=1 lanes only")
        return tuple(pool.ranks[0][lane] for lane in mb.lanes)

    @contextlib.contextmanager
    def __call__(self, mb: Microbatch, plan: StepPlan | None = None) -> Iterator[None]:
        """The model's attention runs ``mb``'s group (its engine bound to ``mb``'s segments) inside the block."""
        if not isinstance(mb, Microbatch):
            raise ValueError(f"bind() takes a balanced_loader Microbatch, got {type(mb).__name__}")
        if not mb.has_tokens or mb.stage or mb.tp_index:
            raise ValueError(f"microbatch {mb.k} is of pipeline stage {mb.stage}, tp index {mb.tp_index}: "
                             f"enable_context_parallel runs whole models on tp=1, pp=1 lanes only")
        if self._attn is not None:
            raise ValueError("bind(mb) is already active for this model: one microbatch at a time")
        listed = self._listed is not None and id(mb) in self._listed[1]
        if plan is None and listed:
            plan = self._listed[0]  # type: ignore[index]
        ranks = self._cp_ranks(mb, plan)
        if listed:
            index, count = self._listed[1][id(mb)], self._listed[2]  # type: ignore[index]
        elif plan is not None:
            mine = [k for k, groups in enumerate(plan.pools[mb.pool].microbatches) if any(mb.lane in g.lanes
                                                                                          for g in groups)]
            index, count = (mine.index(mb.k) if mb.k in mine else 0), len(mine)
        else:
            index, count = 0, 1
        self._sync = (mb, plan, index, count, listed)
        if len(ranks) == 1:
            engine = LocalAttention(impl=self.impl)  # whole docs on this rank: varlen attention over them
        else:
            if self.groups is None:
                raise ValueError(f"microbatch {mb.k} spans {len(ranks)} lanes but torch.distributed is not initialized")
            engine = make_engine(engine_kind(mb.degree, mb.cp_inner), self.groups, ranks, self.rank,
                                 inner=mb.cp_inner, impl=self.impl)
        self._attn = engine.bind(mb.seq_lengths)
        try:
            yield
        finally:
            self._attn = None
            self._sync = None

    def microbatches(self, batch: Any) -> tuple[Microbatch, ...]:
        """``batch.microbatches``, or one padding microbatch when this rank has none in the step, so that a
        DDP loop runs at least one backward (its gradient all-reduce) on every rank."""
        if batch.microbatches:
            out = tuple(batch.microbatches)
        else:
            place = rank_place(batch.plan, batch.rank)
            out = (padding_microbatch(place, lane=place.lane),)
        # remembered: a forward of one of these under DDP knows its place and the step's plan
        self._listed = (batch.plan, {id(mb): i for i, mb in enumerate(out)}, len(out), out)
        return out

    def disable(self) -> None:
        """Remove the binding: the model's own attention implementation again."""
        self._hook.remove()
        self.model.set_attn_implementation(self._previous)


def enable_context_parallel(model: torch.nn.Module, *, cp_inner: int = 1, impl: str = "auto",
                            max_seq_len: int | None = None, groups: GroupCache | None = None,
                            cp_sizes: Sequence[int] | None = None) -> ContextParallelBinding:
    """Run ``model``'s attention through the CP engines, per microbatch: ``with bind(mb): model(**mb.to_hf())``.

    Collective when ``torch.distributed`` is initialized (call it on every rank, after
    ``init_process_group`` / ``Accelerator()``, before or after ``accelerator.prepare``): it creates the
    process groups of every aligned power-of-two block of ranks (and, with ``cp_inner`` > 1, their
    Ulysses-inside-ring parts), each a group of its own. ``cp_inner``: the loader's ``cp_inner``
    (1: ring; a group whose degree it equals runs Ulysses, a larger one nested). ``groups``: groups made
    by the caller instead (:class:`~parallel_runtime.groups.GroupCache`); ``cp_sizes``: the degrees
    to create groups for (default: every power of two up to the world size). ``impl``: the local
    attention kernel (``"auto"``: flash-attention varlen on CUDA, tiled SDPA on CPU). ``max_seq_len``:
    the loader's, checked against a sliding window (default: the model's ``max_position_embeddings``).
    """
    plain = getattr(model, "module", model)  # a DDP-wrapped model: its module
    cfg = getattr(plain, "config", None)
    if cfg is None or not hasattr(plain, "set_attn_implementation"):
        raise ValueError(f"enable_context_parallel takes a transformers model, got {type(plain).__name__}")
    if isinstance(cp_inner, bool) or not isinstance(cp_inner, int) or cp_inner < 1:
        raise ValueError(f"cp_inner must be an integer >= 1, got {cp_inner!r}")
    check_hf_config(cfg, max_seq_len=int(max_seq_len or getattr(cfg, "max_position_embeddings", 0) or 0))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if groups is None and world > 1:
        sizes = (lambda n: [d for d in cp_sizes if d <= n]) if cp_sizes is not None else None
        kw = {"cp_sizes": sizes} if sizes is not None else {}
        groups = GroupCache.build([Topology.uniform(world)], inner_sizes=[cp_inner] if cp_inner > 1 else [],
                                     reuse_world=False, **kw)
    register()
    binding = ContextParallelBinding(plain, groups, rank, world, impl)
    plain.set_attn_implementation(NAME)
    return binding
