"""Hugging Face ``Trainer`` on a BalancedLoader: ``BalancedTrainer`` (tiny random Llama, synthetic docs).

    python examples/hf_trainer.py --out /tmp/t1
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py --out /tmp/t2   # 2 ranks, same result
    python examples/hf_trainer.py --out /tmp/t3 --stop-after 2 && python examples/hf_trainer.py --out /tmp/t3 --resume

Writes ``OUT/losses.json`` (the logged loss of every step, merged across a resume) and ``OUT/params.pt`` (rank 0).
"""

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

import balanced_loader as bl
from balanced_loader.integrations.transformers import BalancedTrainer


class StopAfter(TrainerCallback):
    """Ends the run after a step, as if it were killed there (a checkpoint is saved every 2 steps)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        control.should_training_stop = state.global_step >= self.step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stop-after", type=int)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)  # 96 docs of random tokens, long-tailed lengths 4..400
    docs = [torch.randint(1, 128, (int(n),), generator=g).numpy()
            for n in torch.empty(96).log_normal_(3.0, 1.0, generator=g).clamp(4, 400)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))

    # ---- the part that is about balanced-loader ----
    cost = bl.CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                                   "comm_bytes_per_token": 0, "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 256})
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, learning_rate=1e-3, logging_steps=1, save_steps=2,
                             use_cpu=True, report_to=[], seed=0, ddp_find_unused_parameters=False)
    trainer = BalancedTrainer(model=model, args=args, train_source=docs,
                              loader_kwargs={"cost": cost, "global_batch_tokens": 1024, "policy": "hydra"},
                              callbacks=[StopAfter(a.stop_after or a.steps)])
    trainer.train(resume_from_checkpoint=a.resume or None)  # True: the last checkpoint in --out, its batches next
    # ------------------------------------------------

    if trainer.args.process_index == 0:
        path = os.path.join(a.out, "losses.json")
        losses = {}
        if a.resume and os.path.exists(path):
            with open(path) as f:
                losses = {int(k): v for k, v in json.load(f).items()}
        losses.update({h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h})
        with open(path, "w") as f:
            json.dump(losses, f)
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, os.path.join(a.out, "params.pt"))


if __name__ == "__main__":
    main()
