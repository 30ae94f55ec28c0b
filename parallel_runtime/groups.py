"""Process groups by rank tuple: created collectively in one order on every rank, then looked up.

:class:`GroupCache` is this rank's groups. ``new_group`` is collective over the world, so every
group is created by every rank, member or not, in the same order: :meth:`GroupCache.ensure` takes
the same list of :class:`~parallel_runtime.topology.GroupSpec` on every rank and creates those not
created yet, in list order; :meth:`GroupCache.build` is a cache with every group the given
topologies and plans need (:func:`parallel_runtime.topology.required_groups`) created up front. A
step then only *looks up* groups by rank tuple (:meth:`GroupCache.get`); asking for a group that was
not created is a clear error. A run creates the groups of its declared shapes at start-up
(:func:`declared_groups`), then whatever a step's plan adds (:func:`plan_groups`). Starting the world
itself is :mod:`parallel_runtime.launch`. Every group gets the world's collective timeout
(:func:`parallel_runtime.launch.new_group`), or ``timeout_s`` when given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from balanced_loader.cost import allowed_degrees
from balanced_loader.plan import StepPlan
from parallel_runtime.launch import new_group
from parallel_runtime.topology import GroupSpec, Topology, nested_split, required_groups


@dataclass(frozen=True, kw_only=True)
class NestedGroups:
    """This rank's two groups of a nested (Ulysses-in-ring) CP group."""

    inner_ranks: tuple[int, ...]  # [inner] in lane order
    inner: dist.ProcessGroup | None
    outer_ranks: tuple[int, ...]  # [outer] in lane order
    outer: dist.ProcessGroup | None


@dataclass(kw_only=True)
class GroupCache:
    """This rank's process groups by sorted rank tuple (what every engine looks groups up in), created
    collectively in one order on every rank (module docstring)."""

    rank: int
    backend: str | None = None  # None: the world's backend (gloo on CPU, NCCL on CUDA)
    timeout_s: float | None = None  # collective timeout of the groups (None: the world's)
    # False: a group over the whole world is a group of its own, not the world's default group (whose
    # collectives a user's DDP also issues, from its autograd hooks, in an order of its own)
    reuse_world: bool = True
    created: set[tuple[int, ...]] = field(default_factory=set)  # every group created, member or not
    _groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict, repr=False)  # member only

    @staticmethod
    def build(
        topologies: Iterable[Topology] = (),
        *,
        plans: Iterable[StepPlan] = (),
        cp_sizes: Callable[[int], Sequence[int]] = allowed_degrees,
        inner_sizes: Sequence[int] | None = None,
        gpus_per_node: int | None = None,
        extra: Iterable[Sequence[int]] = (),
        backend: str | None = None,
        timeout_s: float | None = None,
        reuse_world: bool = True,
    ) -> GroupCache:
        """A cache holding every group the given topologies and plans need (collective: call on all ranks).

        ``backend`` defaults to the world's backend (gloo on CPU, NCCL on CUDA); ``timeout_s`` to the
        world's collective timeout; ``reuse_world=False`` creates a world-spanning group of its own.
        """
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized; call parallel_runtime.launch.init_world() (or "
                             "init_process_group) on every rank before GroupCache.build")
        specs = required_groups(topologies, plans=plans, cp_sizes=cp_sizes, inner_sizes=inner_sizes,
                                gpus_per_node=gpus_per_node, extra=extra)
        out = GroupCache(rank=dist.get_rank(), backend=backend, timeout_s=timeout_s, reuse_world=reuse_world)
        out.ensure(specs)
        return out

    def ensure(self, specs: Iterable[GroupSpec]) -> int:
        """Create the groups of ``specs`` that do not exist yet, in ``specs`` order (collective: the same specs
        on every rank); returns how many it created."""
        world = dist.get_world_size()
        specs = list(specs)
        for spec in specs:  # checked before any is created: a bad list creates none, on every rank alike
            if spec.ranks[-1] >= world:
                raise ValueError(f"{spec.kind} group {spec.ranks} names rank {spec.ranks[-1]} but the "
                                 f"world has {world} ranks")
        n = 0
        for spec in specs:
            if spec.ranks in self.created:
                continue
            self.created.add(spec.ranks)
            if len(spec.ranks) == world and self.reuse_world:
                pg = dist.group.WORLD
            else:
                pg = new_group(spec.ranks, backend=self.backend, timeout_s=self.timeout_s)
            if self.rank in spec.ranks:
                self._groups[spec.ranks] = pg
            n += 1
        return n

    def __len__(self) -> int:
        """Groups created (member or not)."""
        return len(self.created)

    def get(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """The group over ``ranks`` (any order); ``None`` for a single rank."""
        key = tuple(sorted(int(r) for r in ranks))
        if len(key) <= 1:
            return None
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} asked for group {key}, which it is not a member of")
        pg = self._groups.get(key)
        if pg is None:
            raise ValueError(f"process group over ranks {key} was not pre-created; create every group a plan "
                             f"needs first (GroupCache.build with its plans or sizes, or GroupCache.ensure)")
        return pg

    def members(self) -> list[dist.ProcessGroup]:
        """The distinct process groups this rank is a member of (on NCCL, each a communicator with buffers of
        its own once used; none is destroyed while the run lasts)."""
        return list({id(g): g for g in self._groups.values()}.values())

    def has(self, ranks: Sequence[int]) -> bool:
        key = tuple(sorted(int(r) for r in ranks))
        return len(key) <= 1 or key in self._groups

    def nested(self, cp_ranks: Sequence[int], inner: int) -> NestedGroups:
        """This rank's inner (Ulysses) and outer (ring) groups of a CP group (lane order)."""
        inners, outers = nested_split(tuple(cp_ranks), inner)
        mine_in = next((g for g in inners if self.rank in g), None)
        mine_out = next((g for g in outers if self.rank in g), None)
        if mine_in is None or mine_out is None:
            raise ValueError(f"rank {self.rank} is not in CP group {tuple(cp_ranks)}")
        return NestedGroups(inner_ranks=mine_in, inner=self.get(mine_in),
                            outer_ranks=mine_out, outer=self.get(mine_out))


def declared_groups(topologies: Iterable[Topology], cp_engine: str, cp_inner: int) -> list[GroupSpec]:
    """Groups of the run's declared pool shapes: TP, PP and every aligned CP block (plus nested parts)."""
    return required_groups(topologies, inner_sizes=_inner_sizes(cp_engine, cp_inner))


def plan_groups(plan: StepPlan, cp_engine: str, cp_inner: int) -> list[GroupSpec]:
    """Groups one plan uses: its pools' TP and PP groups and its CP groups (plus nested parts)."""
    return required_groups([], plans=[plan], cp_sizes=lambda n: [1], inner_sizes=_inner_sizes(cp_engine, cp_inner))


def _inner_sizes(cp_engine: str, cp_inner: int) -> list[int]:
    # only the nested engine splits a CP group into Ulysses-inside-ring parts that need groups of their own
    return [cp_inner] if cp_engine == "nested" and cp_inner > 1 else []
