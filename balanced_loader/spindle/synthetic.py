"""Seeded multi-task graphs for benchmarks and tests (graph-file mappings, see :mod:`.graph`).

:func:`random_graph` draws small graphs of random shapes (the search tests and the gap report).

Each task has ``encoders`` modality encoders feeding a shared backbone, then a head:
``{task}-enc{k} -> {task}-bb -> {task}-head``. Alpha-beta coefficients follow the recipes'
derivation (``beta = (72 s h^2 + 12 s^2 h) / 156 TFLOP/s`` per sample and layer) with random
sequence lengths, widths and batch sizes, so tasks differ in workload and scalability.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _beta_ms(s: float, h: float) -> float:
    return (72 * s * h * h + 12 * s * s * h) / 156e12 * 1e3


def multitask_graph(seed: int, *, tasks: int = 16, encoders: int = 2, gpus: int = 1024, gpus_per_node: int = 8,
                    head: bool = True) -> dict[str, Any]:
    """A graph mapping with ``tasks * (encoders + 1 + head)`` MetaOps."""
    rng = np.random.default_rng(seed)
    ops: list[dict[str, Any]] = []
    for t in range(tasks):
        name = f"t{t}"
        batch = int(2 ** rng.integers(4, 11)) * int(rng.choice([1, 1, 3]))  # 16 .. 3072 docs
        encs = []
        for k in range(encoders):
            s, h = float(rng.choice([77, 257, 576, 1500])), float(rng.choice([768, 1024, 1280]))
            encs.append(f"{name}-enc{k}")
            ops.append({"name": encs[-1], "task": name, "layers": int(rng.choice([12, 24, 32])), "batch": batch,
                        "alpha_ms": round(float(rng.uniform(0.2, 0.8)), 3), "beta_ms": round(_beta_ms(s, h), 4),
                        "after": []})
        s = float(rng.integers(256, 4096))
        ops.append({"name": f"{name}-bb", "task": name, "layers": 32, "batch": batch,
                    "alpha_ms": round(float(rng.uniform(2.0, 6.0)), 3), "beta_ms": round(_beta_ms(s, 4096), 4),
                    "after": encs, "module": "backbone"})
        if head:
            ops.append({"name": f"{name}-head", "task": name, "layers": int(rng.choice([1, 2, 4])), "batch": batch,
                        "alpha_ms": round(float(rng.uniform(0.2, 1.0)), 3),
                        "beta_ms": round(_beta_ms(s, 4096) * float(rng.uniform(0.2, 1.0)), 4),
                        "after": [f"{name}-bb"]})
    return {"gpus": gpus, "gpus_per_node": gpus_per_node, "metaops": ops}


def random_graph(seed: int, *, max_tasks: int = 4, max_chain: int = 3,
                 gpus: tuple[int, ...] = (4, 8, 16, 32)) -> dict[str, Any]:
    """A small seeded graph of a random family: 1..``max_tasks`` tasks, each a chain of
    1..``max_chain`` alpha-beta MetaOps (1-32 layers, batches 8-128, random alpha and beta),
    sometimes an edge across tasks; the device count, node size and count rule drawn too."""
    rng = np.random.default_rng(seed)
    n_gpus = int(rng.choice(gpus))
    node = min(n_gpus, int(rng.choice([4, 8])))
    ops: list[dict[str, Any]] = []
    for t in range(int(rng.integers(1, max_tasks + 1))):
        prev: list[str] = []
        for k in range(int(rng.integers(1, max_chain + 1))):
            name = f"t{t}-{k}"
            after = list(prev)
            if ops and rng.random() < 0.15:  # an edge from another task's MetaOp
                other = ops[int(rng.integers(len(ops)))]["name"]
                if not other.startswith(f"t{t}-"):
                    after.append(other)
            ops.append({"name": name, "task": f"t{t}", "layers": int(rng.choice([1, 2, 4, 6, 8, 12, 16, 24, 32])),
                        "batch": int(rng.choice([8, 16, 24, 32, 48, 64, 96, 128])),
                        "alpha_ms": round(float(rng.uniform(0.05, 2.0)), 3),
                        "beta_ms": round(float(rng.uniform(0.01, 1.0)), 3), "after": sorted(after)})
            prev = [name]
    return {"gpus": n_gpus, "gpus_per_node": node, "counts": str(rng.choice(["divisors", "aligned"])), "metaops": ops}
