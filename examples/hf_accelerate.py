"""A plain Hugging Face accelerate loop over a BalancedLoader (plain data parallelism, ``cp=1``).

The model is a tiny ``LlamaForCausalLM`` with random weights built from a config (nothing is
downloaded); the data are synthetic long-tailed docs of random token ids. Run it in one process
or under accelerate, e.g. on CPUs::

    python examples/hf_accelerate.py --steps 4 --out /tmp/hf1
    accelerate launch --multi_gpu --num_processes 2 examples/hf_accelerate.py --cpu --steps 4 --out /tmp/hf2
    python examples/hf_accelerate.py --steps 20 --log-with tensorboard --out /tmp/hf_tb  # then tensorboard --logdir

What a DDP loop needs from the loader, and where it comes from:

* ``cp=1``: every group is one lane (whole docs, no CP shards) and every rank gets the same
  number of microbatches per step (padding microbatches where it has fewer), so the DDP
  gradient all-reduce of the last microbatch never waits for a rank that has none.
* ``mb.to_hf()``: ``input_ids``, ``position_ids`` and unshifted ``labels`` as ``[1, T]`` tensors in
  the transformers convention (``mb.labels`` are already shifted: never pass those as ``labels=``).
* ``batch.num_valid_tokens``: the step's global number of targets, from the plan (no collective).
  Each rank's loss is its token sum divided by it, times the number of processes because DDP
  averages gradients over ranks: the summed gradient is then exactly the global mean's.

``--calibrate`` closes the loop: each rank times its microbatches (``bl.MicrobatchTimer``:
thread CPU time and wall time) and ``loader.observe(batch, timer.samples(), comm=torch.distributed)``
all-gathers them; every few steps the loader fits its cost model and a speed per rank, and plans with
them from the first step it has not planned yet (the same step on every rank), so a slow or shared
device gets less work.

``--out DIR`` writes ``rank{r}.json`` (losses, microbatch counts, speeds) and, on rank 0, ``params.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    p.add_argument("--docs", type=int, default=96, help="synthetic docs (default 96)")
    p.add_argument("--global-batch-tokens", type=int, default=1024, help="tokens per optimizer step (default 1024)")
    p.add_argument("--max-tokens-per-lane", type=int, default=256,
                   help="tokens one rank holds in one microbatch (the cost model's cap; default 256)")
    p.add_argument("--policy", default="hydra", help="planning policy (default hydra); cp=1 holds for every policy")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even where a GPU is present")
    p.add_argument("--log-with", choices=("tensorboard",), help="also log metrics through accelerate's trackers")
    p.add_argument("--out", help="folder for rank{r}.json, params.pt and the TensorBoard logs")
    p.add_argument("--calibrate", action="store_true",
                   help="time the microbatches and let the loader fit its cost model and per-rank speeds")
    p.add_argument("--hf-loss-check", action="store_true",
                   help="also compare transformers' own labels= loss with the manual loss on the first microbatch")
    args = p.parse_args(argv)
    for name in ("steps", "docs", "global_batch_tokens", "max_tokens_per_lane"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.log_with and not args.out:
        p.error("--log-with needs --out (the log folder)")
    return args


def synthetic_docs(n: int, vocab: int, seed: int) -> list[np.ndarray]:
    """Long-tailed doc lengths (most short, a few long), random token ids in ``[1, vocab)``."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(3.0, 1.0, size=n).astype(np.int64) + 2, 600)  # [n]
    return [rng.integers(1, vocab, size=int(k)).astype(np.int64) for k in lengths]


