"""Process groups for a set of plan shapes: created once, looked up by rank tuple.

:class:`ProcessGroups` creates every group :func:`parallel_runtime.topology.required_groups`
lists, once, in the same order on every rank (``new_group`` is collective over the world),
deduplicated by rank set. A step then only *looks up* groups by rank tuple; nothing is
created on the hot path, and asking for a group that was not pre-created is a clear error.

:class:`GroupCache` does the same lazily for a run: the groups of the declared shapes at
start-up, then any group a step's plan needs that does not exist yet. Starting the world
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
class GroupLookup:
    """This rank's process groups by sorted rank tuple (what every engine looks groups up in)."""

    rank: int
    timeout_s: float | None = None  # collective timeout of the groups (None: the world's)
    # False: a group over the whole world is a group of its own, not the world's default group (whose
    # collectives a user's DDP also issues, from its autograd hooks, in an order of its own)
    reuse_world: bool = True
    _groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict, repr=False)

    def _create(self, spec: GroupSpec, world: int, backend: str | None) -> None:
        """Create ``spec``'s group (collective over the world: every rank, member or not, in one order)."""
        if len(spec.ranks) == world and self.reuse_world:
            pg = dist.group.WORLD
        else:
            pg = new_group(spec.ranks, backend=backend, timeout_s=self.timeout_s)
        if self.rank in spec.ranks:
            self._groups[spec.ranks] = pg

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
                             f"needs first (ProcessGroups.build with its plans or sizes, or GroupCache.ensure)")
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


@dataclass(kw_only=True)
class ProcessGroups(GroupLookup):
    """Pre-created process groups of this rank, looked up by rank tuple."""

    world_size: int
    specs: tuple[GroupSpec, ...]

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
    ) -> ProcessGroups:
        """Create every group the given topologies and plans need (collective: call on all ranks).

        ``backend`` defaults to the world's backend (gloo on CPU, NCCL on CUDA); ``timeout_s`` to the
        world's collective timeout; ``reuse_world=False`` creates a world-spanning group of its own.
        """
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized; call parallel_runtime.launch.init_world() (or "
                             "init_process_group) on every rank before ProcessGroups.build")
        specs = required_groups(topologies, plans=plans, cp_sizes=cp_sizes, inner_sizes=inner_sizes,
                                gpus_per_node=gpus_per_node, extra=extra)
        world = dist.get_world_size()
        rank = dist.get_rank()
        out = ProcessGroups(rank=rank, world_size=world, specs=tuple(specs), timeout_s=timeout_s,
                            reuse_world=reuse_world)
        for spec in specs:
            if spec.ranks[-1] >= world:
                raise ValueError(f"{spec.kind} group {spec.ranks} names rank {spec.ranks[-1]} but the "
                                 f"world has {world} ranks")
            out._create(spec, world, backend)
        return out

    def __len__(self) -> int:
        return len(self.specs)


@dataclass(kw_only=True)
class GroupCache(GroupLookup):
    """Process groups by rank set, created collectively in one order on every rank, as plans need them."""

    backend: str | None = None
    created: set[tuple[int, ...]] = field(default_factory=set)  # every group created, member or not
    num_created: int = 0

    def ensure(self, specs: Iterable[GroupSpec]) -> int:
        """Create the groups of ``specs`` that do not exist yet (collective: same specs on every rank)."""
        world = dist.get_world_size()
        n = 0
        for spec in specs:
            if spec.ranks in self.created:
                continue
            self.created.add(spec.ranks)
            self._create(spec, world, self.backend)
            n += 1
        self.num_created += n
        return n


def declared_groups(topologies: Iterable[Topology], cp_engine: str, cp_inner: int) -> list[GroupSpec]:
    """Groups of the run's declared pool shapes: TP, PP and every aligned CP block (plus nested parts)."""
    return required_groups(topologies, inner_sizes=_inner_sizes(cp_engine, cp_inner))


def plan_groups(plan: StepPlan, cp_engine: str, cp_inner: int) -> list[GroupSpec]:
    """Groups one plan uses: its pools' TP and PP groups and its CP groups (plus nested parts)."""
    return required_groups([], plans=[plan], cp_sizes=lambda n: [1], inner_sizes=_inner_sizes(cp_engine, cp_inner))


def _inner_sizes(cp_engine: str, cp_inner: int) -> list[int]:
    # only the nested engine splits a CP group into Ulysses-inside-ring parts that need groups of their own
    return [cp_inner] if cp_engine == "nested" and cp_inner > 1 else []
