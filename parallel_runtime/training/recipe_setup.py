"""What a recipe's run opens before its first step: its device, its source and its loader.

One home for the recipe -> data wiring that the trainer, the estimate (``diagnostics/estimate.py``) and the
profiler (``diagnostics/profile.py``) share, so all of them plan the same steps from the same recipe.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from balanced_loader.loader import BalancedLoader
from parallel_runtime.config import STDLIB, Recipe, WorldConfig
from parallel_runtime.launch import new_group, phase


def run_device(world: WorldConfig, local_rank: int) -> torch.device:
    """This process's device for ``world.device``: CUDA device ``local_rank`` mod the visible ones (made the
    current one), or the CPU with ``world.threads`` threads."""
    if world.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("world.device is cuda but torch sees no CUDA device; use --set world.device=cpu")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(world.threads)
    return torch.device("cpu")


def open_data(recipe: Recipe, *, build: bool):
    """The recipe's source; ``build``: this process may build the stdlib corpus (one per machine)."""
    from balanced_loader.data.open import open_source

    d = recipe.data
    if d.mixture:  # several sources at set shares (balanced_loader.mix)
        from balanced_loader.data.mixture import mix

        return mix({e.name: recipe.resolve(e.source) for e in d.mixture}, weights={e.name: e.weight for e in d.mixture},
                   by=d.mixture_by)
    if d.source == STDLIB:
        from balanced_loader.build.corpus import stdlib_shards
        from balanced_loader.data.shards import ShardSource

        return stdlib_shards(d.shards_dir, limit=d.stdlib_limit) if build else ShardSource(d.shards_dir)
    return open_source(recipe.resolve(d.source), read_timeout_s=d.read_timeout_s)


def recipe_loader(recipe: Recipe, source, policy: str, *, rank: int, cost=None, calibrate: bool = False,
                  prefetch_steps: int | None = None, epochs: int | None = None) -> BalancedLoader:
    """The loader a recipe's run plans with (the trainer's, ``diagnostics.estimate``'s and the profiler's held-out
    cases: the same plans); ``epochs=None``: endless, as training."""
    r, d = recipe, recipe.data
    return BalancedLoader(source, policy=policy, cost=cost if cost is not None else r.cost_model(),
                          world_size=r.world.size, rank=rank, global_batch_tokens=d.global_batch_tokens, seed=r.seed,
                          max_seq_len=d.max_seq_len, long_docs=d.long_docs, shuffle=d.shuffle,
                          shuffle_window=d.shuffle_window, epochs=epochs,
                          prefetch_steps=d.prefetch_steps if prefetch_steps is None else prefetch_steps,
                          planner_workers=d.planner_workers, plan_config=r.plan_config(policy),
                          cp_inner=r.loader_cp_inner(), order=d.order,
                          calibrate=r.calibration if calibrate else False)


DATA_BUILD_TIMEOUT_S = 3600.0  # how long ranks wait for the bundled corpus to be built (not world.timeout_s)


def open_data_world(recipe: Recipe, *, rank: int, local_rank: int):
    """The recipe's source on every rank of a world: the stdlib corpus is built once while the others wait.

    Rank 0 builds it first; then local rank 0 of every other node checks it (a shared file system
    finds it done) or builds its own copy; then the other ranks open it. The waits are barriers of a
    gloo group with a long timeout (building takes longer than a collective may): a builder that
    fails ends its waiting peers through the broken barrier, never a hang."""
    if recipe.data.source != STDLIB or recipe.data.mixture:
        return open_data(recipe, build=False)
    wait = new_group(range(dist.get_world_size()), backend="gloo", timeout_s=DATA_BUILD_TIMEOUT_S)
    source = None  # a builder keeps what it built (the same ShardSource a plain open gives)
    with phase("building the stdlib corpus (data.shards_dir)", [0]):
        if rank == 0:
            source = open_data(recipe, build=True)
        dist.barrier(group=wait)
        if local_rank == 0 and rank != 0:
            source = open_data(recipe, build=True)
        dist.barrier(group=wait)
    dist.destroy_process_group(wait)
    return source if source is not None else open_data(recipe, build=False)
