"""Rank coordinates and group rank lists derived from a plan's pools (pure: no torch.distributed).

A pool is a rank grid ``[pp][num_lanes * tp]``: lane ``l``, tp index ``t`` of stage ``s`` is
``ranks[s][l*tp + t]`` (contract 1). Everything else is derived from that grid:

* a rank's coordinates ``(pool, stage, lane, tp_index)``;
* its TP group (the ``tp`` ranks of its lane at its stage) and its stage neighbours;
* the CP group of a plan group at stage ``s``, tp index ``t``:
  ``[pool.rank(s, lane, t) for lane in group.lanes]``;
* the full, ordered, deduplicated list of rank tuples a set of plans needs
  (:func:`required_groups`), which :mod:`parallel_runtime.groups` turns into process groups.

The whole grid of a step reads on one screen (:meth:`Topology.describe`)::

    >>> print(Topology.uniform(16, tp=2, pp=2).describe())
    world 16, 1 pool(s)
    pool 0: tp=2 pp=2 lanes=4
      stage 0: [0,1] [2,3] [4,5] [6,7]
      stage 1: [8,9] [10,11] [12,13] [14,15]

Simulated worlds of thousands of ranks are checked here without any process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from balanced_loader.cost import allowed_degrees
from balanced_loader.plan import Group, Pool, StepPlan, pool_grid, single_pool_ranks


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCoord:
    """Where one rank sits: pool index, pipeline stage, lane, tp index."""

    rank: int
    pool: int
    stage: int
    lane: int
    tp_index: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolShape(Pool):
    """The rank grid of one pool, without its microbatches.

    A :class:`~balanced_loader.plan.Pool` whose microbatches are dropped, so the grid maths
    (``rank``, ``lane_ranks``, ``num_lanes``) is the contract's own: there is no second formula
    for ``ranks[s][l*tp + t]`` here. It adds the CP group of a set of lanes.
    """

    microbatches: tuple = field(default=(), repr=False)  # always empty: a shape is the grid alone

    def cp_ranks(self, lanes: Sequence[int], stage: int = 0, tp_index: int = 0) -> tuple[int, ...]:
        """Ranks of a group of lanes at one stage and tp index, in the group's lane order."""
        return tuple(self.rank(stage, lane, tp_index) for lane in lanes)

    @staticmethod
    def of(pool: Pool) -> PoolShape:
        return PoolShape(tp=pool.tp, pp=pool.pp, ranks=tuple(tuple(r) for r in pool.ranks))


