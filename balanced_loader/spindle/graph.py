"""The multi-task graph file (strict YAML): one entry per MetaOp, a chain of identical layers of one task.

```yaml
gpus: 8
gpus_per_node: 8
counts: divisors            # optional: divisors (default) | aligned
hardware: a800              # optional default for MetaOps given by model shape
metaops:
  - {name: A-vis, task: A, layers: 4, batch: 32, alpha_ms: 1.0, beta_ms: 1.0, after: []}
  - {name: A-bb, task: A, layers: 8, batch: 32, alpha_ms: 0.5, beta_ms: 0.125, after: [A-vis], module: backbone}
  - {name: T-bb, task: T, layers: 32, model: llama2-7b, seq_len: 1024, batch: 16, after: []}
```

A MetaOp gives either ``alpha_ms``/``beta_ms``/``batch`` (per-layer time
``alpha_ms + beta_ms * ceil(batch / n)`` on ``n`` devices) or a ``model`` (a name in
``balanced_loader.presets.MODELS`` or a mapping ``{hidden, heads, kv_heads, ffn}``) with
``tokens`` (the docs' token counts) or ``seq_len`` and ``batch`` (see :mod:`.scaling`).
Optional keys: ``after`` (MetaOps whose every layer must run first), ``module`` (parameter
sharing id, default the name), ``min_gpus`` (memory floor, default 1), ``hardware``.

Allowed device counts are node aligned (a divisor of ``gpus_per_node`` or a multiple of it,
up to ``gpus``), at least ``min_gpus``, with a finite time; ``counts: divisors`` (Spindle's
default rule) also keeps only divisors of ``batch`` for alpha-beta MetaOps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from balanced_loader.spindle.scaling import AlphaBeta, ShapeScaling, shape_scaling
from balanced_loader.strict import number

_TOP_KEYS = {"gpus", "gpus_per_node", "metaops", "counts", "hardware"}
_OP_KEYS = {"name", "task", "layers", "after", "module", "min_gpus", "batch", "alpha_ms", "beta_ms",
            "model", "hardware", "seq_len", "tokens"}
_SHAPE_KEYS = {"hidden", "heads", "kv_heads", "ffn"}
COUNT_RULES = ("divisors", "aligned")
MAX_GPUS = 1 << 20  # devices of a graph (as --gpus and a plan file's world size): planning time grows with them
MAX_BATCH = 1 << 30  # samples of a MetaOp's step
MAX_MS = 1e9  # alpha_ms / beta_ms: the wave LP needs times within a few dozen orders of magnitude of each other
MIN_LAYER_MS = 1e-6  # a layer that takes no time has an infinite rate: the wave LP cannot be solved


@dataclass(frozen=True, kw_only=True, slots=True)
class MetaOp:
    """A chain of ``layers`` identical layers of one task; it can be cut at layer boundaries."""

    name: str
    task: str
    layers: int
    batch: int  # docs (samples) in the step
    after: tuple[str, ...]
    module: str
    min_gpus: int
    scaling: AlphaBeta | ShapeScaling
    counts: tuple[int, ...]  # allowed device counts, ascending

    def layer_ms(self, n: int) -> float:
        """Time of one layer on ``n`` devices."""
        return self.scaling.layer_ms(n)

    def ms(self, n: int) -> float:
        """Time of all layers on ``n`` devices."""
        return self.layers * self.scaling.layer_ms(n)

    def best_count(self, n: int) -> int:
        """Largest allowed count <= ``n`` (0 if none)."""
        best = 0
        for c in self.counts:
            if c <= n:
                best = c
        return best


@dataclass(frozen=True, kw_only=True, slots=True)
class Graph:
    gpus: int
    gpus_per_node: int  # node size used for alignment (at most gpus)
    metaops: tuple[MetaOp, ...]
    raw: dict[str, Any] = field(repr=False, compare=False)  # the validated file mapping

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(op.name for op in self.metaops)

    @property
    def tasks(self) -> tuple[str, ...]:
        """Task names in order of first appearance."""
        return tuple(dict.fromkeys(op.task for op in self.metaops))

    def index(self, name: str) -> int:
        for i, op in enumerate(self.metaops):
            if op.name == name:
                return i
        raise ValueError(f"unknown MetaOp '{name}'")

    def predecessors(self, i: int) -> list[int]:
        return [self.index(a) for a in self.metaops[i].after]

    def frontiers(self) -> list[list[int]]:
        """Ready sets: the MetaOps of in-degree 0 in the remaining graph, repeatedly (graph order inside)."""
        done: set[str] = set()
        left = list(range(len(self.metaops)))
        out: list[list[int]] = []
        while left:
            ready = [i for i in left if all(a in done for a in self.metaops[i].after)]
            assert ready, "cycles are rejected when the graph is loaded"
            out.append(ready)
            done.update(self.metaops[i].name for i in ready)
            left = [i for i in left if i not in set(ready)]
        return out

    def with_gpus(self, gpus: int) -> Graph:
        """The same graph planned for ``gpus`` devices."""
        return graph_from_dict({**self.raw, "gpus": gpus}, where="graph")

    def with_workloads(self, workloads: Mapping[str, Sequence[int] | np.ndarray]) -> Graph:
        """This step's docs per task (token counts from the loader).

        MetaOps given by model shape take the counts as ``tokens``; alpha-beta MetaOps take the
        number of docs as ``batch``.
        """
        unknown = sorted(set(workloads) - set(self.tasks))
        if unknown:
            raise ValueError(f"workload for unknown task(s) {unknown}; tasks: {', '.join(self.tasks)}")
        ops = []
        for op in self.raw["metaops"]:
            op = dict(op)
            if op["task"] in workloads:
                lengths = [int(x) for x in np.asarray(workloads[op["task"]]).reshape(-1)]
                if not lengths:
                    raise ValueError(f"workload of task '{op['task']}' is empty")
                if "model" in op:
                    op.pop("seq_len", None)
                    op.pop("batch", None)
                    op["tokens"] = lengths
                else:
                    op["batch"] = len(lengths)
            ops.append(op)
        return graph_from_dict({**self.raw, "metaops": ops}, where="graph")


# ---------------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------------


def load_graph(path: str) -> Graph:
    """Read and validate a graph file; every problem is one ``ValueError`` line."""
    from balanced_loader.strict import read_yaml

    data = read_yaml(path, "graph file", mapping=True)
    return graph_from_dict(data, where=f"graph file {path}")


def _float(d: Mapping[str, Any], key: str, where: str) -> float:
    if key not in d:
        raise ValueError(f"{where}: missing key '{key}'")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= MAX_MS:
        raise ValueError(f"{where}: '{key}' must be a number in [0, {MAX_MS:g}] (ms), got {v!r}")
    return float(v)


def _str(d: Mapping[str, Any], key: str, where: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not v:
        raise ValueError(f"{where}: '{key}' must be a non-empty string, got {v!r}")
    return v


def _aligned(n: int, node: int) -> bool:
    return node % n == 0 or n % node == 0


def graph_from_dict(data: Any, where: str = "graph") -> Graph:
    """Validate a graph mapping (see the module docstring) and build the :class:`Graph`."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping with keys gpus, metaops")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    gpus = number(data, "gpus", where, integer=True, minimum=1, maximum=MAX_GPUS)
    node = min(number(data, "gpus_per_node", where, default=8, integer=True, minimum=1), gpus)
    if gpus % node:
        raise ValueError(f"{where}: gpus {gpus} is not a multiple of gpus_per_node {node}")
    rule = data.get("counts", "divisors")
    if rule not in COUNT_RULES:
        raise ValueError(f"{where}: 'counts' must be one of {', '.join(COUNT_RULES)}, got {rule!r}")
    hardware = data.get("hardware")
    if hardware is not None:
        from balanced_loader.presets import HARDWARE

        if hardware not in HARDWARE:
            raise ValueError(f"{where}: unknown hardware {hardware!r}; known: {', '.join(sorted(HARDWARE))}")
    raw_ops = data.get("metaops")
    if not isinstance(raw_ops, list) or not raw_ops:
        raise ValueError(f"{where}: 'metaops' must be a non-empty list of MetaOp mappings")

    names: list[str] = []
    for k, d in enumerate(raw_ops):
        if not isinstance(d, dict):
            raise ValueError(f"{where}: metaops[{k}] must be a mapping, got {d!r}")
        name = _str(d, "name", f"{where}: metaops[{k}]")
        if name in names:
            raise ValueError(f"{where}: MetaOp '{name}' is listed twice")
        names.append(name)
    known = set(names)
    ops: list[MetaOp] = []
    for d in raw_ops:
        ops.append(_metaop(d, f"{where}: MetaOp '{d['name']}'", known=known, gpus=gpus, node=node, rule=rule,
                           hardware=hardware))
    _check_acyclic(ops, where)
    raw = {**data, "gpus": gpus, "counts": rule}
    return Graph(gpus=gpus, gpus_per_node=node, metaops=tuple(ops), raw=raw)


