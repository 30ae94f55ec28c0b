"""The estimate's figures and its printed table (:mod:`parallel_runtime.diagnostics.estimate`).

Per role (from its representative's measured step): memory by kind against the presets formula, bytes and
calls per collective kind and group against the cost model's communication terms, the optimizer's
exchange (collectives and per-peer message sizes), host reads and device synchronizes; per rank: its
peak scaled from its role to its own tokens in flight, with the reserve for its communicators.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from balanced_loader.presets import RESERVE, ModelShape, activation_bytes_per_token, cp_bytes_per_token
from parallel_runtime.topology import Topology

GIB = 2**30


def categorize(op, rank: int, topo: Topology) -> str:
    """What an op of ``rank`` is for: ``tp``, ``pipeline``, ``cp`` (inside forward/backward, on any other group:
    a CP group of the world's size is the world group), ``exchange`` (the optimizer's buckets) or ``world``."""
    if op.comm == "exchange":
        return "exchange"
    if op.kind in ("send", "recv") and set(op.group) == set(topo.pipeline_ranks(rank)):
        return "pipeline"
    if op.phase == "forward_backward":
        return "tp" if tuple(sorted(op.group)) == tuple(sorted(topo.tp_ranks(rank))) else "cp"
    if op.kind == "all_to_all" and op.phase in ("pull", "push"):
        return "exchange"
    return "world"


def comm_table(ops: list, rank: int, topo: Topology) -> list[dict[str, Any]]:
    """Bytes and calls by (category, kind, group size) of one step's ops of one rank."""
    rows: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for op in ops:
        k = (categorize(op, rank, topo), op.kind, len(op.group))
        rows[k][0] += 1
        rows[k][1] += op.nbytes
    return [{"what": a, "kind": b, "group": g, "calls": c, "bytes": n} for (a, b, g), (c, n) in sorted(rows.items())]


def exchange_messages(ops: list) -> dict[str, Any]:
    """The optimizer's buckets in one step: collectives, bytes, and the per-peer message sizes."""
    ex = [op for op in ops if op.kind == "all_to_all" and (op.comm == "exchange" or op.phase in ("pull", "push"))]
    peers = [b for op in ex for b in op.splits if b > 0]
    return {"collectives": len(ex), "bytes_sent": int(sum(op.nbytes for op in ex)),
            "per_peer_median": int(np.median(peers)) if peers else 0, "per_peer_min": int(min(peers, default=0)),
            "per_peer_max": int(max(peers, default=0))}


def shape_of(cfg) -> ModelShape:
    return ModelShape(hidden=cfg.hidden, layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                      ffn=cfg.ffn_hidden, vocab=cfg.vocab_size, tied=cfg.tie_embeddings)


def role_report(ctx: Any, role: Any, run: Any, places: list[list[Any]]) -> dict[str, Any]:
    """One role's figures from its representative's measured (second) step (the estimate's ``Context``,
    ``Role``, ``RankRun`` and ``places[step][rank]`` of ``Place``)."""
    from parallel_runtime.engines.pipeline import stage_layers

    recipe = ctx.recipe
    cfg, cost = recipe.model, recipe.cost_model()
    fig = run.steps[-1]
    place = places[role.step][role.rep]
    topo = ctx.topos[role.step]
    itemsize = 2 if recipe.train.dtype in ("bfloat16", "float16") else 4
    layers = len(stage_layers(cfg.num_layers, place.pp, place.stage))
    per_token = activation_bytes_per_token(shape_of(cfg), layers=layers, tp=place.tp, itemsize=itemsize,
                                           ends=place.stage == place.pp - 1)
    formula = per_token * place.in_flight
    measured = fig.kind_peaks.get("activations", 0)
    comm = comm_table(fig.ops, role.rep, topo)
    # the cost model's terms: CP traffic per token of a segment in a group of d lanes, divided by d
    # (contract 2; the Ulysses term), and per engine (presets.cp_bytes_per_token, on the tokens a lane
    # holds); TP: 4 all-reduces of hidden values per token per layer (presets.analytic_cost)
    plan = ctx.plans[role.step]
    inner_of = recipe.loader_cp_inner()
    work = [w for w in topo.lane_work(role.rep, plan) if w is not None and w.group.degree > 1]
    cp_tokens = sum(sum(s[2] for s in w.group.segments) / w.group.degree for w in work)
    engines = sum(cp_bytes_per_token(shape_of(cfg), degree=w.group.degree, inner=math.gcd(inner_of, w.group.degree),
                                     tp=place.tp, itemsize=itemsize, layers=layers) * place.tokens[w.microbatch]
                  for w in work)
    cp_measured = sum(r["bytes"] for r in comm if r["what"] == "cp" and r["kind"] in ("all_to_all", "send"))
    tp_tokens = sum(place.tokens.values())
    tp_measured = sum(r["bytes"] for r in comm if r["what"] == "tp" and r["kind"] == "all_reduce")
    checks = {"cp": {"measured": int(cp_measured), "cost_model": int(cost.comm_bytes_per_token * cp_tokens)},
              "cp_engines": {"measured": int(cp_measured), "cost_model": int(engines)},
              "tp": {"measured": int(tp_measured),
                     "cost_model": int(4 * layers * cfg.hidden * itemsize * tp_tokens) if place.tp > 1 else 0}}
    for c in checks.values():
        c["ratio"] = round(c["measured"] / c["cost_model"], 4) if c["cost_model"] else None
    fixed = sum(fig.parts.get(k, 0) for k in ("parameters", "gradients", "optimizer", "buckets"))
    return {"role": role.name, "ranks": list(role.ranks), "rep": role.rep, "step": role.step,
            "microbatches": len(place.tokens), "in_flight_tokens": place.in_flight, "peak_bytes": fig.peak,
            "fixed_bytes": fixed, "parts": fig.parts, "kind_peaks": fig.kind_peaks,
            "activations": {"measured": measured, "formula": int(formula),
                            "ratio": round(measured / formula, 4) if formula else None},
            "comm": comm, "comm_checks": checks, "exchange": exchange_messages(fig.ops),
            "host_reads": fig.host_reads, "device_syncs": fig.syncs, "cpu_s": round(run.cpu_s, 1)}


