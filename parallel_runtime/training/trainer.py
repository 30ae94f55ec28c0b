"""The trainer: ``train -> train_step`` over a BalancedLoader's plans.

``train_step`` is two calls: the step executor (:mod:`.step_run`: :class:`~.step_run.DistributedStep`, or
:class:`~.step_run.ReferenceStep` with ``reference=True``) runs the step, :class:`~.step_report.StepReport`
makes its ``metrics.jsonl`` row. One step on every rank:

1. the loader yields the step's plan and this rank's microbatches (``policy.plan_source:
   local``: every rank plans the same deterministic plan; ``broadcast``: rank 0 plans and
   broadcasts it, for time-limited solvers);
2. :func:`~parallel_runtime.training.plan_check.check_plan_runs_here`: the plan fingerprints
   agree across ranks (before any other collective of the step), the plan keeps contract 1, the
   model splits over its shapes, and groups it needs that do not exist yet are created (same
   order everywhere);
3. **pull**: the fixed fp32 optimizer shards are gathered into this rank's working parameters
   for its (pool, stage, tp index) in this step's shape;
4. :func:`~parallel_runtime.training.step.forward_backward`: 1F1B over the pool's microbatches, CP
   groups per microbatch, loss = token sum / the step's global valid tokens;
5. **push**: gradients reduce-scattered into the fixed shards (every pool shape in the same
   coordinates); global-norm clipping and AdamW on the owned shard;
6. rank 0 appends the step's metrics to ``OUT/metrics.jsonl``.

Checkpoints (:mod:`parallel_runtime.training.checkpoint`: ``OUT/checkpoint/step-N/``, the optimizer
shards saved with ``torch.distributed.checkpoint`` as global tensors, loader state, step and recipe
in ``meta.json``; complete or absent, ``latest`` names the newest) are written every
``train.checkpoint_every`` steps and at the end; a run whose OUT holds one resumes from it exactly,
on any number of processes, given a recipe that computes the same thing. ``reference=True`` runs
the same plans' docs in one process on the whole model (the check that a parallel setup is exact).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from balanced_loader.loader import BalancedLoader, StepBatch
from balanced_loader.materialize import num_valid_tokens
from balanced_loader.planning import fixed_pools
from parallel_runtime.config import Recipe, dump_recipe
from parallel_runtime.groups import GroupCache, declared_groups
from parallel_runtime.hf.model import HFModel, HFRuntime
from parallel_runtime.launch import phase
from parallel_runtime.model import Transformer
from parallel_runtime.topology import PoolShape, Topology
from parallel_runtime.training import checkpoint as CK
from parallel_runtime.training import guards as G
from parallel_runtime.training import metrics as M
from parallel_runtime.training.breakdown import StepTimes
from parallel_runtime.training.closed_loop import ClosedLoop
from parallel_runtime.training.heap import set_heap_mmap_threshold
from parallel_runtime.training.optimizer import FlatLayout, ShardedOptimizer
from parallel_runtime.training.overlap import BUCKET_ELEMS, Overlap, run_overlap
from parallel_runtime.training.params import init_params, local_params, param_specs
from parallel_runtime.training.peaks import PeakProbe
from parallel_runtime.training.recipe_setup import open_data, open_data_world, recipe_loader, run_device
from parallel_runtime.training.runtime import DTYPES, Runtime, accumulate_in_fp32
from parallel_runtime.training.step_memory import StepMemory
from parallel_runtime.training.step_report import StepReport
from parallel_runtime.training.step_run import DistributedStep, ReferenceStep
from parallel_runtime.training.transport import ShardExchange, bucket_limit, exchange_group


def declared_topologies(recipe: Recipe) -> list[Topology]:
    """Pool layouts known before the first plan (their groups are created up front): the policy's
    fixed pools when it has them (:func:`balanced_loader.planning.fixed_pools`), and the plain
    data-parallel layout that ``--compare`` runs beside it."""
    w = recipe.world.size
    out = []
    pools = fixed_pools(recipe.policy_config())
    if pools is not None:
        out.append(Topology(world_size=w, pools=tuple(PoolShape(tp=p.tp, pp=p.pp, ranks=p.ranks) for p in pools)))
    if recipe.policy.compare:
        out.append(Topology.uniform(w))
    return out


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """Where this process sits."""

    rank: int
    world_size: int
    local_rank: int
    reference: bool


class Trainer:
    """Trains ``recipe`` on this rank (call on every rank of an initialised world, or alone with reference)."""

    @G.release_lock_on_error
    def __init__(self, recipe: Recipe, out_dir: str, *, reference: bool = False,
                 allow_changed: bool = False, fresh: bool = False) -> None:
        """``allow_changed``: a resume may change the learning rate and clipping (``--allow-changed``);
        ``fresh``: start over in an ``out_dir`` whose metrics no checkpoint continues (``--fresh``)."""
        self.recipe = recipe
        self.out_dir = out_dir
        distributed = not reference
        if distributed and not dist.is_initialized():
            raise ValueError("the process group is not initialized: start with accelerate launch (or init_world)")
        world = dist.get_world_size() if distributed else 1
        if distributed and world != recipe.world.size:
            raise ValueError(f"world.size is {recipe.world.size} but {world} processes were started; launch with "
                             f"--num_processes {recipe.world.size} or --set world.size={world}")
        rank = dist.get_rank() if distributed else 0
        self.info = RunInfo(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                            reference=reference)
        self._out_lock = G.lock_out(out_dir, rank)  # one writer per --out: a second run fails here, naming this one
        w = recipe.world
        self.device = run_device(w, self.info.local_rank)
        if self.device.type == "cpu":
            set_heap_mmap_threshold(w.heap_mmap_kb << 10)  # before the model and shards are allocated
        self.dtype = DTYPES[recipe.train.dtype]
        self.cost = recipe.cost_model()
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
        if distributed:
            self.source = open_data_world(recipe, rank=rank, local_rank=self.info.local_rank)
        else:
            self.source = open_data(recipe, build=True)
        self.vocab = G.model_vocab(recipe)  # (size, recipe key): the data's ids must fit, checked before any step
        G.check_vocab(self.source, *self.vocab)
        self.loader = self._loader(recipe.policy.name, calibrate=recipe.train.calibrate)
        self.compare = {} if reference else {name: self._loader(name) for name in recipe.policy.compare}
        self.loop = ClosedLoop(calibrate=recipe.train.calibrate, trace=recipe.train.trace, rank=rank,
                               world_size=world, reference=reference, loader=self.loader,
                               others=list(self.compare.values()), out_dir=out_dir, device=self.device)
        hf = HFModel(recipe.model.hf, seed=recipe.seed) if recipe.model.hf is not None else None  # model.hf
        specs = hf.specs if hf else param_specs(recipe.model)
        gpu = self.device.type == "cuda"  # buckets of at least 1 MiB per peer there (bucket_limit)
        overlap = distributed and run_overlap(recipe.train.overlap, gpu=gpu, threads=w.threads, world=world)
        self.optimizer = ShardedOptimizer(FlatLayout(specs, world),
                                          hf.init_params() if hf else init_params(recipe.model, recipe.seed),
                                          recipe.optimizer, rank=rank, device=self.device,
                                          group=exchange_group(world) if overlap else None)
        # pull and push between the shards and this rank's working parameters
        self.exchange = ShardExchange(self.optimizer,
                                      bucket_elems=bucket_limit(BUCKET_ELEMS, world, gpu=gpu) if overlap else None)
        self.overlap = Overlap(self.exchange) if overlap else None  # train.overlap: buckets beside compute
        self.groups = None
        # small collectives (fingerprints, per-rank stats) on the backend's device: NCCL moves CUDA tensors only
        self.comm_device = self.device if distributed and dist.get_backend() == "nccl" else torch.device("cpu")
        # samples from hooks in the models and between phases: no thread waking beside the compute
        # (heap trims below the process's high mark only with recompute: see peaks.py)
        trim = self.recipe.world.heap_trim_mb << 20
        self.memory = StepMemory(PeakProbe(self.device, interval_s=None, trim_bytes=trim,
                                           margin_bytes=trim if self.recipe.train.recompute else 0))
        self.times = StepTimes()  # this rank's phase times in the step being run (metrics "time_ms")
        kw = dict(optimizer=self.optimizer, exchange=self.exchange, memory=self.memory, times=self.times,
                  world_size=world)
        if distributed:
            backend = None if w.backend == "auto" else w.backend
            self.groups = GroupCache(rank=rank, backend=backend)
            self.groups.ensure(declared_groups(declared_topologies(recipe), w.cp_engine, w.cp_inner))
            rkw = dict(rank=rank, device=self.device, dtype=self.dtype, attention=recipe.train.attention,
                       groups=self.groups, specs=specs, layout=self.optimizer.layout)
            runtime = HFRuntime(hf, **rkw) if hf else Runtime(recipe.model, **rkw)
            self.executor = DistributedStep(runtime, recipe=recipe, groups=self.groups, overlap=self.overlap,
                                            rank=rank, comm_device=self.comm_device, share_grad=not self.compare,
                                            **kw)
        else:
            model = (hf.build(self.device, self.dtype) if hf
                     else Transformer(recipe.model, device=self.device, dtype=self.dtype, seed=None))
            by_name = {s.name: s for s in specs}
            params = model.local_params(by_name) if hf else local_params(model, by_name)
            half = self.dtype != torch.float32  # a half-precision reference sums its gradients in fp32 as the runtime
            if half:
                accumulate_in_fp32(params)
            self.executor = ReferenceStep(model, params, source=self.source, device=self.device,
                                          attention=_ref_attention(recipe), recompute=recipe.train.recompute,
                                          fp32_grads=half, **kw)
        self.report = StepReport(policy=recipe.policy.name, loader=self.loader, compare=self.compare, loop=self.loop,
                                 memory=self.memory, times=self.times, optimizer=self.optimizer,
                                 exchange=self.exchange, groups=self.groups, world_size=world,
                                 comm_device=self.comm_device if distributed else None)
        self.metrics = M.MetricsLog(os.path.join(out_dir, "metrics.jsonl"))
        self.step = 0
        self.resumed_from: int | None = None
        self._load_checkpoint(allow_changed, fresh)

    def _loader(self, policy: str, *, calibrate: bool = False) -> BalancedLoader:
        return recipe_loader(self.recipe, self.source, policy, rank=self.info.rank, cost=self.cost,
                             calibrate=calibrate)

    # ---- the loop ---------------------------------------------------------------------
    def train(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Train until global step ``steps`` (default: the recipe's); returns rank 0's metrics of this run."""
        until = self.recipe.steps if steps is None else steps
        every = self.recipe.train.checkpoint_every
        out = []
        saved = self.step if self._has_checkpoint() else None
        try:
            while self.step < until:
                with self.times.phase("data_wait"):
                    batch = self.next_batch(self.loader)
                G.check_step_ids(batch, *self.vocab)
                m = self.train_step(batch)
                out.append(m)
                if self.info.rank == 0:
                    print(M.format_step(m), flush=True)
                if every and self.step % every == 0:
                    with phase(f"the checkpoint of step {self.step}", self._all):
                        self.save_checkpoint()
                    saved = self.step
            if saved != self.step:
                with phase(f"the checkpoint of step {self.step}", self._all):
                    self.save_checkpoint()
        finally:
            self.close()
        return out

    def next_batch(self, loader: BalancedLoader) -> StepBatch:
        """The next step of ``loader``; with ``plan_source: broadcast`` rank 0's plan, materialized here."""
        if self.recipe.policy.plan_source == "local" or self.info.reference:
            return next(loader)
        t0 = time.perf_counter()
        box: list[Any] = [None]
        if self.info.rank == 0:
            b = next(loader)
            box = [(b.plan, b.step, b.epoch, b.step_in_epoch, b.planner_wait_s, b.mixture_tokens, b.sequences)]
        with phase(f"the plan broadcast after step {self.step}", self._all):
            dist.broadcast_object_list(box, src=0)
        plan, step, epoch, s_in, wait, mixture_tokens, sequences = box[0]
        if self.info.rank != 0:
            wait = time.perf_counter() - t0  # these ranks' loaders only materialize; checkpoints keep rank 0's cursor
        return StepBatch(step=step, epoch=epoch, step_in_epoch=s_in, plan=plan,
                         microbatches=tuple(loader.microbatches(plan, self.info.rank)),
                         num_valid_tokens=num_valid_tokens(plan), planner_wait_s=wait,
                         doc_stats=loader.epoch_stats(epoch), rank=self.info.rank, sequences=sequences,
                         mixture_tokens=mixture_tokens)

    def train_step(self, batch: StepBatch) -> dict[str, Any]:
        """One optimizer step on ``batch``; returns the step's metrics (complete on rank 0)."""
        t0 = time.perf_counter()
        run = self.executor.run(batch, self.compare, self.next_batch)
        rec = self.report.record(batch, run, t0)
        self.step = batch.step + 1
        if self.info.rank == 0:
            self.metrics.write(rec)
        return rec

    @property
    def _all(self) -> range:
        """Every rank (what a world-wide collective waits on)."""
        return range(self.info.world_size)

    # ---- checkpoints -------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.out_dir, "checkpoint")

    def _has_checkpoint(self) -> bool:
        return os.path.exists(os.path.join(self.checkpoint_dir, CK.LATEST))

    def save_checkpoint(self) -> str:
        """Write ``OUT/checkpoint/step-N`` (collective; complete or absent, see :mod:`.checkpoint`)."""
        meta = {"world_size": self.recipe.world.size, "processes": self.info.world_size,
                "reference": self.info.reference, "loader": self.loader.state_dict(),
                "compare": {n: ld.state_dict() for n, ld in self.compare.items()},
                "recipe": dump_recipe(self.recipe)}
        return CK.save(self.checkpoint_dir, self.step, self.optimizer, meta, rank=self.info.rank,
                       distributed=not self.info.reference)

    def _load_checkpoint(self, allow_changed: bool, fresh: bool = False) -> None:
        """Resume from ``OUT/checkpoint/latest`` if there is one: every check comes before any state
        changes or any file is written (a refused resume leaves OUT as it was). Without one, metrics
        already in OUT are refused unless ``fresh`` (:func:`.guards.check_history`)."""
        saved = CK.find(self.checkpoint_dir)
        if self.info.rank == 0:
            G.check_history(self.out_dir, self.metrics.path, checkpoint=None if saved is None else saved.step,
                            fresh=fresh)
        if saved is None:
            return
        meta, folder = saved.meta, saved.folder
        if bool(meta["reference"]) != self.info.reference:
            what = "a --reference run" if meta["reference"] else "a distributed run"
            raise ValueError(f"--out {self.out_dir} holds a checkpoint of {what}; this run is "
                             f"{'a --reference run' if self.info.reference else 'distributed'}; use another --out")
        notes = CK.compare_recipes(meta["recipe"], dump_recipe(self.recipe), allow_changed=allow_changed,
                                   where=folder)
        missing = [n for n in self.compare if n not in meta["compare"]]
        if missing:
            raise ValueError(f"checkpoint {folder} has no loader state for policy.compare '{missing[0]}'; "
                             f"resume with the same policy.compare")
        self.loader.load_state_dict(meta["loader"])
        for n, ld in self.compare.items():
            ld.load_state_dict(meta["compare"][n])
        CK.load_optimizer(saved, self.optimizer, distributed=not self.info.reference)
        self.step = saved.step
        self.resumed_from = self.step
        if self.info.rank == 0:
            for line in notes:
                print(line, flush=True)
            self.metrics.truncate_from(self.step)
            print(f"resumed from {folder} at step {self.step} (saved on {meta['processes']} processes, "
                  f"now {self.info.world_size})", flush=True)

    def close(self) -> None:
        self.loop.close()
        self.memory.close()
        self.loader.close()
        for ld in self.compare.values():
            ld.close()
        if self._out_lock is not None:
            self._out_lock.release()


def _ref_attention(recipe: Recipe) -> str:
    """The reference runs whole segments per doc (``loop``) on CPU: no dense mask over a whole group."""
    a = recipe.train.attention
    return "loop" if a in ("auto", "masked") and recipe.world.device == "cpu" else a