def tiny_llama(vocab: int, seed: int):
    """A 2-layer LlamaForCausalLM with random weights (same on every process: seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def token_loss_sum(logits, labels):
    """Sum of next-token cross entropies in the transformers convention (labels unshifted)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100, reduction="sum")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    import balanced_loader as bl
    from balanced_loader.integrations.transformers import check_packed_attention

    kw = {"cpu": args.cpu}
    if args.log_with:
        kw.update(log_with=args.log_with, project_dir=args.out)
    accelerator = Accelerator(**kw)
    vocab = 128
    cost = bl.CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                                   "comm_bytes_per_token": 0, "bandwidth_gbs": {2: 10.0},
                                   "max_tokens_per_lane": args.max_tokens_per_lane})
    # rank and world size come from accelerate's process group; cp=1: plain data parallelism
    loader = bl.wrap(synthetic_docs(args.docs, vocab, args.seed), policy=args.policy, cost=cost, cp=1,
                     global_batch_tokens=args.global_batch_tokens, seed=args.seed, epochs=None,
                     calibrate={"every": 2, "first": 2} if args.calibrate else False)
    model = tiny_llama(vocab, args.seed)
    # packed docs must not attend to each other: an implementation that ignores restarting position ids, an
    # attention_mask or a KV cache would let them (docs/hf.md); refuse that in one line
    check_packed_attention(model, {"use_cache": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    if args.log_with:
        accelerator.init_trackers("hf_accelerate", config={"policy": args.policy, "world_size": loader.world_size,
                                                           "global_batch_tokens": args.global_batch_tokens})
    record = {"rank": loader.rank, "world_size": loader.world_size, "losses": [], "microbatches": [],
              "padding": [], "hf_loss": None, "manual_loss": None, "speeds": []}
    bar = tqdm(total=args.steps, desc="train", disable=not accelerator.is_local_main_process)
    model.train()
    for batch in loader:
        if batch.step >= args.steps:
            break
        n = len(batch.microbatches)
        step_loss = torch.zeros((), device=accelerator.device)
        timer = bl.MicrobatchTimer(batch.step, loader.rank, cuda=accelerator.device.type == "cuda")
        for i, mb in enumerate(batch.microbatches):
            hf = mb.to_hf()
            ids, pos, labels = (hf[k].to(accelerator.device) for k in ("input_ids", "position_ids", "labels"))
            # gradients are all-reduced once per step: on the last microbatch (same index on every rank)
            sync = contextlib.nullcontext() if i == n - 1 else accelerator.no_sync(model)
            with sync, timer(mb):
                # use_cache=False: transformers finds the packed docs from position_ids only without a KV cache
                logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                loss = token_loss_sum(logits, labels) / batch.num_valid_tokens
                accelerator.backward(loss * accelerator.num_processes)  # DDP averages: undo it
            step_loss += loss.detach()
            if args.hf_loss_check and record["hf_loss"] is None and not mb.padding and mb.num_valid_tokens:
                with torch.no_grad():  # transformers' own labels= loss is the mean over the same targets
                    plain = accelerator.unwrap_model(model)
                    record["hf_loss"] = float(plain(**{k: v.to(accelerator.device) if torch.is_tensor(v) else v
                                                       for k, v in hf.items()}).loss) * mb.num_valid_tokens
                    record["manual_loss"] = float(token_loss_sum(
                        plain(input_ids=ids, position_ids=pos, use_cache=False).logits, labels))
        optimizer.step()
        optimizer.zero_grad()
        if args.calibrate:  # every rank's samples all-gathered; a fit every few steps, the same on every rank
            update = loader.observe(batch, timer.samples(), comm=torch.distributed)
            if update is not None:
                record["speeds"].append(update.speeds)
        total = float(accelerator.reduce(step_loss, reduction="sum"))  # the step's global mean loss
        record["losses"].append(total)
        record["microbatches"].append(n)
        record["padding"].append(sum(mb.padding for mb in batch.microbatches))
        if args.log_with:
            accelerator.log({"loss": total, "valid_tokens": batch.num_valid_tokens, "microbatches": n,
                             "planner_wait_s": batch.planner_wait_s}, step=batch.step)
        bar.update(1)
        bar.set_postfix(loss=f"{total:.4f}")
    bar.close()
    loader.close()
    if args.log_with:
        accelerator.end_training()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{loader.rank}.json"), "w") as f:
            json.dump(record, f)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            state = {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
            torch.save(state, os.path.join(args.out, "params.pt"))
    accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
