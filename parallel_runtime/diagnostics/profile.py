"""Calibrate the contract-2 cost file on this device.

Usage: ``python -m parallel_runtime profile --recipe R.yaml``.

Spawns the recipe's world (``world.size`` gloo processes, so cores are shared as in training)
and times the model's forward and backward exactly as the trainer measures it
(:func:`parallel_runtime.training.step.forward_backward`, real tokens of the recipe's source, the
recipe's attention kernel and CP engine). For every pool shape ``(tp, pp)`` of the recipe and
CP degree ``d``, each case is one microbatch run by every aligned block of ``d`` lanes at once;
its time is a lane's whole-model time (the sum over its stages), averaged over the lanes, the
median of ``--repeats`` rounds (each round runs every case once, in a new random order).

Fit, per shape, by calibration's fit (:func:`balanced_loader.calibration.fit.fit_shape`, the one
fitter of contract-2 coefficients) set to plain non-negative least squares on milliseconds (the long
microbatches that decide a step's time weigh the most; the cases are chosen, so there are no
outliers to drop and no prior to pull to), the cases as calibration :class:`Samples`:

* degree 1: ``t = microbatch_ms + quadratic_ms * sum(s^2) + linear_ms * sum(s)``;
* degree ``d > 1``: the residual after ``microbatch_ms + sum(q s^2 + l s) / d`` is
  ``c_d * sum(s) / d``, written as ``bandwidth_gbs[d] = comm_bytes_per_token / (c_d * 1e6)``
  (the CP engine's extra time per token; ``comm_bytes_per_token`` is the engine's bytes per
  token of the recipe's model, so the bandwidth is an effective one): calibration's fit of the
  one coefficient ``comm_bytes_per_token`` at 1 GB/s, the others held.

Training cases are single segments on a length grid and packs of equal segments (which
separate ``microbatch_ms`` from ``linear_ms``); held-out cases are groups drawn from the
recipe's own plans (what the trainer will run), which the fit never sees. The report gives
the median and p90 absolute relative error of the predicted microbatch times on each.
``max_tokens_per_lane`` is a memory setting, not a measurement: ``--cap TPxPP=N`` (default
``data.max_seq_len`` for every shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from balanced_loader.calibration.fit import FitSettings, fit_shape
from balanced_loader.calibration.samples import Samples, sample_rows
from balanced_loader.cost import CostModel, ShapeCost

DEFAULT_REPEATS = 3
COMPUTE_FIT = FitSettings(robust=False, min_samples=1)  # plain NNLS on ms (module docstring)
COMM_FIT = FitSettings(robust=False, min_samples=1, free=("comm_bytes_per_token",))  # beta, q, l held


@dataclass(frozen=True, kw_only=True)
class Case:
    """One timed microbatch: a pool shape, a CP degree and the segment lengths of one group."""

    tp: int
    pp: int
    degree: int
    lengths: tuple[int, ...]
    held_out: bool = False


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What every rank of the profiling world needs (picklable)."""

    recipe_path: str
    overrides: tuple[str, ...]
    cases: tuple[Case, ...]
    repeats: int
    seed: int


# ---- cases ----------------------------------------------------------------------------------