def _metaop(d: dict[str, Any], where: str, *, known: set[str], gpus: int, node: int, rule: str,
            hardware: Any) -> MetaOp:
    unknown = set(d) - _OP_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_OP_KEYS)}")
    name = d["name"]
    task = _str(d, "task", where)
    layers = number(d, "layers", where, minimum=0, integer=True)
    if layers == 0:
        raise ValueError(f"{where}: 'layers' is 0; a MetaOp needs at least one layer")
    after = d.get("after", [])
    if not isinstance(after, list) or not all(isinstance(a, str) for a in after):
        raise ValueError(f"{where}: 'after' must be a list of MetaOp names, got {after!r}")
    for a in after:
        if a not in known:
            raise ValueError(f"{where}: 'after' names unknown MetaOp '{a}'")
    if len(set(after)) != len(after):
        raise ValueError(f"{where}: 'after' lists a MetaOp twice: {after}")
    module = _str(d, "module", where) if "module" in d else name
    min_gpus = number(d, "min_gpus", where, default=1, integer=True, minimum=1)
    if min_gpus > gpus:
        raise ValueError(f"{where}: needs at least {min_gpus} devices (min_gpus) but only {gpus} exist")

    ab_keys = {"alpha_ms", "beta_ms"} & set(d)
    if "model" in d:
        if ab_keys:
            raise ValueError(f"{where}: give either alpha_ms/beta_ms or model, not both")
        scaling, batch = _shape_op(d, where, layers=layers, gpus=gpus, node=node, hardware=hardware)
        divisible_by = 0
    else:
        if ab_keys != {"alpha_ms", "beta_ms"}:
            raise ValueError(f"{where}: give alpha_ms, beta_ms and batch, or a model shape")
        for k in ("seq_len", "tokens", "hardware"):
            if k in d:
                raise ValueError(f"{where}: '{k}' only applies to a MetaOp given by model shape")
        batch = number(d, "batch", where, integer=True, minimum=1, maximum=MAX_BATCH)
        alpha, beta = _float(d, "alpha_ms", where), _float(d, "beta_ms", where)
        if alpha + beta < MIN_LAYER_MS:
            raise ValueError(f"{where}: alpha_ms + beta_ms is {alpha + beta:g}; a layer must take some time "
                             f"(at least {MIN_LAYER_MS:g} ms on one device)")
        scaling = AlphaBeta(alpha_ms=alpha, beta_ms=beta, batch=batch)
        divisible_by = batch if rule == "divisors" else 0

    counts = tuple(n for n in range(min_gpus, gpus + 1)
                   if _aligned(n, node) and (not divisible_by or divisible_by % n == 0)
                   and math.isfinite(scaling.layer_ms(n)))
    if not counts:
        if not math.isfinite(scaling.layer_ms(gpus)):
            raise ValueError(f"{where}: needs more devices than exist (its layers do not fit in memory "
                             f"on {gpus} devices)")
        rule_text = f", dividing batch {divisible_by}" if divisible_by else ""
        raise ValueError(f"{where}: no allowed device count (node-aligned to {node}, >= min_gpus {min_gpus}"
                         f"{rule_text}, <= gpus {gpus})")
    return MetaOp(name=name, task=task, layers=layers, batch=batch, after=tuple(after), module=module,
                  min_gpus=min_gpus, scaling=scaling, counts=counts)


