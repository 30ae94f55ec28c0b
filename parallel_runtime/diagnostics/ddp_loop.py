"""The plain loop a user would write, as the yardstick of the runtime's speed and memory.

The benchmark setting of ``tools/bench_runtime_vs_ddp.py`` and ``tools/profile_runtime.py``: the
27.5M-parameter decoder 512x8 (:data:`NATIVE` for the runtime's own model, :data:`LLAMA` for the same
shape as a transformers ``LlamaForCausalLM``), the stdlib corpus, 8,192 tokens per step, microbatches
capped at 1,024 tokens, hydra, 2 gloo ranks of one thread (:func:`recipe_text`). The loop is what
``examples/hf_accelerate.py`` does: the Llama with ``sdpa`` attention on the same loader with ``cp=1``
and ``mb.to_hf()``, DDP's gradient all-reduce on the last microbatch (``no_sync`` before),
``clip_grad_norm_`` and torch's ``AdamW`` with the recipe's settings.

* :class:`PlainLoop` holds the loop in one process: :meth:`PlainLoop.with_accelerate` as a user writes
  it (``accelerate launch -m parallel_runtime.diagnostics.ddp_loop --recipe R --steps N``, one line per
  step on rank 0), :meth:`PlainLoop.with_ddp` with torch's ``DistributedDataParallel`` directly (what
  ``accelerator.prepare`` wraps the model in), inside an existing process group, so the profiler can run
  the runtime's and the loop's steps alternately in the same processes.
* :func:`pair_ratios` / :func:`format_pairs`: the runtime's tokens/s over the loop's, pair by pair.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Callable
from typing import Any

NATIVE = {"vocab_size": 256, "hidden": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8, "ffn_hidden": 1536}
# the same decoder as a transformers Llama (RMSNorm eps, untied head; RoPE theta 1e4 is transformers' default)
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 512, "intermediate_size": 1536,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
         "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}


def recipe_text(*, steps: int, shards: str, hf: bool, cost_file: str, tokens: int = 8192, cap: int = 1024) -> str:
    """The benchmark's recipe (JSON is YAML): either model, and the loader settings the loop reuses
    (``cost_file``: the repository's ``recipes/cost-cpu-tiny.yaml``)."""
    rec = {"seed": 0, "steps": steps,
           "data": {"source": "stdlib", "shards_dir": shards, "global_batch_tokens": tokens, "max_seq_len": 1024,
                    "long_docs": "truncate"},
           "model": {"hf": LLAMA} if hf else NATIVE,
           "policy": {"name": "hydra"},
           "cost": {"file": str(cost_file), "lane_caps": {"1x1": cap}},
           "world": {"size": 2, "device": "cpu", "threads": 1, "timeout_s": 600},
           "optimizer": {"lr": 3e-3, "max_grad_norm": 1.0},
           "train": {"attention": "auto"}}
    return json.dumps(rec, indent=1)


class PlainLoop:
    """The Llama of :data:`LLAMA` trained on a recipe's loader with ``cp=1``, one optimizer step per :meth:`step`."""

    def __init__(self, recipe_path: str, *, wrap: Callable, rank: int | None = None,
                 world: int | None = None) -> None:
        """``wrap(model, optimizer) -> (model, optimizer, backward, no_sync, clip)``: how the loop is distributed.
        ``rank``/``world``: the loader's (default: the initialized process group's)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM  # the loop is transformers' own model

        import balanced_loader as bl
        from parallel_runtime.config import load_recipe

        r = load_recipe(recipe_path)
        d, o = r.data, r.optimizer
        self.max_grad_norm = o.max_grad_norm
        world_kw = {} if world is None else {"world_size": world, "rank": rank}
        self.loader = bl.BalancedLoader(bl.open_source(d.shards_dir), policy=r.policy.name, cost=r.cost_model(),
                                        cp=1, global_batch_tokens=d.global_batch_tokens, seed=r.seed,
                                        max_seq_len=d.max_seq_len, long_docs=d.long_docs, epochs=None, **world_kw)
        spec = dict(LLAMA)
        cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
        torch.manual_seed(r.seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        self.model, self.optimizer, self._backward, self._no_sync, self._clip = wrap(model, opt)
        self.model.train()
        self._batches = iter(self.loader)

    @classmethod
    def with_accelerate(cls, recipe_path: str) -> PlainLoop:
        """The loop as ``examples/hf_accelerate.py`` writes it (run under ``accelerate launch``)."""
        import torch
        from accelerate import Accelerator

        torch.set_num_threads(1)
        acc = Accelerator(cpu=True)

        def wrap(model, opt):
            model, opt = acc.prepare(model, opt)
            return model, opt, acc.backward, lambda: acc.no_sync(model), acc.clip_grad_norm_

        loop = cls(recipe_path, wrap=wrap)
        loop.accelerator = acc
        return loop

    @classmethod
    def with_ddp(cls, recipe_path: str, *, rank: int, world: int) -> PlainLoop:
        """The loop with torch's DDP directly, in the calling process's (already initialized) gloo world."""
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        def wrap(model, opt):
            ddp = DDP(model)
            return ddp, opt, lambda loss: loss.backward(), ddp.no_sync, torch.nn.utils.clip_grad_norm_

        return cls(recipe_path, wrap=wrap, rank=rank, world=world)

    def step(self) -> tuple[Any, Any]:
        """One optimizer step on the loader's next batch: ``(batch, this rank's loss sum as a 0-d tensor)``.
        Its phases are profiler ranges (``phase:data_wait``, ``phase:forward_backward``, ``phase:optimizer``:
        free unless a profiler runs), the names of the runtime's ``time_ms`` phases."""
        import torch
        import torch.distributed as dist
        from torch.profiler import record_function

        with record_function("phase:data_wait"):
            batch = next(self._batches)
        n = len(batch.microbatches)
        loss_sum = torch.zeros(())
        world = dist.get_world_size()
        with record_function("phase:forward_backward"):
            for i, mb in enumerate(batch.microbatches):
                hf = mb.to_hf()
                with contextlib.nullcontext() if i == n - 1 else self._no_sync():
                    # transformers' own loss: the token sum over num_items_in_batch (the step's global targets);
                    # x processes because DDP averages the gradients over ranks
                    loss = self.model(input_ids=hf["input_ids"], position_ids=hf["position_ids"],
                                      labels=hf["labels"], num_items_in_batch=batch.num_valid_tokens,
                                      use_cache=False).loss
                    self._backward(loss * world)
                loss_sum += loss.detach()
        with record_function("phase:optimizer"):
            self._clip(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return batch, loss_sum

    def close(self) -> None:
        self.loader.close()


def run_accelerate(recipe_path: str, steps: int) -> None:
    """``steps`` steps of :meth:`PlainLoop.with_accelerate`; rank 0 prints ``step S  loss L  tokens T`` per step."""
    loop = PlainLoop.with_accelerate(recipe_path)
    acc = loop.accelerator
    try:
        for _ in range(steps):
            batch, loss_sum = loop.step()
            total = float(acc.reduce(loss_sum, reduction="sum"))
            if acc.is_main_process:
                print(f"step {batch.step:4d}  loss {total:.5f}  tokens {batch.plan.tokens:6d}", flush=True)
    finally:
        loop.close()
    acc.wait_for_everyone()


def pair_ratios(times: dict[str, list[float]]) -> list[float]:
    """Per pair the loop's step time over the runtime's: the runtime's tokens/s over the loop's (same tokens)."""
    return [lo / rt for rt, lo in zip(times["runtime"], times["loop"], strict=True)]


def format_pairs(times: dict[str, list[float]], what: str) -> str:
    """Both step times per pair, the ratios and their median (three lines)."""
    ratios = pair_ratios(times)
    return (f"interleaved, {what}: runtime steps {[round(x, 2) for x in times['runtime']]}\n"
            f"{' ' * (len(what) + 14)}loop steps    {[round(x, 2) for x in times['loop']]}\n"
            f"tokens/s runtime / loop per pair {[round(x, 3) for x in ratios]}; median "
            f"{statistics.median(ratios):.3f} (step medians {statistics.median(times['runtime']):.2f} s / "
            f"{statistics.median(times['loop']):.2f} s)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m parallel_runtime.diagnostics.ddp_loop",
                                 description="The plain accelerate DDP loop on a recipe's loader (cp=1), "
                                             "under accelerate launch.")
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--steps", type=int, required=True)
    a = ap.parse_args(argv)
    run_accelerate(a.recipe, a.steps)


if __name__ == "__main__":
    main()
