"""Elastic, all-or-nothing training checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``OUT/checkpoint/``::

    latest                 the name of the newest complete checkpoint (replaced atomically)
    step-00000006/         one complete checkpoint
      .metadata            DCP's index of the chunks
      __R_0.distcp         rank R's chunks (DCP's file names)
      meta.json            step, loader cursors, the recipe, every file's size (written last)

**Sharded and elastic.** The optimizer's three flat fp32 buffers (master weights and the AdamW
moments) are saved as global 1-D tensors of ``layout.numel`` elements: rank r contributes its
owned range ``[r * shard_size, min((r + 1) * shard_size, numel))`` as a ``DTensor`` sharded on
dim 0 over a 1-D device mesh of the world (the same cut as ``torch.chunk``; the zero padding is
not saved). Loading builds the same DTensors for *this* world's layout and DCP reads each rank's
new range from whichever files hold it, so a checkpoint of N processes resumes on M (the shard
size ``ceil(numel / M)`` and the padding differ). The loader's cursor is elastic as well.

**Complete or absent.** Every rank writes into ``step-N.tmp/``; rank 0 then writes
``meta.json`` (with the size of every file), renames the folder to ``step-N/`` and replaces
``latest``. A run killed while saving leaves a ``.tmp`` folder that no one reads (it is removed
at the next save) and resumes from the previous checkpoint; a checkpoint whose files do not
have the sizes ``meta.json`` lists is refused.

**Compatible or refused.** :func:`compare_recipes` checks the recipe a run resumes with against
the one stored in ``meta.json``: keys that change the math or the weights' meaning (the model,
the data, the seed, AdamW's betas/eps, ...) are refused in one line naming the key; settings of
the run itself (logging, checkpoint interval, ``world.*`` now that resume is elastic, the cost
model and pool layout, paths) are free; learning rate and clipping changes need
``--allow-changed`` and are reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from balanced_loader.outputs.files import fsync_dir, read_json, write_text
from parallel_runtime.launch import is_comm_error
from parallel_runtime.training.optimizer import ShardedOptimizer

FORMAT = 2
META = "meta.json"
LATEST = "latest"
BUFFERS = ("master", "exp_avg", "exp_avg_sq")  # the optimizer's flat fp32 shards, saved as global tensors

# recipe keys (dotted, or a section prefix ending in ".") a resume may change freely: how the run is
# executed, logged and laid out, never what it computes
FREE = ("steps", "world.", "cost.", "train.checkpoint_every", "train.attention", "train.calibrate", "train.trace",
        "train.overlap", "calibration.", "policy.extra",
        "policy.time_limit_s", "policy.candidates", "policy.plan_source", "policy.compare", "data.shards_dir",
        "data.prefetch_steps", "data.planner_workers", "data.read_timeout_s")
# keys a resume may change only with --allow-changed (the schedule, not the state's meaning)
FLAGGED = ("optimizer.lr", "optimizer.max_grad_norm", "optimizer.warmup_steps", "optimizer.weight_decay")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True, kw_only=True)
class Saved:
    """A checkpoint found under ``OUT/checkpoint`` (its meta file read and its files checked)."""

    folder: str
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


# ---- the optimizer shards as DCP tensors ------------------------------------------------------


def _owned(opt: ShardedOptimizer) -> tuple[int, int]:
    """This rank's range of the unpadded flat buffer (empty for a rank holding only padding)."""
    lay = opt.layout
    lo = min(opt.rank * lay.shard_size, lay.numel)
    return lo, min(lo + lay.shard_size, lay.numel)


def _state(opt: ShardedOptimizer, distributed: bool) -> dict[str, torch.Tensor]:
    """``optimizer.<buffer>`` -> a view of this rank's owned part as a global ``[numel]`` tensor.

    Distributed: a DTensor ``Shard(0)`` over the world (uneven: ``torch.chunk``'s cut, which is the
    layout's ``ceil(numel / world)`` shards). One process: the buffer's first ``numel`` elements.
    """
    lo, hi = _owned(opt)
    numel = opt.layout.numel
    if not distributed:
        return {f"optimizer.{b}": getattr(opt, b)[:numel] for b in BUFFERS}
    # torch.distributed.tensor is imported here: only distributed checkpoints need it
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(opt.device.type, (dist.get_world_size(),))
    return {f"optimizer.{b}": DTensor.from_local(getattr(opt, b)[: hi - lo], mesh, [Shard(0)], run_check=False,
                                                 shape=(numel,), stride=(1,)) for b in BUFFERS}


# ---- save ---------------------------------------------------------------------------------------