def _shape_op(d: dict[str, Any], where: str, *, layers: int, gpus: int, node: int,
              hardware: Any) -> tuple[ShapeScaling, int]:
    from balanced_loader.presets import HARDWARE, MODELS

    m = d["model"]
    if isinstance(m, str):
        if m not in MODELS:
            raise ValueError(f"{where}: unknown model '{m}'; known: {', '.join(sorted(MODELS))}, "
                             f"or a mapping {{hidden, heads, kv_heads, ffn}}")
        shape = MODELS[m]
        hidden, heads, kv_heads, ffn = shape.hidden, shape.heads, shape.kv_heads, shape.ffn
    elif isinstance(m, dict):
        bad = set(m) - _SHAPE_KEYS
        if bad:
            raise ValueError(f"{where}: model: unknown key(s) {sorted(bad)}; allowed: {sorted(_SHAPE_KEYS)}")
        hidden, heads, kv_heads, ffn = (number(m, k, f"{where}: model", integer=True, minimum=1)
                                        for k in ("hidden", "heads", "kv_heads", "ffn"))
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"{where}: model: hidden must be a multiple of heads, heads of kv_heads")
    else:
        raise ValueError(f"{where}: 'model' must be a model name or a mapping, got {m!r}")
    hw = d.get("hardware", hardware)
    if hw is None:
        raise ValueError(f"{where}: a MetaOp given by model shape needs 'hardware' (here or at the top)")
    if hw not in HARDWARE:
        raise ValueError(f"{where}: unknown hardware {hw!r}; known: {', '.join(sorted(HARDWARE))}")
    if "tokens" in d:
        if "seq_len" in d or "batch" in d:
            raise ValueError(f"{where}: give either tokens or seq_len and batch")
        tokens = d["tokens"]
        if (not isinstance(tokens, list) or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tokens)):
            raise ValueError(f"{where}: 'tokens' must be a non-empty list of positive integers")
        arr = np.asarray(tokens, dtype=np.int64)  # [batch]
    else:
        seq_len = number(d, "seq_len", where, integer=True, minimum=1)
        arr = np.full(number(d, "batch", where, integer=True, minimum=1), seq_len, dtype=np.int64)  # [batch]
    scaling = shape_scaling(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, layers=layers, tokens=arr,
                            hardware=hw, max_gpus=gpus, gpus_per_node=node, world_size=gpus)
    return scaling, int(arr.size)


def _check_acyclic(ops: list[MetaOp], where: str) -> None:
    """Name one MetaOp on a dependency cycle, with the cycle."""
    after = {op.name: op.after for op in ops}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in after:
        if root in state:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = [root]
        state[root] = 1
        while stack:
            node, k = stack[-1]
            if k < len(after[node]):
                stack[-1] = (node, k + 1)
                nxt = after[node][k]
                if state.get(nxt) == 1:
                    cyc = path[path.index(nxt):] + [nxt]
                    raise ValueError(f"{where}: MetaOp '{nxt}' is on a dependency cycle: "
                                     f"{' -> '.join(reversed(cyc))}")
                if nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, 0))
                    path.append(nxt)
            else:
                state[node] = 2
                stack.pop()
                path.pop()
