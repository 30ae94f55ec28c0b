"""Dynamic context parallelism in your own accelerate loop: a transformers model on the loader's default plans.

The loader plans every step with hydra: long docs are spread over CP groups of 2, 4, ... lanes,
a different degree per microbatch; ``enable_context_parallel`` runs each microbatch's attention
over its group (ring; Ulysses / nested with ``--cp-inner``). Tiny random Llama, synthetic
long-tailed docs, nothing downloaded::

    python examples/hf_dynamic_cp.py --out /tmp/cp1                                # one process
    accelerate launch --multi_gpu --num_processes 4 examples/hf_dynamic_cp.py --cpu --out /tmp/cp4
    accelerate launch --multi_gpu --num_processes 4 examples/hf_dynamic_cp.py --cpu --cp-inner 2 --out /tmp/cpn

The runs train the same model: losses and parameters equal within 1e-5 (``OUT/rank{r}.json``:
losses and each step's microbatch degrees; ``OUT/params.pt`` on rank 0).
"""

import argparse
import contextlib
import json
import os

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import balanced_loader as bl
from parallel_runtime.integrations import enable_context_parallel

MAX_SEQ_LEN = 512  # the same docs (cut at the same length) whatever the number of processes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cp-inner", type=int, default=1, help="Ulysses size inside a ring (1: ring only)")
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args()
    accelerator = Accelerator(cpu=a.cpu)
    world = accelerator.num_processes
    g = torch.Generator().manual_seed(0)  # 48 docs of random tokens, long-tailed lengths 8..512
    docs = [torch.randint(1, 128, (int(n),), generator=g).numpy()
            for n in torch.empty(48).log_normal_(4.5, 1.0, generator=g).clamp(8, MAX_SEQ_LEN)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))

    # ---- the part that is about balanced-loader: hydra plans, CP groups per microbatch ----
    lane = -(-MAX_SEQ_LEN // world)  # a lane holds 1/world of the longest doc: long docs need CP groups
    cost = bl.CostModel.from_dict({"quadratic_ms": 1e-3, "linear_ms": 0.01, "microbatch_ms": 0.5,
                                   "max_tokens_per_lane": lane, "comm_bytes_per_token": 100,
                                   "bandwidth_gbs": {2: 10.0}})
    # hydra's load-target placement alone ("portfolio": off): on a batch this small its portfolio would put every
    # doc on all 4 lanes, and this example shows CP groups of several degrees
    loader = bl.wrap(docs, policy="hydra", cost=cost, global_batch_tokens=2048, max_seq_len=MAX_SEQ_LEN,
                     cp_inner=a.cp_inner, seed=0, epochs=None,  # rank and world size: accelerate's
                     plan_config={"extra": {"portfolio": False}})
    bind = enable_context_parallel(model, cp_inner=a.cp_inner, max_seq_len=MAX_SEQ_LEN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    record = {"losses": [], "degrees": []}
    for batch in loader:
        if batch.step >= a.steps:
            break
        mbs = bind.microbatches(batch)  # at least one per rank (a DDP backward everywhere)
        step_loss = torch.zeros(())
        for i, mb in enumerate(mbs):
            sync = contextlib.nullcontext() if i == len(mbs) - 1 else accelerator.no_sync(model)
            with sync, bind(mb, plan=batch.plan):
                hf = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in mb.to_hf().items()}
                loss = model(**hf, num_items_in_batch=batch.num_valid_tokens).loss  # token sum / global valid tokens
                accelerator.backward(loss * world)  # DDP averages over ranks: undo it
            step_loss += loss.detach().cpu()
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(float(accelerator.reduce(step_loss.to(accelerator.device), reduction="sum")))
        record["degrees"].append([g.degree for pool in batch.plan.pools for m in pool.microbatches for g in m])
    # ---------------------------------------------------------------------------------------

    loader.close()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    if accelerator.is_main_process:
        state = {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save(state, os.path.join(a.out, "params.pt"))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
