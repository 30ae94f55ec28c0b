"""A Spindle wave plan as what every rank executes: lanes, moves and gradient groups.

:func:`build_exec_plan` turns a :class:`~balanced_loader.spindle.wave_plan.WavePlan` into an
:class:`ExecPlan` (plain data, identical on every rank):

* **Lanes.** An entry's samples are split over its lanes by ``batch_shards``; a lane's work is
  done by its first rank (tp index 0). Lanes with no sample (more lanes than samples) are left out.
* **Moves.** Before wave ``k`` every entry's input comes from the lanes of the MetaOp's previous
  entry (re-sharding when ranks or lane counts change) or, for its first entry, from the last
  entries of its predecessors (several predecessors are summed). A :class:`Move` is one range of
  samples going from one rank to another (or staying on its rank); tags are unique in a step.
* **Gradient groups.** Each parameter's gradient is summed over the union of the ranks that ran it:
  one group per distinct union, sorted, so every rank creates them in one order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from balanced_loader.spindle.wave_plan import batch_shards
from parallel_runtime.spindle.model import OpSpec, block_names, head_names, op_specs, sinks

if TYPE_CHECKING:
    from balanced_loader.spindle.graph import Graph
    from balanced_loader.spindle.wave_plan import WavePlan

EntryKey = tuple[int, int]  # (wave, index of the entry in the wave)


@dataclass(frozen=True, kw_only=True, slots=True)
class Lane:
    """One lane of an entry: the samples it runs and the rank that runs them."""

    rank: int  # the rank that does the lane's work (its tp index 0)
    start: int
    stop: int  # samples [start, stop) of the MetaOp's batch


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One MetaOp's layers ``[first_layer, first_layer + layers)`` in one wave, over its lanes."""

    key: EntryKey
    op: str
    first_layer: int
    layers: int
    batch: int  # the MetaOp's global batch
    lanes: tuple[Lane, ...]  # [lanes with samples]
    sources: tuple[EntryKey, ...]  # the entries whose outputs are its input (summed); () for synthetic input
    loss: bool  # the last entry of a sink MetaOp: ends in its head and loss

    def lane_of(self, rank: int) -> Lane | None:
        return next((ln for ln in self.lanes if ln.rank == rank), None)

    def my_lane(self, rank: int) -> Lane:
        """``rank``'s lane (the caller knows ``rank`` runs this entry)."""
        lane = self.lane_of(rank)
        assert lane is not None, f"rank {rank} has no lane in entry {self.key}"
        return lane


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    """Samples ``[start, stop)`` of an entry's output going from ``src`` to ``dst`` (an entry's input)."""

    tag: int  # unique in the step (the backward reply uses tag + num_moves)
    src_entry: EntryKey
    dst_entry: EntryKey
    src: int
    dst: int
    start: int
    stop: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecPlan:
    """What every rank executes for one wave plan (identical on every rank)."""

    world_size: int
    waves: tuple[tuple[Entry, ...], ...]  # [num_waves][entries]
    moves: tuple[tuple[Move, ...], ...]  # [num_waves] moves into the entries of that wave
    grad_groups: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]  # [groups] (union ranks, parameter names)
    planned_ms: tuple[float, ...]  # [num_waves]

    @property
    def num_moves(self) -> int:
        return sum(len(m) for m in self.moves)

    def moved_samples(self) -> int:
        """Samples whose activations change rank (re-sharding and hand-over), per step."""
        return sum(m.stop - m.start for ms in self.moves for m in ms if m.src != m.dst)

    def group_of(self, name: str) -> tuple[int, ...]:
        return next(ranks for ranks, names in self.grad_groups if name in names)

    def entry(self, key: EntryKey) -> Entry:
        return self.waves[key[0]][key[1]]


def build_exec_plan(graph: Graph, plan: WavePlan) -> ExecPlan:
    """Lanes, moves and gradient groups of ``plan`` (validated against ``graph``)."""
    if graph.gpus != plan.gpus:
        graph = graph.with_gpus(plan.gpus)
    plan.validate(graph)
    specs = op_specs(graph)
    ops = {op.name: op for op in specs}
    sink_set = set(sinks(specs))
    last: dict[str, EntryKey] = {}  # MetaOp -> its latest entry so far
    entries: dict[EntryKey, Entry] = {}
    waves: list[tuple[Entry, ...]] = []
    moves: list[tuple[Move, ...]] = []
    tag = 0
    for k, w in enumerate(plan.waves):
        wave_entries, wave_moves = [], []
        for i, wo in enumerate(w.ops):
            op = ops[wo.op]
            shards = batch_shards(op.batch, wo.num_lanes)
            lanes = tuple(Lane(rank=ranks[0], start=a, stop=b) for ranks, (a, b) in zip(wo.lanes(), shards) if b > a)
            if wo.first_layer > 0:
                sources: tuple[EntryKey, ...] = (last[wo.op],)
            else:
                sources = tuple(last[a] for a in op.after)
            done = wo.first_layer + wo.layers == op.layers
            e = Entry(key=(k, i), op=wo.op, first_layer=wo.first_layer, layers=wo.layers, batch=op.batch,
                      lanes=lanes, sources=sources, loss=done and wo.op in sink_set)
            # one move per overlap of a source lane's samples with a destination lane's samples: a
            # re-shard from m source lanes to n destination lanes is at most m + n - 1 moves
            for s in sources:
                for src in entries[s].lanes:
                    for dst in lanes:
                        a, b = max(src.start, dst.start), min(src.stop, dst.stop)
                        if b > a:
                            wave_moves.append(Move(tag=tag, src_entry=s, dst_entry=e.key, src=src.rank,
                                                   dst=dst.rank, start=a, stop=b))
                            tag += 1
            entries[e.key] = e
            last[wo.op] = e.key
            wave_entries.append(e)
        waves.append(tuple(wave_entries))
        moves.append(tuple(wave_moves))
    return ExecPlan(world_size=plan.gpus, waves=tuple(waves), moves=tuple(moves),
                    grad_groups=grad_groups(entries.values(), ops), planned_ms=tuple(w.ms for w in plan.waves))


def grad_groups(entries: Iterable[Entry], ops: Mapping[str, OpSpec]
                ) -> tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]:
    """``(ranks, parameter names)`` per distinct set of ranks that ran a parameter, sorted by (size, ranks)."""
    ran: dict[str, set[int]] = {}
    for e in entries:
        names = [n for layer in range(e.first_layer, e.first_layer + e.layers)
                 for n in block_names(ops[e.op].module, layer)]
        if e.loss:
            names += head_names(e.op)
        for n in names:
            ran.setdefault(n, set()).update(ln.rank for ln in e.lanes)
    by_union: dict[tuple[int, ...], list[str]] = {}
    for n, ranks in ran.items():
        by_union.setdefault(tuple(sorted(ranks)), []).append(n)
    return tuple((ranks, tuple(by_union[ranks])) for ranks in sorted(by_union, key=lambda r: (len(r), r)))
