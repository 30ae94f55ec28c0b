"""Check a TP x CP layout against one process: ``python -m parallel_runtime.diagnostics.selfcheck``.

Spawns ``--world-size`` gloo processes, builds a one-pool plan (``tp`` ranks per lane; groups of
``cp`` consecutive lanes, the second microbatch with each group's lanes reversed), runs
forward and backward of the model on a packed batch (1-token docs and docs not divisible
by ``2 * cp`` included) with the chosen CP engine, and compares the loss and every parameter
gradient with the single-process model on the same docs. Prints JSON; exits 1 when a
difference exceeds the tolerance, 2 on a bad layout. ``--doc-tokens N`` fills each group's
microbatch with docs of N tokens instead (one long doc spans the whole CP group) and the JSON
adds the peak resident memory of the worst rank (``peak_rss_mb``).

``--dtype bfloat16`` runs the layout in bf16 (on CUDA the flash-attention kernels of every ring block) and
passes when its error against the fp32 reference is at most three times that of the same model in bf16 in
one process (the dtype's own round-off; at least 3e-2).

Gradients are compared in full-model coordinates: each rank writes its local gradients at
their place in a full-size buffer (replicated parameters from tp index 0 only) and the
buffers are summed over the world, which also checks the loss normalisation (token sum /
global valid tokens on every rank).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from balanced_loader.plan import Group, Pool, StepPlan, single_pool_ranks
from parallel_runtime.engines.context import ENGINES, CommStats, make_engine, shard_microbatch
from parallel_runtime.engines.tensor import TensorParallel
from parallel_runtime.groups import GroupCache
from parallel_runtime.launch import WorldError, spawn_world
from parallel_runtime.model import ModelConfig, Transformer, local_attention
from parallel_runtime.topology import Topology
from parallel_runtime.training.metrics import peak_rss_mb

TOLERANCE = 1e-5  # fp32, relative
CUDA_TOLERANCE = 1e-4  # fp32 CUDA kernels reduce in other orders
# half precision: the layout's error against the fp32 reference may be at most this many times the error of
# the same model in the same dtype in one process (the dtype's own round-off), or HALF_FLOOR. Why 3: a CP
# layout rounds every block's partial output to the dtype before merging, and small parameters (norm weights,
# gradients summed over every token) vary run to run by 2-3x the one-process figure; a broken path is off by 1.
HALF_FACTOR = 3.0
HALF_FLOOR = 3e-2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DENSE_REFERENCE_TOKENS = 4096  # the reference uses the dense masked formula up to this many tokens


@dataclass(frozen=True, kw_only=True)
class LayoutSpec:
    """One layout to check, and the knobs of its test batch."""

    world_size: int
    tp: int = 1
    cp: int = 1
    engine: str = "ring"
    ulysses: int | None = None  # inner (Ulysses) size; ulysses engine: = cp; ring: 1
    seed: int = 0
    heads: int | None = None
    kv_heads: int | None = None
    hidden: int = 64
    num_layers: int = 2
    docs_per_group: int = 5
    microbatches: int = 2
    overlap: bool = True
    device: str = "cpu"
    doc_tokens: int | None = None  # every doc this long (long docs spanning the CP group)
    dtype: str = "float32"  # the layout's compute dtype (bfloat16: the CP path a GPU run takes, flash blocks)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        if self.engine not in ENGINES:
            raise ValueError(f"--cp-engine must be one of {', '.join(ENGINES)}, got '{self.engine}'")
        if self.doc_tokens is not None and self.doc_tokens < 1:
            raise ValueError(f"--doc-tokens must be >= 1, got {self.doc_tokens}")
        for name in ("world_size", "tp", "cp", "microbatches", "docs_per_group", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.world_size % (self.tp * self.cp):
            raise ValueError(f"--world-size {self.world_size} is not divisible by tp x cp = "
                             f"{self.tp} x {self.cp} = {self.tp * self.cp}")
        inner = self.inner
        if self.cp % inner:
            raise ValueError(f"--ulysses {inner} must divide --cp {self.cp}")

    @property
    def inner(self) -> int:
        if self.engine == "ring":
            if self.ulysses not in (None, 1):
                raise ValueError("--ulysses applies to the ulysses and nested engines, not ring")
            return 1
        if self.engine == "ulysses":
            if self.ulysses not in (None, self.cp):
                raise ValueError(f"the ulysses engine uses all {self.cp} CP lanes as its degree; use "
                                 f"--cp-engine nested for --ulysses {self.ulysses}")
            return self.cp
        if self.ulysses is not None:
            if self.ulysses < 1:
                raise ValueError(f"--ulysses must be >= 1, got {self.ulysses}")
            return self.ulysses
        proper = [u for u in range(2, self.cp) if self.cp % u == 0]
        if not proper:
            raise ValueError(f"nested CP needs --cp with a divisor 1 < u < cp for the inner Ulysses size; "
                             f"cp={self.cp} has none: pass --ulysses, or use ring or ulysses")
        return max(proper)  # a shallow outer ring (HyDra)

    def model_config(self) -> ModelConfig:
        """A shape the layout allows: KV heads a multiple of tp x inner, GQA ratio 2, vocab/ffn split by tp."""
        kv = self.kv_heads if self.kv_heads is not None else self.tp * self.inner
        heads = self.heads if self.heads is not None else 2 * kv
        tp = self.tp
        cfg = ModelConfig(vocab_size=-(-256 // tp) * tp, hidden=self.hidden, num_layers=self.num_layers,
                          num_heads=heads, num_kv_heads=kv, head_dim=8, ffn_hidden=-(-128 // tp) * tp)
        cfg.check_parallel(tp=tp, ulysses=self.inner)
        return cfg


def make_case(spec: LayoutSpec) -> tuple[StepPlan, list[np.ndarray]]:
    """The plan and the docs' tokens (indexed by doc_id) of a layout's test batch."""
    rng = np.random.default_rng(spec.seed)
    num_lanes = spec.world_size // spec.tp
    num_groups = num_lanes // spec.cp
    two_c = 2 * spec.cp
    docs: list[np.ndarray] = []
    microbatches = []
    for k in range(spec.microbatches):
        groups = []
        for g in range(num_groups):
            if spec.doc_tokens is not None:
                lengths = [spec.doc_tokens] * spec.docs_per_group
            else:
                lengths = [1, two_c + 1, 3 * two_c - 1][: spec.docs_per_group]
                lengths += [int(x) for x in rng.integers(2, 4 * two_c + 9, size=spec.docs_per_group - len(lengths))]
                rng.shuffle(lengths)
            segs = []
            for n in lengths:
                segs.append((len(docs), 0, n))
                docs.append(rng.integers(0, 256, size=n))
            lanes = list(range(g * spec.cp, (g + 1) * spec.cp))
            if k % 2 == 1:
                lanes.reverse()  # lane order differs from rank order: engines must follow the plan's order
            groups.append(Group(lanes=tuple(lanes), segments=tuple(segs)))
        microbatches.append(tuple(groups))
    pool = Pool(tp=spec.tp, pp=1, ranks=single_pool_ranks(spec.world_size, spec.tp), microbatches=tuple(microbatches))
    return StepPlan(step=0, world_size=spec.world_size, pools=(pool,)), docs


def reference(spec: LayoutSpec, docs: list[np.ndarray], *,
              dtype: torch.dtype = torch.float32) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the single-process model on all docs, whole and unpadded (on the CPU)."""
    cfg = spec.model_config()
    model = Transformer(cfg, seed=spec.seed).to(dtype)
    mb = shard_microbatch(docs, 1, 0)
    valid = int((mb["labels"] != -100).sum())
    # the textbook dense mask for small batches; per-doc fused SDPA (memory linear in tokens) for long ones
    impl = "masked" if len(mb["input_ids"]) <= DENSE_REFERENCE_TOKENS else "loop"
    loss = model(torch.from_numpy(mb["input_ids"]), torch.from_numpy(mb["position_ids"]),
                 torch.from_numpy(mb["labels"]), attn=local_attention(torch.from_numpy(mb["cu_seqlens"]), impl),
                 num_valid_tokens=valid)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worst(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str, float]:
    """Largest relative (to the parameter's largest reference gradient) and absolute difference, and where."""
    worst, name, worst_abs = 0.0, "", 0.0
    for n, r in ref.items():
        r = r.to(torch.float64)
        diff = float((grads[n].to(torch.float64) - r).abs().max())
        rel = diff / max(float(r.abs().max()), 1e-30)
        if rel > worst:
            worst, name = rel, n
        worst_abs = max(worst_abs, diff)
    return worst, name, worst_abs