@dataclass(frozen=True, kw_only=True, slots=True)
class LaneWork:
    """What one rank does in one microbatch: its group, its place in it, the group's CP ranks."""

    microbatch: int
    group_index: int
    group: Group
    lane_index: int  # position of this rank's lane in group.lanes
    cp_ranks: tuple[int, ...]  # [degree] global ranks, in group.lanes order


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """The pools of one step as validated data; coordinates and groups are derived from it."""

    world_size: int
    pools: tuple[PoolShape, ...]
    _coords: tuple[RankCoord, ...] = field(init=False, repr=False, compare=False)  # [world_size]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(PoolShape.of(p) for p in self.pools))
        object.__setattr__(self, "_coords", _validate_and_locate(self.world_size, self.pools))

    # ---- construction ----------------------------------------------------
    @staticmethod
    def from_plan(plan: StepPlan) -> Topology:
        """The topology of a step plan; also checks its microbatches' lanes (``Pool.check_lanes``:
        :meth:`lane_work` relies on them). A plan's full contract check is
        :func:`parallel_runtime.training.plan_check.check_plan_runs_here`."""
        topo = Topology(world_size=plan.world_size, pools=tuple(PoolShape.of(p) for p in plan.pools))
        for pi, pool in enumerate(plan.pools):
            pool.check_lanes(f"step {plan.step}, pool {pi}")
        return topo

    @staticmethod
    def uniform(world_size: int, *, tp: int = 1, pp: int = 1) -> Topology:
        """One pool of shape ``(tp, pp)`` over the whole world (stage-major, TP innermost)."""
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
        return Topology(world_size=world_size,
                        pools=(PoolShape(tp=tp, pp=pp, ranks=single_pool_ranks(world_size, tp, pp)),))

    # ---- per-rank views ----------------------------------------------------
    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world 0..{self.world_size - 1}")
        return self._coords[rank]

    def pool_of(self, rank: int) -> PoolShape:
        return self.pools[self.coord(rank).pool]

    def tp_ranks(self, rank: int) -> tuple[int, ...]:
        """The TP group of ``rank`` (its lane at its stage), in tp-index order."""
        c = self.coord(rank)
        return self.pools[c.pool].lane_ranks(c.lane, c.stage)

    def pipeline_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s lane and tp index across all stages, stage order."""
        c = self.coord(rank)
        p = self.pools[c.pool]
        return tuple(p.rank(s, c.lane, c.tp_index) for s in range(p.pp))

    def stage_neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """``(previous, next)`` stage rank of the same lane and tp index; ``None`` at the ends."""
        c = self.coord(rank)
        p = self.pools[c.pool]
        prev = p.rank(c.stage - 1, c.lane, c.tp_index) if c.stage > 0 else None
        nxt = p.rank(c.stage + 1, c.lane, c.tp_index) if c.stage < p.pp - 1 else None
        return prev, nxt

    def lane_work(self, rank: int, plan: StepPlan) -> tuple[LaneWork | None, ...]:
        """For each microbatch of ``rank``'s pool in ``plan``: its work, or ``None`` if it skips it."""
        c = self.coord(rank)
        pool = plan.pools[c.pool]
        if PoolShape.of(pool) != self.pools[c.pool]:
            raise ValueError(f"plan step {plan.step}: pool {c.pool} has a different rank grid than this topology")
        shape = self.pools[c.pool]
        out: list[LaneWork | None] = []
        for k, mb in enumerate(pool.microbatches):
            work = None
            for gi, g in enumerate(mb):
                if c.lane in g.lanes:
                    work = LaneWork(microbatch=k, group_index=gi, group=g, lane_index=g.lanes.index(c.lane),
                                    cp_ranks=shape.cp_ranks(g.lanes, c.stage, c.tp_index))
                    break
            out.append(work)
        return tuple(out)

    def step_peers(self, rank: int, plan: StepPlan) -> list[int]:
        """The ranks ``rank`` exchanges with in ``plan``'s forward/backward: its pipeline lane, TP group and the CP
        groups of its microbatches (what a timeout there waited on)."""
        peers = set(self.pipeline_ranks(rank)) | set(self.tp_ranks(rank))
        for w in self.lane_work(rank, plan):
            if w is not None:
                peers.update(w.cp_ranks)
        return sorted(peers)

    def describe(self) -> str:
        """The rank grid on one screen: one line per pool stage."""
        lines = [f"world {self.world_size}, {len(self.pools)} pool(s)"]
        for i, p in enumerate(self.pools):
            lines.append(f"pool {i}: tp={p.tp} pp={p.pp} lanes={p.num_lanes}")
            for s in range(p.pp):
                lanes = " ".join("[" + ",".join(str(r) for r in p.lane_ranks(lane, s)) + "]"
                                 for lane in range(p.num_lanes))
                lines.append(f"  stage {s}: {lanes}")
        return "\n".join(lines)


def _validate_and_locate(world_size: int, pools: tuple[PoolShape, ...]) -> tuple[RankCoord, ...]:
    """Every rank's coordinate; the grid checked by the plan's own check (:func:`~balanced_loader.plan.pool_grid`)."""
    return tuple(RankCoord(rank=r, pool=p, stage=s, lane=lane, tp_index=t)
                 for r, (p, s, lane, t) in enumerate(pool_grid(world_size, pools)))


# ---- the rank tuples a set of plans needs ------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    """One process group to create: its purpose and its ranks (sorted, as torch orders them)."""

    kind: str  # "tp" | "pp" | "cp" | "cp_outer" | "pool" | "extra"
    ranks: tuple[int, ...]