def make_cases(shapes: list[tuple[int, int]], degrees: dict[tuple[int, int], list[int]],
               caps: dict[tuple[int, int], int], *, min_len: int = 16, grid: int = 7,
               max_len: int | None = None) -> list[Case]:
    """Training cases per shape and degree: single segments on a geometric length grid up to
    ``cap * degree`` (and ``max_len``, the longest segment the data has; from a quarter of the top
    for ``degree > 1``) and packs of 2, 4, 8 equal segments."""
    out: list[Case] = []
    for tp, pp in shapes:
        cap = caps[(tp, pp)]
        for d in degrees[(tp, pp)]:
            top = cap * d if max_len is None else min(cap * d, max(max_len, cap))
            low = min_len if d == 1 else max(min_len, top // 4)
            lens = np.unique(np.geomspace(low, top, grid).astype(int))
            out += [Case(tp=tp, pp=pp, degree=d, lengths=(int(s),)) for s in lens]
            for k in (2, 4, 8):
                s = max(min_len, top // (2 * k))
                out.append(Case(tp=tp, pp=pp, degree=d, lengths=(s,) * k))
    return out


def plan_cases(recipe, count: int, profiled: set[tuple[int, int, int]], *, seed: int = 0,
               max_steps: int = 200) -> list[Case]:
    """Held-out cases: ``count`` groups drawn from the recipe's own plans (its policy and every
    ``policy.compare`` policy, first steps of its data), among the profiled (tp, pp, degree)."""
    from parallel_runtime.training.recipe_setup import open_data, recipe_loader

    source = open_data(recipe, build=True)
    found: list[Case] = []
    for policy in (recipe.policy.name, *recipe.policy.compare):
        loader = recipe_loader(recipe, source, policy, rank=0, prefetch_steps=0, epochs=1)
        for i, plan in enumerate(b.plan for b in loader):
            for pool in plan.pools:
                for mb in pool.microbatches:
                    for g in mb:
                        if (pool.tp, pool.pp, g.degree) in profiled:
                            found.append(Case(tp=pool.tp, pp=pool.pp, degree=g.degree,
                                              lengths=tuple(x[2] for x in g.segments), held_out=True))
            if i + 1 >= max_steps or len(found) >= 20 * count:
                break
        loader.close()
    if not found:
        return []
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(found), size=min(count, len(found)), replace=False)
    return [found[i] for i in sorted(pick)]


# ---- measuring ------------------------------------------------------------------------------


def _case_plan(case: Case, world: int, doc_of_len):
    """A plan with one pool of the case's shape over the world; every aligned block of ``degree``
    lanes runs the case's segments in microbatch 0."""
    from balanced_loader.plan import Group, Pool, StepPlan, single_pool_ranks

    lanes = world // (case.tp * case.pp)
    segs = tuple((doc_of_len(s), 0, s) for s in case.lengths)
    groups = tuple(Group(lanes=tuple(range(b * case.degree, (b + 1) * case.degree)), segments=segs)
                   for b in range(lanes // case.degree))
    pool = Pool(tp=case.tp, pp=case.pp, ranks=single_pool_ranks(world, case.tp, case.pp), microbatches=(groups,))
    return StepPlan(step=0, world_size=world, pools=(pool,))


def _rank_main(rank: int, world: int, setup: Setup) -> list[float] | None:
    """Time every case on this rank; rank 0 returns each case's lane time (ms)."""
    import torch
    import torch.distributed as dist

    from balanced_loader.materialize import materialize_rank
    from parallel_runtime.config import load_recipe
    from parallel_runtime.groups import GroupCache, declared_groups, plan_groups
    from parallel_runtime.topology import Topology
    from parallel_runtime.training.params import param_specs
    from parallel_runtime.training.recipe_setup import open_data_world, run_device
    from parallel_runtime.training.runtime import DTYPES, Runtime
    from parallel_runtime.training.step import forward_backward

    recipe = load_recipe(setup.recipe_path, list(setup.overrides))
    w = recipe.world
    device = run_device(w, rank)  # the profile's world is one machine: local rank = rank
    source = open_data_world(recipe, rank=rank, local_rank=rank)  # the profile's world is one machine
    order = np.argsort(source.lengths, kind="stable")
    sorted_len = np.asarray(source.lengths)[order]

    def doc_of_len(s: int) -> int:
        i = int(np.searchsorted(sorted_len, s))
        if i >= len(order):
            raise ValueError(f"the source has no doc of {s} tokens or more to profile with; lower --cap")
        return int(order[i])

    groups = GroupCache(rank=rank, backend=None if w.backend == "auto" else w.backend)
    shapes = sorted({(c.tp, c.pp) for c in setup.cases})
    groups.ensure(declared_groups([Topology.uniform(world, tp=tp, pp=pp) for tp, pp in shapes], w.cp_engine,
                                  w.cp_inner))
    rt = Runtime(recipe.model, rank=rank, device=device, dtype=DTYPES[recipe.train.dtype],
                 attention=recipe.train.attention, groups=groups, specs=param_specs(recipe.model))
    cp_inner = recipe.loader_cp_inner()
    prepared = []
    for case in setup.cases:
        plan = _case_plan(case, world, doc_of_len)
        topo = Topology.from_plan(plan)
        groups.ensure(plan_groups(plan, w.cp_engine, w.cp_inner))  # degrees beyond the declared powers of two
        prepared.append((plan, topo, rt.stage_model(topo), materialize_rank(plan, rank, source, cp_inner=cp_inner),
                         max(1, sum(max(s - 1, 0) for s in case.lengths))))
    for sm in {id(p[2]): p[2] for p in prepared}.values():
        sm.model.reset_parameters(setup.seed)

    def run(i: int) -> float:
        plan, topo, sm, mbs, valid = prepared[i]
        res = forward_backward(rt, sm, plan, topo, mbs, valid)
        for lp in sm.params:
            lp.tensor.grad = None
        return res.compute_ms

    warmed: set[tuple[int, int]] = set()
    for i, case in enumerate(setup.cases):  # the first run of each stage model and degree warms up
        key = (id(prepared[i][2]), case.degree)
        if key not in warmed:
            warmed.add(key)
            run(i)
    # rounds over all cases in a new random order each (the same on every rank): drift in the machine's
    # load and the state a previous microbatch leaves (allocator, caches) hit every case alike, as in
    # training where microbatches of all sizes follow each other; the median per case drops outliers
    runs = np.zeros((setup.repeats, len(prepared)))  # [repeats, cases] ms
    for r in range(setup.repeats):
        for i in np.random.default_rng(setup.seed + r).permutation(len(prepared)):
            runs[r, i] = run(int(i))
    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(np.median(runs, axis=0), dtype=torch.float64, device=comm)  # [cases]
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    per_rank = torch.stack(every).cpu().numpy()  # [world, cases]
    times: list[float] = []
    for i, (plan, *_rest) in enumerate(prepared):
        pool = plan.pools[0]
        lane_ms = [sum(per_rank[pool.rank(s, lane, t), i] for s in range(pool.pp)) for lane in range(pool.num_lanes)
                   for t in range(pool.tp)]
        times.append(float(np.mean(lane_ms)))
    return times if rank == 0 else None


def measure(setup: Setup, world: int, *, backend: str = "gloo", timeout_s: float = 3600.0) -> list[float]:
    """Lane time (ms) of every case, measured in a spawned world of ``world`` ranks."""
    from parallel_runtime.launch import spawn_world

    return spawn_world(_rank_main, world, setup, backend=backend, timeout_s=timeout_s)[0]


# ---- fitting -------------------------------------------------------------------------------


def samples_of(cases: list[Case], times: list[float], *, cp_inner: int = 1) -> Samples:
    """The cases as calibration samples: a case's time is a lane's whole-model time (the sum over its
    ``pp`` stages), a sample's one stage's share of it."""
    return sample_rows(0, 0, [(c.tp, c.pp, c.degree, cp_inner, c.lengths) for c in cases],
                       [t / c.pp for c, t in zip(cases, times)], [t / c.pp for c, t in zip(cases, times)])


def shape_cost(cases: list[Case], times: list[float], *, tp: int, pp: int, comm_bytes_per_token: float,
               cap: int, cp_inner: int = 1) -> ShapeCost:
    """Contract-2 coefficients of one shape from its training cases (module docstring: calibration's fit,
    plain NNLS on milliseconds)."""
    s = samples_of(cases, times, cp_inner=cp_inner)
    one = s.degree == 1  # [n]
    if int(one.sum()) < 3:
        raise ValueError(f"shape tp={tp}, pp={pp}: need degree-1 cases of at least 3 lengths to fit")
    # a prior of zeros: the plain fit does not pull to it; comm_bytes_per_token has no column at degree 1 and
    # keeps the engine's bytes per token
    prior = ShapeCost(tp=tp, pp=pp, quadratic_ms=0.0, linear_ms=0.0, microbatch_ms=0.0,
                      comm_bytes_per_token=comm_bytes_per_token, bandwidth_gbs=((2, 1.0),), max_tokens_per_lane=cap)
    sc, _ = fit_shape(prior, s.select(one), COMPUTE_FIT)
    bw: list[tuple[int, float]] = []
    for d in sorted({int(x) for x in s.degree[~one].tolist()}):
        # at 1 GB/s the comm column is sum(s) / (d 1e6): the bytes per token fitted there are c_d * 1e6
        at_d, _ = fit_shape(replace(sc, bandwidth_gbs=((d, 1.0),)), s.select(s.degree == d), COMM_FIT)
        b = at_d.comm_bytes_per_token
        bw.append((d, comm_bytes_per_token / b if b > 0 else 1e9))
    return replace(sc, bandwidth_gbs=tuple(bw) or ((2, 1e9),))


def fit(cases: list[Case], times: list[float], *, comm_bytes_per_token: float,
        caps: dict[tuple[int, int], int], name: str = "calibrated", cp_inner: int = 1) -> CostModel:
    """The cost model of every profiled shape (tp=pp=1 is the base and must be profiled); ``cp_inner``: the
    loader's, which names each sample's CP engine."""
    shapes = sorted({(c.tp, c.pp) for c in cases})
    if (1, 1) not in shapes:
        raise ValueError("the profile needs shape tp=1, pp=1 (the cost file's base keys)")
    fitted = {}
    for tp, pp in shapes:
        sel = [(c, t) for c, t in zip(cases, times) if (c.tp, c.pp) == (tp, pp) and not c.held_out]
        fitted[(tp, pp)] = shape_cost([c for c, _ in sel], [t for _, t in sel], tp=tp, pp=pp,
                                      comm_bytes_per_token=comm_bytes_per_token, cap=caps[(tp, pp)], cp_inner=cp_inner)
    b = fitted[(1, 1)]
    return CostModel(name=name, quadratic_ms=b.quadratic_ms, linear_ms=b.linear_ms, microbatch_ms=b.microbatch_ms,
                     comm_bytes_per_token=b.comm_bytes_per_token, bandwidth_gbs=b.bandwidth_gbs,
                     max_tokens_per_lane=b.max_tokens_per_lane, gpus_per_node=8,
                     strategies=tuple(v for k, v in fitted.items() if k != (1, 1)))


def errors(cost: CostModel, cases: list[Case], times: list[float]) -> list[float]:
    """Absolute relative error of the predicted time of every case."""
    return [abs(cost.group_ms(c.lengths, c.degree, c.tp, c.pp) - t) / t for c, t in zip(cases, times)]


def report(cost: CostModel, cases: list[Case], times: list[float]) -> dict:
    """Median / p90 / max relative error on training and held-out cases, overall and per (shape, degree)."""
    err = np.array(errors(cost, cases, times))
    held = np.array([c.held_out for c in cases])
    out: dict = {}
    for label, mask in (("train", ~held), ("held_out", held)):
        e = err[mask]
        out[label] = {"cases": int(mask.sum()), "median_abs_err": round(float(np.median(e)), 4) if e.size else None,
                      "p90_abs_err": round(float(np.percentile(e, 90)), 4) if e.size else None,
                      "max_abs_err": round(float(e.max()), 4) if e.size else None}
    per = {}
    for key in sorted({(c.tp, c.pp, c.degree) for c in cases}):
        m = np.array([(c.tp, c.pp, c.degree) == key for c in cases]) & held
        if m.any():
            per[f"tp{key[0]}pp{key[1]}d{key[2]}"] = round(float(np.median(err[m])), 4)
    out["held_out_median_by_shape_degree"] = per
    return out


def comm_bytes(recipe) -> float:
    """Bytes a CP engine moves per token of a segment, fwd + bwd, all layers (K and V, and their grads)."""
    m = recipe.model
    elem = 2 if recipe.train.dtype in ("bfloat16", "float16") else 4
    return float(2 * 2 * m.num_kv_heads * m.dim_per_head * elem * m.num_layers)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            tp, pp = (int(x) for x in part.lower().split("x"))
            if tp < 1 or pp < 1:
                raise ValueError(part)
        except ValueError:
            raise ValueError(f"--shapes: '{part}' is not TPxPP (e.g. 1x1,1x2)") from None
        out.append((tp, pp))
    return out


def parse_caps(text: str | None, shapes: list[tuple[int, int]], default: int) -> dict[tuple[int, int], int]:
    caps = {s: default for s in shapes}
    for part in (text or "").split(","):
        if not part:
            continue
        try:
            key, val = part.split("=")
            tp, pp = (int(x) for x in key.lower().split("x"))
            caps[(tp, pp)] = int(val)
        except ValueError:
            raise ValueError(f"--cap: '{part}' is not TPxPP=N (e.g. 1x1=512,1x2=1024)") from None
    return caps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime profile",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None, help="cost file to write (default: print it)")
    ap.add_argument("--shapes", default=None, help="TPxPP list (default: the recipe's shapes)")
    ap.add_argument("--degrees", default="1,2", help="CP degrees to profile (those a shape's lanes allow)")
    ap.add_argument("--cap", default=None, help="max_tokens_per_lane per shape, TPxPP=N,... (default max_seq_len)")
    ap.add_argument("--grid", type=int, default=7, help="lengths per (shape, degree) on the training grid")
    ap.add_argument("--held-out", type=int, default=24, help="held-out microbatches drawn from the recipe's plans")
    ap.add_argument("--held-out-from", action="append", default=[], metavar="RECIPE",
                    help="also draw held-out microbatches from this recipe's plans (repeatable; same --set)")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--json", default=None, help="also write the measurements and the report as JSON")
    args = ap.parse_args(argv)
    from parallel_runtime.config import check_shape, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        world = recipe.world.size
        for x in args.held_out_from:
            load_recipe(x, args.overrides)  # bad recipes fail before the world starts
        shapes = parse_shapes(args.shapes) if args.shapes else recipe.shapes()
        if (1, 1) not in shapes:
            shapes = [(1, 1), *shapes]
        caps = parse_caps(args.cap, shapes, recipe.data.longest_seq_len)
        try:
            want = sorted({int(x) for x in args.degrees.split(",")})
        except ValueError:
            raise ValueError(f"--degrees: '{args.degrees}' is not a list of CP degrees (e.g. 1,2)") from None
        if min(want) < 1:
            raise ValueError(f"--degrees: CP degrees must be >= 1, got {args.degrees}")
        degrees = {}
        for tp, pp in shapes:
            if world % (tp * pp):
                raise ValueError(f"--shapes: tp={tp} x pp={pp} does not divide world.size {world}")
            lanes = world // (tp * pp)
            degrees[(tp, pp)] = [d for d in want if d <= lanes and lanes % d == 0] or [1]
            check_shape(recipe.model, tp, pp, recipe.world, where=f"--shapes {tp}x{pp}", degrees=degrees[(tp, pp)])
        if args.repeats < 1 or args.grid < 3:
            raise ValueError("--repeats must be >= 1 and --grid >= 3")
    except ValueError as e:
        print(f"profile: error: {e}", file=sys.stderr)
        return 2
    longest = max([recipe.data.longest_seq_len, *(load_recipe(x, args.overrides).data.longest_seq_len
                                                  for x in args.held_out_from)])
    cases = make_cases(shapes, degrees, caps, grid=args.grid, max_len=longest)
    profiled = {(tp, pp, d) for (tp, pp), ds in degrees.items() for d in ds}
    for r in [recipe, *(load_recipe(x, args.overrides) for x in args.held_out_from)]:
        cases += plan_cases(r, args.held_out, profiled, seed=recipe.seed)
    t0 = time.perf_counter()
    print(f"profiling {len(cases)} microbatches on {world} ranks ({', '.join(f'tp{a}pp{b}' for a, b in shapes)}, "
          f"degrees {sorted({d for v in degrees.values() for d in v})}, {args.repeats} repeats)", file=sys.stderr)
    setup = Setup(recipe_path=args.recipe, overrides=tuple(args.overrides), cases=tuple(cases), repeats=args.repeats,
                  seed=recipe.seed)
    w = recipe.world
    from parallel_runtime.launch import WorldError, default_backend

    try:
        times = measure(setup, world, backend=w.backend if w.backend != "auto" else default_backend(w.device))
    except WorldError as e:  # e.g. a --cap longer than every doc of the source: the first rank's error first
        print(f"profile: the distributed run failed:\n{e}", file=sys.stderr)
        return 1
    cost = fit(cases, times, comm_bytes_per_token=comm_bytes(recipe), caps=caps, cp_inner=recipe.loader_cp_inner(),
               name=f"calibrated {recipe.model.hidden}x{recipe.model.num_layers} {recipe.world.device}")
    rep = report(cost, cases, times)
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    ho = rep["held_out"]
    held = (f"held-out median |error| {ho['median_abs_err']:.1%} over {ho['cases']} microbatches" if ho["cases"]
            else "no held-out microbatches")
    header = (f"# Contract-2 cost file calibrated on this machine by:\n"
              f"#   python -m parallel_runtime profile --recipe {args.recipe}"
              + "".join(f" --set {o}" for o in args.overrides)
              + (f" --shapes {args.shapes}" if args.shapes else "") + f" --degrees {args.degrees}"
              + (f" --cap {args.cap}" if args.cap else "") + f" --repeats {args.repeats}"
              + "".join(f" --held-out-from {x}" for x in args.held_out_from) + f" --held-out {args.held_out}"
              + (f" --out {args.out}" if args.out else "") + "\n"
              f"# {held} ({time.strftime('%Y-%m-%d')}); max_tokens_per_lane is a memory setting (--cap)\n")
    text = header + cost.to_yaml()
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": [dataclasses.asdict(c) for c in cases], "times_ms": times, "report": rep}, f, indent=1)
    print(json.dumps(rep, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