def run_rank(rank: int, world_size: int, spec: LayoutSpec) -> dict | None:
    """One rank's part of the check (inside an initialised world). Rank 0 returns the result."""
    t0 = time.perf_counter()
    plan, docs = make_case(spec)
    cfg = spec.model_config()
    inner = spec.inner
    topo = Topology.from_plan(plan)
    groups = GroupCache.build([topo], plans=[plan], inner_sizes=[inner] if spec.engine == "nested" else None)
    coord = topo.coord(rank)
    device = torch.device(spec.device)
    tp = TensorParallel(size=spec.tp, index=coord.tp_index, group=groups.get(topo.tp_ranks(rank)))
    model = Transformer(cfg, tp=tp, seed=spec.seed, device=device, dtype=DTYPES[spec.dtype])
    all_docs = shard_microbatch(docs, 1, 0)
    num_valid = int((all_docs["labels"] != -100).sum())
    stats = CommStats()
    local_loss = torch.zeros((), dtype=torch.float64)
    for work in topo.lane_work(rank, plan):
        if work is None:
            continue
        engine = make_engine(spec.engine, groups, work.cp_ranks, rank, inner=inner, overlap=spec.overlap,
                             stats=stats)
        mb = shard_microbatch([docs[d] for d, _, _ in work.group.segments], work.group.degree, work.lane_index,
                              inner=inner)
        loss = model(torch.from_numpy(mb["input_ids"]).to(device), torch.from_numpy(mb["position_ids"]).to(device),
                     torch.from_numpy(mb["labels"]).to(device), attn=engine.bind(mb["lengths"]),
                     num_valid_tokens=num_valid)
        loss.backward()
        local_loss += float(loss.detach()) if coord.tp_index == 0 else 0.0
    shapes = model.full_shapes()
    names = list(shapes)
    sizes = [int(np.prod(shapes[n][0])) for n in names]
    flat = torch.zeros(sum(sizes), dtype=torch.float64)
    params = dict(model.named_parameters())
    off = 0
    for name, size in zip(names, sizes):
        shape, dim = shapes[name]
        if dim is not None or coord.tp_index == 0:
            full = flat[off:off + size].view(shape)
            g = params[name].grad.detach().to("cpu", torch.float64)
            if dim is None:
                full.copy_(g)
            else:
                n = g.shape[dim]
                full.narrow(dim, coord.tp_index * n, n).copy_(g)
        off += size
    dist.all_reduce(flat)
    dist.all_reduce(local_loss)
    bytes_sent = torch.tensor([stats.total()], dtype=torch.float64)
    dist.all_reduce(bytes_sent)
    peak = torch.tensor([peak_rss_mb()], dtype=torch.float64)  # before rank 0 runs the reference
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    ref_loss, ref_grads = reference(spec, docs)
    got, off = {}, 0
    for name, size in zip(names, sizes):
        got[name] = flat[off:off + size].view(shapes[name][0])
        off += size
    worst, worst_name, worst_abs = _worst(got, ref_grads)
    tol = CUDA_TOLERANCE if device.type == "cuda" else TOLERANCE
    loss = float(local_loss)
    rel_loss = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    half = {}
    if spec.dtype != "float32":  # the dtype's own round-off: the same model in one process, against fp32
        loss16, grads16 = reference(spec, docs, dtype=DTYPES[spec.dtype])
        floor = _worst(grads16, ref_grads)[0]
        tol = max(HALF_FACTOR * floor, HALF_FLOOR)
        half = {"dtype": spec.dtype, "one_process_rel_diff_grad": floor,
                "one_process_rel_diff_loss": abs(loss16 - ref_loss) / max(abs(ref_loss), 1e-30)}
    return {
        "layout": {"world_size": spec.world_size, "tp": spec.tp, "cp": spec.cp, "cp_engine": spec.engine,
                   "ulysses": inner, "ring": spec.cp // inner, "dp": spec.world_size // (spec.tp * spec.cp),
                   "overlap": spec.overlap, "device": spec.device, "seed": spec.seed, "dtype": spec.dtype},
        "model": {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.dim_per_head,
                  "hidden": cfg.hidden, "num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
                  "ffn_hidden": cfg.ffn_hidden},
        "batch": {"docs": len(docs), "tokens": int(sum(len(d) for d in docs)), "valid_tokens": num_valid,
                  "lengths": [len(d) for d in docs], "microbatches": spec.microbatches},
        "process_groups": len(groups),
        "loss": loss,
        "reference_loss": ref_loss,
        "max_abs_diff_loss": abs(loss - ref_loss),
        "max_rel_diff_loss": rel_loss,
        "max_rel_diff_grad": worst,
        "max_abs_diff_grad": worst_abs,
        "worst_param": worst_name,
        "cp_bytes_sent": int(bytes_sent.item()),
        "peak_rss_mb": round(float(peak.item()), 1),  # worst rank, CP run only
        "reference_peak_rss_mb": round(peak_rss_mb(), 1),  # rank 0 after the one-process reference too
        "tolerance": tol,
        **({"half": half} if half else {}),
        "ok": bool(rel_loss <= tol and worst <= tol),
        "rank0_seconds": round(time.perf_counter() - t0, 3),
    }


