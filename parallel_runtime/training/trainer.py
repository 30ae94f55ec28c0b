"""The trainer: ``train -> train_step -> forward_backward`` over a BalancedLoader's plans.

One step on every rank:

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
from contextlib import ExitStack
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
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
from parallel_runtime.training.overlap import BUCKET_ELEMS, Overlap
from parallel_runtime.training.params import init_params, local_params, param_specs
from parallel_runtime.training.peaks import PeakProbe
from parallel_runtime.training.plan_check import check_plan_runs_here
from parallel_runtime.training.rank_step import StepHooks, execute_step
from parallel_runtime.training.recipe_setup import open_data, open_data_world, recipe_loader, run_device
from parallel_runtime.training.runtime import DTYPES, GradBuffer, Runtime, accumulate_in_fp32
from parallel_runtime.training.step import FBResult, reference_forward_backward
from parallel_runtime.training.step_memory import StepMemory
from parallel_runtime.training.transport import ExchangeStats, ShardExchange, bucket_limit, exchange_group


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
class RankStats:
    """One step's figures of every rank, by rank (all-gathered in :meth:`gather`)."""

    loss_sum: np.ndarray  # [world] float64, each rank's share of the step loss
    compute_ms: np.ndarray  # [world] float64, time in compute
    wall_ms: np.ndarray  # [world] float64, forward/backward wall time, waits included
    planner_wait_ms: np.ndarray  # [world] float64, time the step waited for its plan
    microbatches: np.ndarray  # [world] float64, microbatches each rank ran
    pipeline_bytes: np.ndarray  # [world] float64, bytes each rank sent to neighbouring stages
    busy_wall_ms: np.ndarray  # [world] float64, wall time of each rank's compute blocks

    @staticmethod
    def of(res: FBResult, wait_s: float) -> RankStats:
        """This rank's figures alone (a world of one)."""
        return RankStats(loss_sum=np.array([res.loss_sum]), compute_ms=np.array([res.compute_ms]),
                         wall_ms=np.array([res.wall_ms]), planner_wait_ms=np.array([wait_s * 1e3]),
                         microbatches=np.array([float(res.microbatches)]),
                         pipeline_bytes=np.array([float(res.pipeline_bytes)]),
                         busy_wall_ms=np.array([res.busy_wall_ms]))

    def gather(self, comm_device: torch.device) -> RankStats:
        """Every rank's figures (collective): one all-gather of this rank's fields, packed in field order."""
        names = [f.name for f in fields(self)]
        rows = M.gather_rows([getattr(self, n)[0] for n in names], comm_device)  # [world, fields]
        return RankStats(**{n: rows[:, i] for i, n in enumerate(names)})


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
        self._fb: FBResult | None = None  # this rank's forward/backward of the step being run
        hf = HFModel(recipe.model.hf, seed=recipe.seed) if recipe.model.hf is not None else None  # model.hf
        specs = hf.specs if hf else param_specs(recipe.model)
        overlap = distributed and recipe.train.overlap
        gpu = self.device.type == "cuda"  # buckets of at least 1 MiB per peer there (bucket_limit)
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
        if distributed:
            backend = None if w.backend == "auto" else w.backend
            self.groups = GroupCache(rank=rank, backend=backend)
            self.groups.ensure(declared_groups(declared_topologies(recipe), w.cp_engine, w.cp_inner))
            kw = dict(rank=rank, device=self.device, dtype=self.dtype, attention=recipe.train.attention,
                      groups=self.groups, specs=specs, layout=self.optimizer.layout)
            self.runtime = HFRuntime(hf, **kw) if hf else Runtime(recipe.model, **kw)
        elif hf:
            self.model = hf.build(self.device, self.dtype)
            self.ref_params = self.model.local_params({s.name: s for s in specs})
        else:
            self.model = Transformer(recipe.model, device=self.device, dtype=self.dtype, seed=None)
            self.ref_params = local_params(self.model, {s.name: s for s in specs})
        # a half-precision reference sums its microbatches' gradients in fp32, as the runtime does
        self._ref_grads = None
        if reference and self.dtype != torch.float32:
            accumulate_in_fp32(self.ref_params)
            self._ref_grads = GradBuffer(self.device)
        self.metrics = M.MetricsLog(os.path.join(out_dir, "metrics.jsonl"))
        # samples from hooks in the models and between phases: no thread waking beside the compute
        # (heap trims below the process's high mark only with recompute: see peaks.py)
        trim = self.recipe.world.heap_trim_mb << 20
        self.memory = StepMemory(PeakProbe(self.device, interval_s=None, trim_bytes=trim,
                                           margin_bytes=trim if self.recipe.train.recompute else 0))
        self.times = StepTimes()  # this rank's phase times in the step being run (metrics "time_ms")
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
        plan = batch.plan
        self.exchange.take_stats()  # this step's record starts here
        with self.memory.step():  # heap trims between phases, the peak from here to the optimizer step's end
            if self.info.reference:
                self._fb = self._reference_fb(batch)
                stats = RankStats.of(self._fb, batch.planner_wait_s)
                new_groups = 0
            else:
                stats, new_groups = self._execute(batch, push=True)
            compare = {name: self._compare_step(name, loader) for name, loader in self.compare.items()}
            with phase(f"the optimizer step of step {batch.step}", self._all), self.times.phase("optimizer"):
                norm = self.optimizer.step()
        fb = self._fb
        moved: ExchangeStats = self.exchange.take_stats()  # the step's pulls and pushes, compare passes' included
        with phase(f"the memory record of step {batch.step}", self._all):  # a gather: every collective is named
            memory = self._memory_record()
        self.times.add("exposed_comm", moved.comm_s + self.optimizer.norm_comm_s)
        bal = M.step_balance(plan, self.loader.costs.at(batch.step), stats.compute_ms, stats.wall_ms,
                             stats.busy_wall_ms)
        if self.info.reference:  # one process: the plan's per-rank prediction, one measured time
            bal.update(skew=1.0, wall_skew=1.0, measured_bubble=0.0)
        if self.loop.active:
            with phase(f"the calibration after step {batch.step}", self._all), self.times.phase("closed_loop"):
                bal.update(self.loop.after_step(batch, fb, (time.perf_counter() - t0) * 1e3))
        # one clock reading for both: record() gathers the ranks' rows (a collective), and a second reading after it
        # would put that wait in step_ms but in none of the phases
        step_ms = (time.perf_counter() - t0) * 1e3
        with phase(f"the time record of step {batch.step}", self._all):
            times = self.times.record(step_ms, None if self.info.reference else self.comm_device)
        self.step = batch.step + 1
        rec = {"step": batch.step, "loss": float(stats.loss_sum.sum()), "tokens": plan.tokens,
               "valid_tokens": batch.num_valid_tokens, "docs": int(len(plan.doc_ids())),
               "policy": self.recipe.policy.name, "fingerprint": plan.fingerprint(), **M.plan_shape(plan), **bal,
               "wall_ms": [round(float(x), 3) for x in stats.wall_ms],
               "microbatches": [int(x) for x in stats.microbatches],
               "planner_wait_ms": round(float(stats.planner_wait_ms.max()), 3),
               "grad_norm": norm, "lr": self.optimizer.config.lr_at(self.optimizer.steps - 1),
               "pull_bytes": moved.bytes_pulled, "push_bytes": moved.bytes_pushed,
               "pipeline_bytes": int(stats.pipeline_bytes.sum()), "new_groups": new_groups,
               "step_ms": round(step_ms, 3), "memory": memory, "time_ms": times}
        if batch.mixture_tokens is not None:
            rec["mixture_tokens"] = batch.mixture_tokens
        if compare:
            rec["compare"] = compare
        if self.info.rank == 0:
            self.metrics.write(rec)
        return rec

    # ---- pieces of a step ----------------------------------------------------------------
    def _execute(self, batch: StepBatch, *, push: bool) -> tuple[RankStats, int]:
        """Check ``batch``'s plan (creating the groups it lacks), pull, forward/backward (and push the
        gradients); returns every rank's stats and the number of groups created."""
        plan, s, world, times = batch.plan, batch.step, self._all, self.times
        with phase(f"the plan check of step {s}", world), times.phase("plan_check"):
            topo, new_groups = check_plan_runs_here(plan, recipe=self.recipe, sequences=batch.sequences,
                                                    groups=self.groups, comm_device=self.comm_device)
        hooks = _TrainerHooks(self, topo, plan, s, push)
        res = execute_step(self.runtime, self.exchange, self.overlap, topo, plan, batch.microbatches,
                           batch.num_valid_tokens, step=s, push=push, share_grad=not self.compare,
                           recompute=self.recipe.train.recompute, spans=self.recipe.train.trace and push, hooks=hooks)
        if push:
            self._fb = res
        with phase(f"the gradient push of step {s}", world):
            stats = RankStats.of(res, batch.planner_wait_s).gather(self.comm_device)
        return stats, new_groups

    @property
    def _all(self) -> range:
        """Every rank (what a world-wide collective waits on)."""
        return range(self.info.world_size)

    def _compare_step(self, name: str, loader: BalancedLoader) -> dict[str, Any]:
        """Forward and backward of another policy's plan of the same batch (same parameters, not trained)."""
        batch = self.next_batch(loader)
        plan = batch.plan
        stats, _ = self._execute(batch, push=False)
        return {"fingerprint": plan.fingerprint(), "loss": float(stats.loss_sum.sum()), **M.plan_shape(plan),
                **M.step_balance(plan, loader.costs.at(batch.step), stats.compute_ms, stats.wall_ms,
                                 stats.busy_wall_ms)}

    def _reference_fb(self, batch: StepBatch) -> FBResult:
        self.model.recompute = self.recipe.train.recompute
        saved = self.memory.watch(self.model, self.ref_params)
        self.exchange.pull(self.ref_params)
        if self._ref_grads is not None:
            self._ref_grads.attach(self.ref_params)
        with saved.hooks():
            res = reference_forward_backward(self.model, batch.plan, self.source, batch.num_valid_tokens,
                                             device=self.device, attention=_ref_attention(self.recipe))
        self.memory.note(self.ref_params, saved)
        self.exchange.push(self.ref_params)
        GradBuffer.detach(self.ref_params)
        return res

    # ---- memory report ---------------------------------------------------------------------
    def _process_groups(self) -> int:
        """Process groups this rank is in: the world, the optimizer's exchange group and the plan groups (NCCL
        makes a communicator, with its own device buffers, for each one used)."""
        if self.info.reference:
            return 0
        groups = {id(g) for g in self.groups.members()} | {id(dist.group.WORLD)}
        if self.optimizer.group is not None:
            groups.add(id(self.optimizer.group))
        return len(groups)

    def _memory_record(self) -> dict[str, Any]:
        """Every rank's peak and parts (collective unless a reference run); keys in docs/runtime.md."""
        mine = {**self.memory.figures(
            optimizer_bytes=self.optimizer.state_bytes,  # a gradient shard inside the working gradients: grads_bytes
            comm_bytes=self.exchange.buffer_bytes),  # the reusable fp32 send and receive buffers of the buckets
            "process_groups": self._process_groups()}
        rows = M.gather_values(mine, None if self.info.reference else self.comm_device)
        return {**rows, "peak_exact": [bool(x) for x in rows["peak_exact"]]}

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


