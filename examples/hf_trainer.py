"""Hugging Face ``Trainer`` on a BalancedLoader: ``BalancedTrainer`` (tiny random Llama, synthetic docs).

    python examples/hf_trainer.py --out /tmp/t1
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py --out /tmp/t2   # 2 ranks, same result
    python examples/hf_trainer.py --out /tmp/t3 --max-steps 4 --stop-after 2 && \\
        python examples/hf_trainer.py --out /tmp/t3 --max-steps 4 --resume                 # = the uninterrupted run

Writes ``OUT/losses.json`` (the logged loss of every step) and ``OUT/params.pt`` on rank 0.
"""

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

import balanced_loader as bl
from balanced_loader.integrations.transformers import BalancedTrainer


class StopAfter(TrainerCallback):  # simulates a run killed after a checkpoint
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        control.should_training_stop = state.global_step >= self.step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--stop-after", type=int)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    rng = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 128, (int(n),), generator=rng).numpy()  # long-tailed lengths, 4..400 tokens
            for n in torch.empty(96).log_normal_(3.0, 1.0, generator=rng).clamp(4, 400)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    cost = bl.CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0, "comm_bytes_per_token": 0,
                                   "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 256})
    args = TrainingArguments(output_dir=a.out, max_steps=a.max_steps, learning_rate=1e-3, logging_steps=1, save_steps=2,
                             use_cpu=True, report_to=[], seed=0, ddp_find_unused_parameters=False)
    trainer = BalancedTrainer(model=model, args=args, train_source=docs, callbacks=[StopAfter(a.stop_after or a.max_steps)],
                              loader_kwargs={"cost": cost, "global_batch_tokens": 1024, "policy": "hydra"})
    trainer.train(resume_from_checkpoint=a.resume or None)
    if trainer.args.process_index == 0:
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        prev = os.path.join(a.out, "losses.json")
        if a.resume and os.path.exists(prev):
            losses = {**{int(k): v for k, v in json.load(open(prev)).items()}, **losses}
        json.dump(losses, open(prev, "w"))
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, os.path.join(a.out, "params.pt"))


if __name__ == "__main__":
    main()