def check(spec: LayoutSpec, *, timeout_s: float = 300.0) -> dict:
    """Spawn the world, run the check, return rank 0's result."""
    spec.model_config()  # bad layouts fail here, before any process starts
    t0 = time.perf_counter()
    result = spawn_world(run_rank, spec.world_size, spec, timeout_s=timeout_s)[0]
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime.diagnostics.selfcheck",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--cp-engine", choices=ENGINES, default="ring")
    ap.add_argument("--ulysses", type=int, default=None, help="inner Ulysses size of the nested engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--docs-per-group", type=int, default=None, help="default 5 (1 with --doc-tokens)")
    ap.add_argument("--microbatches", type=int, default=None, help="default 2 (1 with --doc-tokens)")
    ap.add_argument("--doc-tokens", type=int, default=None,
                    help="every doc this many tokens (one long doc spans the CP group); reports peak memory")
    ap.add_argument("--no-overlap", action="store_true", help="wait for each ring transfer before computing")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (all ranks share cuda:0 through gloo)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                    help="the layout's dtype (bfloat16: flash-attention blocks on CUDA; compared with the fp32 "
                         "reference within 3x the same model's error in one process)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before the world is ended")
    args = ap.parse_args(argv)

    def long_default(n: int) -> int:  # long docs: one doc in one microbatch unless asked otherwise
        return 1 if args.doc_tokens is not None else n

    try:
        spec = LayoutSpec(world_size=args.world_size, tp=args.tp, cp=args.cp, engine=args.cp_engine,
                          ulysses=args.ulysses, seed=args.seed, heads=args.heads, kv_heads=args.kv_heads,
                          num_layers=args.layers, overlap=not args.no_overlap, device=args.device,
                          doc_tokens=args.doc_tokens, dtype=args.dtype,
                          docs_per_group=args.docs_per_group if args.docs_per_group is not None else long_default(5),
                          microbatches=args.microbatches if args.microbatches is not None else long_default(2))
        if spec.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but torch sees no CUDA device")
        result = check(spec, timeout_s=args.timeout)
    except ValueError as e:
        print(f"selfcheck: {e}", file=sys.stderr)
        return 2
    except WorldError as e:
        print(f"selfcheck: the distributed run failed:\n{e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

