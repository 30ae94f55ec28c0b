"""The wave plan (JSON ``balanced-loader/waves`` version 1): what a runtime executes.

```json
{"format": "balanced-loader/waves", "version": 1, "method": "spindle", "gpus": 8, "gpus_per_node": 8,
 "total_ms": 56.0, "lower_bound_ms": 56.0, "baselines": {"all": 73.5, "fixed_split": 72.0},
 "waves": [{"ms": 36.0, "frontier": 0, "ops": [
    {"op": "A-vis", "ranks": [0, 1, 2, 3], "layers": 4, "first_layer": 0, "ms": 36.0, "tp": 1, "dp": 4}]}]}
```

Semantics (checked by :meth:`WavePlan.validate`): waves run one after another; a wave lasts as
long as its slowest entry (``layers`` times the MetaOp's per-layer time on ``len(ranks)``
devices); ``total_ms`` is the sum of the waves; no rank is in two entries of one wave; a
MetaOp has at most one entry per wave and runs its layers in wave order (``first_layer`` is
the running count), exactly ``layers`` in total; it appears only after every MetaOp in its
``after`` list has run all its layers in earlier waves. Inside an entry the batch is data
parallel over ``dp`` lanes of ``tp`` consecutive ranks (:meth:`WaveOp.lanes`), lane ``l``
holding docs ``batch_shards(batch, dp)[l]``; alpha-beta MetaOps always have ``tp == 1``.
Waves carry the index of their frontier; a MetaOp's activations stay on its last ranks until
its next entry (or its successors' first entries) re-shard them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from balanced_loader.outputs.files import read_json

if TYPE_CHECKING:
    from balanced_loader.spindle.graph import Graph

WAVES_FORMAT = "balanced-loader/waves"
WAVES_VERSION = 1
METHODS = ("spindle", "all", "fixed_split")


def batch_shards(batch: int, n: int) -> list[tuple[int, int]]:
    """Contiguous, balanced split of ``batch`` docs over ``n`` ranks: ``[start, stop)`` per rank."""
    q, r = divmod(batch, n)
    out, s = [], 0
    for k in range(n):
        e = s + q + (1 if k < r else 0)
        out.append((s, e))
        s = e
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class WaveOp:
    """Layers ``[first_layer, first_layer + layers)`` of one MetaOp on ``ranks`` in one wave."""

    op: str
    ranks: tuple[int, ...]  # [n] contiguous; lane l is ranks[l * tp:(l + 1) * tp]
    first_layer: int
    layers: int
    ms: float  # layers * per-layer time on len(ranks) devices
    tp: int = 1  # tensor-parallel width of a lane
    dp: int = 0  # lanes (data parallel); 0: len(ranks) // tp. tp * dp < len(ranks) leaves ranks idle

    @property
    def num_lanes(self) -> int:
        return self.dp or len(self.ranks) // self.tp

    def lanes(self) -> list[tuple[int, ...]]:
        """The ``tp`` ranks of each lane; lane ``l`` holds shard ``l`` of :func:`batch_shards` over the lanes."""
        return [self.ranks[k * self.tp:(k + 1) * self.tp] for k in range(self.num_lanes)]

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "ranks": list(self.ranks), "layers": self.layers, "first_layer": self.first_layer,
                "ms": _r(self.ms), "tp": self.tp, "dp": self.num_lanes}

    @staticmethod
    def from_json(d: dict[str, Any]) -> WaveOp:
        return WaveOp(op=str(d["op"]), ranks=tuple(int(r) for r in d["ranks"]), first_layer=int(d["first_layer"]),
                      layers=int(d["layers"]), ms=float(d["ms"]), tp=int(d.get("tp", 1)), dp=int(d.get("dp", 0)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Wave:
    ms: float  # the slowest entry
    frontier: int  # index of the frontier (ready set) this wave belongs to
    ops: tuple[WaveOp, ...]  # [entries]

    def to_json(self) -> dict[str, Any]:
        return {"ms": _r(self.ms), "frontier": self.frontier, "ops": [o.to_json() for o in self.ops]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Wave:
        return Wave(ms=float(d["ms"]), frontier=int(d.get("frontier", 0)),
                    ops=tuple(WaveOp.from_json(o) for o in d["ops"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class WavePlan:
    method: str  # which plan won: spindle | all | fixed_split
    gpus: int
    gpus_per_node: int
    waves: tuple[Wave, ...]  # [num_waves] in execution order
    lower_bound_ms: float  # sum over frontiers of C* (frontier-synchronous plans; see planner.plan_waves)
    frontier_bounds_ms: tuple[float, ...]  # [num_frontiers] C* per frontier
    spindle_ms: float  # total of the wavefront plan (before keeping the best)
    all_ms: float  # baseline: every MetaOp on all devices in turn
    fixed_split_ms: float  # baseline: one fixed device split per task (inf if there are more tasks than devices)
    fixed_split: tuple[tuple[str, int], ...] = ()  # [tasks] (task, devices) of that baseline
    moved_samples: float = 0.0  # docs whose activations change rank between waves (see placement.py)
    plan_seconds: float = 0.0

    @property
    def total_ms(self) -> float:
        return sum(w.ms for w in self.waves)

    @property
    def gap(self) -> float:
        """Relative gap of the total to the continuous lower bound."""
        return self.total_ms / self.lower_bound_ms - 1.0 if self.lower_bound_ms > 0 else 0.0

    @property
    def baselines(self) -> dict[str, float]:
        return {"all": self.all_ms, "fixed_split": self.fixed_split_ms}

    # ---- JSON ----------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": WAVES_FORMAT, "version": WAVES_VERSION, "method": self.method,
            "gpus": self.gpus, "gpus_per_node": self.gpus_per_node,
            "total_ms": _r(self.total_ms), "lower_bound_ms": _r(self.lower_bound_ms), "gap": _r(self.gap),
            "baselines": {"all": _r(self.all_ms), "fixed_split": _r(self.fixed_split_ms)},
            "spindle_ms": _r(self.spindle_ms), "fixed_split": dict(self.fixed_split),
            "frontier_bounds_ms": [_r(x) for x in self.frontier_bounds_ms],
            "moved_samples": _r(self.moved_samples), "plan_seconds": round(self.plan_seconds, 6),
            "waves": [w.to_json() for w in self.waves],
        }

    def dumps(self) -> str:
        """JSON text with one line per key and per wave entry."""
        d = self.to_json()
        waves = d.pop("waves")
        lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in d.items()]
        body = []
        for w in waves:
            ops = ",\n".join(f"    {json.dumps(o)}" for o in w["ops"])
            body.append(f'  {{"ms": {json.dumps(w["ms"])}, "frontier": {w["frontier"]}, "ops": [\n{ops}]}}')
        return "{\n" + "\n".join(lines) + '\n "waves": [\n' + ",\n".join(body) + "\n ]\n}"

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.dumps() + "\n")

    @staticmethod
    def from_json(d: dict[str, Any]) -> WavePlan:
        if not isinstance(d, dict) or d.get("format") != WAVES_FORMAT:
            raise ValueError(f"not a wave plan: expected format '{WAVES_FORMAT}'")
        if d.get("version") != WAVES_VERSION:
            raise ValueError(f"wave plan version {d.get('version')!r} is not supported (want {WAVES_VERSION})")
        fs = d.get("baselines", {}).get("fixed_split")
        return WavePlan(
            method=str(d["method"]), gpus=int(d["gpus"]), gpus_per_node=int(d["gpus_per_node"]),
            waves=tuple(Wave.from_json(w) for w in d["waves"]), lower_bound_ms=float(d["lower_bound_ms"]),
            frontier_bounds_ms=tuple(float(x) for x in d.get("frontier_bounds_ms", ())),
            spindle_ms=float(d.get("spindle_ms", math.nan)), all_ms=float(d["baselines"]["all"]),
            fixed_split_ms=math.inf if fs is None else float(fs),
            fixed_split=tuple((str(k), int(v)) for k, v in d.get("fixed_split", {}).items()),
            moved_samples=float(d.get("moved_samples", 0.0)), plan_seconds=float(d.get("plan_seconds", 0.0)))

    @staticmethod
    def load(path: str) -> WavePlan:
        return WavePlan.from_json(read_json(path, "wave plan"))

    # ---- checks ----------------------------------------------------------
    def validate(self, graph: Graph, *, rel_tol: float = 1e-6) -> None:
        """Raise ValueError unless the plan has the semantics in the module docstring for ``graph``."""
        if graph.gpus != self.gpus:
            graph = graph.with_gpus(self.gpus)
        ops = {op.name: op for op in graph.metaops}
        done_layers = dict.fromkeys(ops, 0)
        finished_before: set[str] = set()  # MetaOps whose layers all ran in earlier waves
        for k, w in enumerate(self.waves):
            seen_ranks: set[int] = set()
            seen_ops: set[str] = set()
            slowest = 0.0
            for e in w.ops:
                where = f"wave {k}, MetaOp '{e.op}'"
                op = ops.get(e.op)
                if op is None:
                    raise ValueError(f"wave {k}: unknown MetaOp '{e.op}'")
                if e.op in seen_ops:
                    raise ValueError(f"{where}: appears twice in one wave")
                seen_ops.add(e.op)
                if not e.ranks or any(r < 0 or r >= self.gpus for r in e.ranks) or len(set(e.ranks)) != len(e.ranks):
                    raise ValueError(f"{where}: ranks {list(e.ranks)} are not distinct ranks in [0, {self.gpus})")
                if e.tp < 1 or e.num_lanes < 1 or e.tp * e.num_lanes > len(e.ranks):
                    raise ValueError(f"{where}: {e.num_lanes} lanes of tp {e.tp} do not fit on {len(e.ranks)} ranks")
                clash = seen_ranks & set(e.ranks)
                if clash:
                    raise ValueError(f"{where}: rank {min(clash)} is in two entries of the wave")
                seen_ranks.update(e.ranks)
                missing = [a for a in op.after if a not in finished_before]
                if missing:
                    raise ValueError(f"{where}: runs before '{missing[0]}' (in its after list) has finished")
                if e.layers < 1 or e.first_layer != done_layers[e.op]:
                    raise ValueError(f"{where}: layers [{e.first_layer}, +{e.layers}) do not continue at layer "
                                     f"{done_layers[e.op]}")
                done_layers[e.op] += e.layers
                if done_layers[e.op] > op.layers:
                    raise ValueError(f"{where}: runs {done_layers[e.op]} layers in total, the MetaOp has {op.layers}")
                want = e.layers * op.layer_ms(len(e.ranks))
                if not math.isclose(e.ms, want, rel_tol=rel_tol, abs_tol=1e-9):
                    raise ValueError(f"{where}: ms {e.ms} differs from {e.layers} layers x per-layer time on "
                                     f"{len(e.ranks)} devices = {want}")
                slowest = max(slowest, e.ms)
            if not math.isclose(w.ms, slowest, rel_tol=rel_tol, abs_tol=1e-9):
                raise ValueError(f"wave {k}: ms {w.ms} is not its slowest entry's {slowest}")
            finished_before.update(name for name, n in done_layers.items() if n == ops[name].layers)
        short = [name for name, n in done_layers.items() if n != ops[name].layers]
        if short:
            raise ValueError(f"MetaOp '{short[0]}' runs {done_layers[short[0]]} of its {ops[short[0]].layers} layers")


def _r(x: float) -> float | None:
    """Round for JSON (None for inf)."""
    return None if not math.isfinite(x) else round(float(x), 9)