def save(root: str, step: int, opt: ShardedOptimizer, meta: Mapping[str, Any], *, rank: int,
         distributed: bool) -> str:
    """Write checkpoint ``root/step-N`` (collective): the optimizer shards with DCP, then (rank 0)
    ``meta.json``, the rename from ``step-N.tmp`` and ``latest``; older checkpoints are removed.
    ``meta``: the run's own entries (loader cursors, recipe); returns the folder."""
    import torch.distributed.checkpoint as dcp  # loaded only when a run checkpoints

    name = step_name(step)
    tmp, final = os.path.join(root, name + ".tmp"), os.path.join(root, name)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        keep = _latest_name(root)
        for entry in os.listdir(root):  # leftovers of a killed save, a step newer than latest
            if entry.startswith("step-") and entry != keep:
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        os.makedirs(tmp)
    if distributed:
        dist.barrier()
    with _quiet():
        dcp.save(_state(opt, distributed), checkpoint_id=tmp, no_dist=not distributed)
    if distributed:
        dist.barrier()  # every rank's files are written before rank 0 lists them
    if rank == 0:
        files = {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
        full = {"format": FORMAT, "step": step, "numel": opt.layout.numel, "optimizer_steps": opt.steps,
                **meta, "files": files}
        write_text(os.path.join(tmp, META), json.dumps(full, indent=1, default=list))
        os.replace(tmp, final)
        fsync_dir(root)
        write_text(os.path.join(root, LATEST), name + "\n")
        for entry in os.listdir(root):
            if entry.startswith("step-") and entry != name:
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    if distributed:
        dist.barrier()
    return final


# ---- find, check, load -------------------------------------------------------------------------


def find(root: str) -> Saved | None:
    """The checkpoint ``root/latest`` names, its meta read and every file's size checked; ``None``
    when there is none. ValueError (one line) for an old format or a damaged checkpoint."""
    name = _latest_name(root)
    if name is None:
        return None
    folder = os.path.join(root, name)
    fix = "restore it or start a new --out"
    meta_path = os.path.join(folder, META)
    if not os.path.isfile(meta_path):
        raise ValueError(f"checkpoint {folder} is incomplete: {META} is missing; {fix}")
    meta = read_json(meta_path, "checkpoint meta file", fix=f"the checkpoint is damaged; {fix}")
    if not isinstance(meta, dict):
        raise ValueError(f"checkpoint {folder} is damaged: {META} is not a mapping; {fix}")
    if "format" not in meta and meta.get("version") == 1:
        raise ValueError("checkpoint format 1 from an older version; start a new --out")
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {folder} has format {meta.get('format')!r}; this version reads format "
                         f"{FORMAT}; start a new --out")
    for f, size in meta["files"].items():
        path = os.path.join(folder, f)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {folder} is incomplete: {f} is missing; {fix}")
        if os.path.getsize(path) != size:
            raise ValueError(f"checkpoint {folder} is damaged: {f} has {os.path.getsize(path)} bytes, "
                             f"{META} lists {size}; {fix}")
    return Saved(folder=folder, meta=meta)


def load_optimizer(saved: Saved, opt: ShardedOptimizer, *, distributed: bool) -> None:
    """Read this rank's range of the saved global buffers into ``opt`` (collective): any world size."""
    import torch.distributed.checkpoint as dcp  # loaded only when a run resumes

    if saved.meta["numel"] != opt.layout.numel:
        raise ValueError(f"checkpoint {saved.folder} holds {saved.meta['numel']} parameters, this model "
                         f"{opt.layout.numel}; it is of another model: start a new --out")
    state = _state(opt, distributed)
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=saved.folder, no_dist=not distributed)
    except Exception as e:  # DCP gathers every rank's read errors: all ranks fail alike
        if is_comm_error(RuntimeError(str(e))):  # a peer failed during the collective load: the launcher names it
            raise RuntimeError(str(e)) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"checkpoint {saved.folder} cannot be read ({first[:200]}); restore it or start a "
                         f"new --out") from None
    lo, hi = _owned(opt)
    for b in BUFFERS:
        got = state[f"optimizer.{b}"]
        got = got.to_local() if distributed else got
        buf = getattr(opt, b)
        if got.data_ptr() != buf.data_ptr():  # DCP read into a copy: move it into place
            buf[: hi - lo].copy_(got)
        buf[hi - lo:].zero_()  # the padding stays zero (it enters no norm or update)
    opt.steps = int(saved.meta["optimizer_steps"])


def compare_recipes(saved: Mapping[str, Any], now: Mapping[str, Any], *, allow_changed: bool,
                    where: str) -> list[str]:
    """Check the recipe a run resumes with (``now``, :func:`dump_recipe`) against the checkpoint's.

    Returns one line per allowed change of a :data:`FLAGGED` key; ValueError (one line naming the
    key) for a change of any key not in :data:`FREE` (unknown keys included: refusing is the safe
    default), or of a flagged key without ``allow_changed``."""
    old, new = _flatten(saved), _flatten(now)
    notes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a == b or any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE):
            continue
        if key in FLAGGED:
            if not allow_changed:
                raise ValueError(f"{key} is {b!r} in the recipe but {a!r} in checkpoint {where}; pass "
                                 f"--allow-changed to resume with the new value, or set it back")
            notes.append(f"resume: {key} changed from {a!r} to {b!r} (--allow-changed)")
            continue
        raise ValueError(f"{key} is {b!r} in the recipe but {a!r} in checkpoint {where}: it changes what the "
                         f"run computes; set it back to {a!r} or start a new --out")
    return notes


# ---- helpers --------------------------------------------------------------------------------------


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of nested mappings; lists and tuples compare as lists (JSON has no tuples)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and not key.startswith(("policy.extra", "cost.lane_caps")):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = json.loads(json.dumps(v, default=list))
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's notice that a one-process (``--reference``) save runs without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _latest_name(root: str) -> str | None:
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    if not name.startswith("step-") or os.sep in name:
        raise ValueError(f"{path} does not name a checkpoint ({name[:40]!r}); restore it or start a new --out")
    return name