class _TrainerHooks(StepHooks):
    """The trainer around a step's pieces: failure phases (who a timeout waited on), phase times, memory probes."""

    def __init__(self, trainer: Trainer, topo: Topology, plan, step: int, push: bool) -> None:
        self.t, self.topo, self.plan, self.step, self.push = trainer, topo, plan, step, push
        self.saved: M.SavedActivations | None = None

    def phase(self, name: str) -> ExitStack:
        t, s = self.t, self.step
        what, peers = {"pull": (f"the parameter pull of step {s}", t._all),
                       "push": (f"the gradient push of step {s}", t._all),
                       "forward_backward": (f"forward/backward of step {s}",
                                            _step_peers(self.topo, self.plan, t.info.rank))}[name]
        stack = ExitStack()
        stack.enter_context(phase(what, peers))
        if name == "forward_backward":
            stack.enter_context(self.saved.hooks())
        stack.enter_context(t.times.phase(name))
        return stack

    def model(self, sm) -> None:
        self.saved = self.t.memory.watch(sm.model, sm.params)

    def between(self) -> None:
        self.t.memory.between()

    def before_push(self, sm) -> None:
        if self.push:
            self.t.memory.note(sm.params, self.saved)


def _ref_attention(recipe: Recipe) -> str:
    """The reference runs whole segments per doc (``loop``) on CPU: no dense mask over a whole group."""
    a = recipe.train.attention
    return "loop" if a in ("auto", "masked") and recipe.world.device == "cpu" else a


def _step_peers(topo: Topology, plan, rank: int) -> list[int]:
    """The ranks this rank exchanges with in a step's forward/backward: its pipeline lane, TP group and
    the CP groups of its microbatches (what a timeout there waited on)."""
    peers = set(topo.pipeline_ranks(rank)) | set(topo.tp_ranks(rank))
    for w in topo.lane_work(rank, plan):
        if w is not None:
            peers.update(w.cp_ranks)
    return sorted(peers)