def nested_split(cp_ranks: Sequence[int], inner: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Inner (Ulysses) and outer (ring) rank tuples of a CP group of ``inner * outer`` lanes.

    Lane ``j*inner + i`` of the group is inner rank ``i`` of inner group ``j`` and outer rank
    ``j`` of outer group ``i`` (the layout of :func:`balanced_loader.materialize.cp_positions`).
    """
    d = len(cp_ranks)
    if inner < 1 or d % inner:
        raise ValueError(f"inner (Ulysses) size {inner} does not divide the CP degree {d}")
    outer = d // inner
    inners = [tuple(cp_ranks[j * inner:(j + 1) * inner]) for j in range(outer)]
    outers = [tuple(cp_ranks[i::inner]) for i in range(inner)]
    return inners, outers


def required_groups(
    topologies: Iterable[Topology],
    *,
    plans: Iterable[StepPlan] = (),
    cp_sizes: Callable[[int], Sequence[int]] = allowed_degrees,
    inner_sizes: Sequence[int] | None = None,
    gpus_per_node: int | None = None,
    extra: Iterable[Sequence[int]] = (),
) -> list[GroupSpec]:
    """Every process group a set of topologies and plans needs, in one deterministic order.

    * ``tp``: each lane's TP group at each stage; ``pp``: each lane's pipeline per tp index.
    * ``cp``: aligned blocks of lanes for every size in ``cp_sizes(num_lanes)`` (powers of two
      by default), at every stage and tp index; plus every group of ``plans``.
    * nested CP: for each CP group of degree ``d`` and each inner size ``u`` (from
      ``inner_sizes``, default ``cp_sizes``) with ``1 < u < d``, ``u | d``: the inner (Ulysses)
      and outer (ring) groups of :func:`nested_split`. With ``gpus_per_node``, an inner size
      is used only if all its inner groups stay inside one node.
    * ``pool``: all ranks of a planned pool that has ``barriers`` (the runtime's barrier group).
    * ``extra``: any other rank lists the caller needs.

    Groups of one rank are not listed. Duplicates (same rank set) keep their first entry.
    The result depends only on the arguments, so every rank computes the same list.
    """
    seen: set[tuple[int, ...]] = set()
    out: list[GroupSpec] = []

    def add(kind: str, ranks: Sequence[int]) -> None:
        key = tuple(sorted(ranks))
        if len(key) > 1 and key not in seen:
            seen.add(key)
            out.append(GroupSpec(kind=kind, ranks=key))

    def add_cp(shape_sizes: Sequence[int], ranks: tuple[int, ...]) -> None:
        add("cp", ranks)
        d = len(ranks)
        for u in (inner_sizes if inner_sizes is not None else shape_sizes):
            if 1 < u < d and d % u == 0:
                inners, outers = nested_split(ranks, u)
                if gpus_per_node and any(len({r // gpus_per_node for r in g}) > 1 for g in inners):
                    continue
                for g in inners:
                    add("cp", g)
                for g in outers:
                    add("cp_outer", g)

    topologies = list(topologies)
    plans = list(plans)
    for topo in [*topologies, *(Topology.from_plan(p) for p in plans)]:
        for p in topo.pools:
            for s in range(p.pp):
                for lane in range(p.num_lanes):
                    add("tp", p.lane_ranks(lane, s))
            for lane in range(p.num_lanes):
                for t in range(p.tp):
                    add("pp", [p.rank(s, lane, t) for s in range(p.pp)])
            sizes = [d for d in cp_sizes(p.num_lanes) if d > 1]
            for d in sizes:
                for b in range(p.num_lanes // d):
                    for s in range(p.pp):
                        for t in range(p.tp):
                            add_cp(sizes, p.cp_ranks(range(b * d, (b + 1) * d), s, t))
    for plan in plans:
        for pool in plan.pools:
            shape = PoolShape.of(pool)
            if pool.barriers:  # contract 1: every lane of the pool waits at a barrier (one group over the pool)
                add("pool", [r for stage in pool.ranks for r in stage])
            sizes = [d for d in cp_sizes(shape.num_lanes) if d > 1]
            for mb in pool.microbatches:
                for g in mb:
                    if g.degree < 2:
                        continue
                    for s in range(shape.pp):
                        for t in range(shape.tp):
                            add_cp(sizes, shape.cp_ranks(g.lanes, s, t))
    for ranks in extra:
        add("extra", tuple(int(r) for r in ranks))
    return out