def rank_memory(roles: list[dict], places: list[list[Any]], comms: dict[int, int], device_gib: float) -> list[dict]:
    """Every rank's peak: its role's fixed bytes plus the role's token-proportional bytes at its own tokens in
    flight, and the reserve for its communicators."""
    out = []
    for role in roles:
        variable = role["peak_bytes"] - role["fixed_bytes"]
        for r in role["ranks"]:
            tokens = max(p[r].in_flight for p in places)
            peak = role["fixed_bytes"] + (variable * tokens / role["in_flight_tokens"] if role["in_flight_tokens"]
                                          else variable)
            reserve = RESERVE.bytes(device_gib, comms.get(r))
            out.append({"rank": r, "role": role["role"], "in_flight_tokens": tokens, "peak_bytes": int(peak),
                        "reserve_bytes": int(reserve), "communicators": comms.get(r),
                        "fits": peak + reserve <= device_gib * GIB})
    return sorted(out, key=lambda x: x["rank"])


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def format_table(rep: dict[str, Any]) -> str:
    """The printed report: roles and memory by kind, bytes per collective, exchange, host syncs, replay."""
    g = rep["device_gib"]
    lines = [f"estimate of {rep['recipe']}: {rep['steps']} steps planned, {rep['world_size']} ranks, device {g} GiB, "
             f"reserve {RESERVE.context_gib} GiB context + {RESERVE.nccl_gib_per_communicator} GiB per NCCL "
             f"communicator + {RESERVE.slack:.0%} slack",
             "",
             "| role | ranks | tokens in flight | params | grads | optimizer | buckets | activations | attention | "
             "temporaries | peak GiB | + reserve | fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    per_rank = {r["rank"]: r for r in rep["ranks"]}
    for ro in rep["roles"]:
        p = ro["parts"]
        worst = max((per_rank[r] for r in ro["ranks"]), key=lambda x: x["peak_bytes"] + x["reserve_bytes"])
        ranks = ro["ranks"]
        rtxt = f"{ranks[0]}-{ranks[-1]} ({len(ranks)})" if len(ranks) > 2 else ",".join(map(str, ranks))
        lines.append(f"| {ro['role']} | {rtxt} | {ro['in_flight_tokens']:,} | " + " | ".join(
            _gib(p.get(k, 0)) for k in ("parameters", "gradients", "optimizer", "buckets", "activations",
                                        "attention", "temporaries"))
            + f" | {_gib(ro['peak_bytes'])} | {_gib(worst['peak_bytes'] + worst['reserve_bytes'])} | "
            f"{'yes' if all(per_rank[r]['fits'] for r in ranks) else 'NO'} |")
    lines += ["", "| role | activations measured / formula | CP bytes / cost file (/ per engine) | "
              "TP bytes / cost model | exchange all-to-alls (per-peer median) | host reads in fwd/bwd, other | syncs "
              "| cpu s |",
              "|---|---|---|---|---|---|---|---|"]
    for ro in rep["roles"]:
        a, c = ro["activations"], ro["comm_checks"]
        ex, hr = ro["exchange"], ro["host_reads"]
        lines.append(f"| {ro['role']} | {_r(a['ratio'])} | {_r(c['cp']['ratio'])} ({_r(c['cp_engines']['ratio'])}) | "
                     f"{_r(c['tp']['ratio'])} | "
                     f"{ex['collectives']} ({ex['per_peer_median'] / 1024:.0f} KiB) | "
                     f"{hr.get('forward_backward', 0)}, {sum(v for k, v in hr.items() if k != 'forward_backward')} "
                     f"| {ro['device_syncs']} | {ro['cpu_s']} |")
    lines += ["", "bytes per collective, first role's measured step:", "| what | kind | group | calls | MiB |",
              "|---|---|---|---|---|"]
    for row in rep["roles"][0]["comm"] if rep["roles"] else []:
        lines.append(f"| {row['what']} | {row['kind']} | {row['group']} | {row['calls']} | "
                     f"{row['bytes'] / 2**20:.1f} |")
    over = [r for r in rep["ranks"] if not r["fits"]]
    lines.append("")
    lines.append(f"over the device: ranks {[r['rank'] for r in over]}" if over else
                 f"every rank fits in {g} GiB less its reserve")
    if rep.get("replay") is not None:
        lines.append(rep["replay"]["summary"])
    return "\n".join(lines)


