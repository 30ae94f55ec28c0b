"""``python -m parallel_runtime``: train a recipe, or run a diagnostic.

::

    python -m parallel_runtime --recipe R.yaml [--steps K] [--out DIR] [--set key=value ...] [--reference]
    python -m parallel_runtime selfcheck --world-size N [--tp T --cp C --cp-engine E ...]   # a layout vs one process
    python -m parallel_runtime profile --recipe R.yaml [--out cost.yaml ...]                 # calibrate the cost file
    python -m parallel_runtime estimate --recipe R.yaml [--steps K] --out DIR                # GPU memory, NCCL replay

The first word picks a diagnostic (``selfcheck``: :mod:`parallel_runtime.diagnostics.selfcheck`,
``profile``: :mod:`parallel_runtime.diagnostics.profile`, ``estimate``:
:mod:`parallel_runtime.diagnostics.estimate`; ``--help`` after it lists its options);
anything else is training. Real training runs are started by a launcher that sets RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK on every process::

    accelerate launch --multi_gpu --num_processes 4 -m parallel_runtime --recipe recipes/cpu-hetero.yaml

(without a GPU this still starts 4 processes; they join a gloo world). ``--reference`` runs the
same data and model in one process without parallelism and writes the same metrics. A run
whose ``--out`` holds a checkpoint resumes from it and appends to its ``metrics.jsonl``; one
whose ``--out`` holds metrics but no checkpoint is refused (``--fresh`` starts over). Rank 0
locks ``--out`` for the whole run: a second run on it exits 2 at once, naming the first.
Exit codes: 0 done, 2 bad input (one line naming the field), 1 a failure on some rank.

Every rank that stops says why in one line on stderr, prefixed with its rank in a world of
several: its own error (bad input on that rank, e.g. a checkpoint shard of another step, or a
crash), or ``rank R: stopped in <what> (group ranks [...]): rank F failed first (...)`` when a peer's
failure broke its collective, or ``rank R: timed out after T s in <what> (group ranks [...])``
when a peer stopped answering (``world.timeout_s`` holds for every process group).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback


def _selfcheck(argv: list[str]) -> int:
    from parallel_runtime.diagnostics.selfcheck import main as selfcheck_main

    return selfcheck_main(argv)


def _profile(argv: list[str]) -> int:
    from parallel_runtime.diagnostics.profile import main as profile_main

    return profile_main(argv)


def _estimate(argv: list[str]) -> int:
    from parallel_runtime.diagnostics.estimate import main as estimate_main

    return estimate_main(argv)


# the diagnostics are imported only when asked for: training never loads them
COMMANDS = {"selfcheck": _selfcheck, "profile": _profile, "estimate": _estimate}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime", description=__doc__.splitlines()[0],
                                 epilog="diagnostics: python -m parallel_runtime {selfcheck,profile,estimate} --help")
    ap.add_argument("--recipe", required=True, help="recipe YAML (see recipes/ and docs/runtime.md)")
    ap.add_argument("--steps", type=int, default=None, help="train until this global step (default: the recipe's)")
    ap.add_argument("--out", default=None, help="output folder: metrics.jsonl and checkpoint/ (default runs/<recipe>)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe field by dotted path, value as YAML (repeatable): --set seed=3")
    ap.add_argument("--reference", action="store_true",
                    help="one process, whole model, no parallelism: the same plans' docs (the exactness check)")
    ap.add_argument("--allow-changed", action="store_true",
                    help="a resume may change optimizer.lr, max_grad_norm, warmup_steps, weight_decay (reported)")
    ap.add_argument("--fresh", action="store_true",
                    help="start over in an --out that holds metrics.jsonl but no checkpoint (the old metrics are "
                         "replaced); without it such a folder is refused, never given a second history")
    return ap.parse_args(argv)


def default_out(recipe_path: str, reference: bool) -> str:
    name = os.path.splitext(os.path.basename(recipe_path))[0]
    return os.path.join("runs", name + ("-reference" if reference else ""))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    return train(argv)


def train(argv: list[str]) -> int:
    """Train a recipe on the launcher's world (or ``--reference`` in one process)."""
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    env_world = int(os.environ.get("WORLD_SIZE", "1"))

    def user_error(msg: str) -> int:
        who = f"rank {rank}: " if env_world > 1 else ""
        print(f"parallel_runtime: {who}error: {msg}", file=sys.stderr, flush=True)
        return 2

    from parallel_runtime.config import load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if args.steps is not None and args.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {args.steps}")
        if args.reference and env_world > 1:
            raise ValueError("--reference runs in one process; start it with python -m parallel_runtime, not "
                             f"a launcher with {env_world} processes")
        if not args.reference and env_world != recipe.world.size:
            if "WORLD_SIZE" not in os.environ:
                raise ValueError(f"world.size is {recipe.world.size}: start the run with accelerate launch "
                                 f"--multi_gpu --num_processes {recipe.world.size} -m parallel_runtime --recipe "
                                 f"{args.recipe} (or add --reference for the one-process check)")
            raise ValueError(f"world.size is {recipe.world.size} but {env_world} processes were started; use "
                             f"--num_processes {recipe.world.size} or --set world.size={env_world}")
    except ValueError as e:
        return user_error(str(e))
    out = args.out or default_out(args.recipe, args.reference)

    from parallel_runtime.training.trainer import Trainer

    if args.reference:
        try:
            Trainer(recipe, out, reference=True, allow_changed=args.allow_changed, fresh=args.fresh).train(args.steps)
        except ValueError as e:
            return user_error(str(e))
        return 0

    import torch.distributed as dist

    from parallel_runtime.launch import default_backend, failure_line, init_from_env, post_failure

    w = recipe.world
    backend = w.backend if w.backend != "auto" else default_backend(w.device)
    try:
        init_from_env(backend, w.timeout_s)
        _note_node_size(recipe, rank)
        trainer = Trainer(recipe, out, allow_changed=args.allow_changed, fresh=args.fresh)
        trainer.train(args.steps)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except ValueError as e:  # bad input on this rank: its peers name it when their collectives break
        post_failure(rank, f"error: {str(e).splitlines()[0] if str(e) else ''}")
        code = user_error(str(e))
    except Exception as e:  # a failure here, or a peer's seen through a broken / timed-out collective
        line = failure_line(e, rank)
        print(f"parallel_runtime: {line}", file=sys.stderr, flush=True)
        if os.environ.get("PARALLEL_RUNTIME_TRACEBACK"):
            traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no destroy_process_group: peers may be gone; background planner threads are not joined


def _note_node_size(recipe, rank: int) -> None:
    """On GPUs, say when the launcher's processes per node differ from the cost file's ``gpus_per_node``
    (the planner keeps TP groups and CP blocks inside a node of that size)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if rank != 0 or recipe.world.device != "cuda" or not local:
        return
    gpn = recipe.cost_model().gpus_per_node
    if int(local) != gpn:
        print(f"parallel_runtime: note: {local} processes per node but the cost file says gpus_per_node: {gpn}; "
              f"groups the planner keeps inside a node may cross nodes", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
