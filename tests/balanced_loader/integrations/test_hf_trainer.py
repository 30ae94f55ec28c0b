"""``BalancedTrainer``: 2 gloo ranks under ``accelerate launch`` train exactly like 1 process, a run stopped
after step 2 and resumed from its Trainer checkpoint equals the uninterrupted one, misuse is one line,
and TRL's ``SFTTrainer`` (where installed) trains the same model."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

tr = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from distributed import accelerate_launch, run_commands  # noqa: E402

from balanced_loader.cost import CostModel  # noqa: E402
from balanced_loader.integrations.transformers import (  # noqa: E402
    LOADER_STATE_NAME,
    BalancedTrainer,
    check_packed_attention,
)

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "hf_trainer.py"
COST = {"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0, "comm_bytes_per_token": 0,
        "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 256}


def _result(out: Path) -> tuple[list[float], dict]:
    losses = json.loads((out / "losses.json").read_text())
    return [losses[str(s)] for s in range(1, 5)], torch.load(out / "params.pt")


@pytest.mark.multirank
def test_two_ranks_and_a_resumed_run_equal_one_process(tmp_path):
    one, two, cut = tmp_path / "one", tmp_path / "two", tmp_path / "cut"
    run_commands([[sys.executable, str(EXAMPLE), "--out", str(one)],
                  [*accelerate_launch(2), str(EXAMPLE), "--out", str(two)],
                  [sys.executable, str(EXAMPLE), "--out", str(cut), "--stop-after", "2"]], tmp_path)
    state = json.loads((cut / "checkpoint-2" / LOADER_STATE_NAME).read_text())
    assert state["step"] == 2 and not (cut / "checkpoint-4").exists()
    run_commands([[sys.executable, str(EXAMPLE), "--out", str(cut), "--resume"]], tmp_path)
    ref_losses, ref_params = _result(one)
    for out, tol in ((two, 1e-5), (cut, 1e-7)):
        losses, params = _result(out)
        assert losses == pytest.approx(ref_losses, abs=tol)
        assert max(float((params[k] - ref_params[k]).abs().max()) for k in params) <= tol


def _model(impl: str = "sdpa"):
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              attn_implementation=impl, pad_token_id=0, eos_token_id=1))


def _docs() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(2, 128, int(n)).tolist() for n in np.clip(rng.lognormal(3.0, 1.0, 48), 4, 300)]


def _args(tmp_path, **kw):
    return tr.TrainingArguments(output_dir=str(tmp_path), max_steps=2, learning_rate=1e-3, logging_steps=1,
                                use_cpu=True, report_to=[], seed=0, save_strategy="no", **kw)


def test_misuse_is_one_line(tmp_path):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tr.AttentionInterface.register("custom_attn", sdpa_attention_forward)  # a user's kernel: no packed-doc masks
    lk = {"cost": CostModel.from_dict(COST), "global_batch_tokens": 1024}
    cases = [
        (dict(args=_args(tmp_path, gradient_accumulation_steps=2)), lk, "set gradient_accumulation_steps=1"),
        (dict(args=_args(tmp_path, average_tokens_across_devices=False)), lk, "average_tokens_across_devices=True"),
        (dict(args=_args(tmp_path), model=_model("custom_attn")), lk, "attention implementation 'custom_attn'"),
        (dict(args=_args(tmp_path)), {**lk, "rank": 0}, "loader_kwargs['rank']"),
        (dict(args=_args(tmp_path)), {**lk, "cp": 2}, "plain data parallelism (cp=1)"),
        (dict(args=_args(tmp_path)), {"cost": lk["cost"]}, "loader_kwargs needs 'global_batch_tokens'"),
    ]
    for kw, loader_kwargs, needle in cases:
        kw.setdefault("model", _model())
        with pytest.raises(ValueError, match=re.escape(needle)) as e:
            BalancedTrainer(train_source=_docs(), loader_kwargs=loader_kwargs, **kw)
        assert "\n" not in str(e.value)
    # a checkpoint that BalancedTrainer did not write cannot continue the data
    plain = tmp_path / "plain"
    (plain / "checkpoint-1").mkdir(parents=True)
    trainer = BalancedTrainer(model=_model(), args=_args(plain), train_source=_docs(), loader_kwargs=lk)
    with pytest.raises(ValueError, match=f"has no {LOADER_STATE_NAME}") as e:
        trainer.train(resume_from_checkpoint=str(plain / "checkpoint-1"))
    assert "\n" not in str(e.value)
    # what silently attends across packed docs
    model = _model()
    for inputs, needle in [({"attention_mask": torch.ones(1, 3)}, "an attention_mask with packed docs"),
                           ({"use_cache": True}, "use_cache=True with packed docs"),
                           ({}, "use_cache=True with packed docs")]:  # the config's default use_cache=True
        with pytest.raises(ValueError, match=needle):
            check_packed_attention(model, inputs)
    check_packed_attention(model, {"use_cache": False})


def test_trl_sft_trainer_trains_the_same_model(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models

    from balanced_loader.integrations.trl import BalancedSFTTrainer

    vocab = {f"t{i}": i for i in range(128)}
    tok = tr.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                     eos_token="t1", pad_token="t0", unk_token="t0")
    lk = {"cost": CostModel.from_dict(COST), "global_batch_tokens": 1024}
    # SFTConfig's own defaults differ from TrainingArguments' (bf16, activation checkpointing): the same ones here
    cfg = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2, learning_rate=1e-3, logging_steps=1,
                        use_cpu=True, report_to=[], seed=0, save_strategy="no", max_length=None, bf16=False,
                        gradient_checkpointing=False, shuffle_dataset=False)
    sft_model = _model()
    sft = BalancedSFTTrainer(model=sft_model, args=cfg, train_dataset=Dataset.from_dict({"input_ids": _docs()}),
                             processing_class=tok, loader_kwargs=lk)
    sft.train()
    assert any("mean_token_accuracy" in h for h in sft.state.log_history)  # TRL's metrics still come
    plain_model = _model()
    plain = BalancedTrainer(model=plain_model, args=_args(tmp_path / "plain"), train_source=sft.train_dataset,
                            loader_kwargs=lk)
    plain.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (sft, plain)]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], abs=1e-5)
    for (name, p), q in zip(sft_model.named_parameters(), plain_model.parameters()):
        assert float((p - q).detach().abs().max()) < 1e-5, name
    with pytest.raises(ValueError, match="set packing=False"):
        BalancedSFTTrainer(model=_model(), args=trl.SFTConfig(output_dir=str(tmp_path / "p"), packing=True,
                                                              max_steps=1, use_cpu=True, report_to=[], bf16=False),
                           train_dataset=Dataset.from_dict({"input_ids": _docs()}), processing_class=tok,
                           loader_kwargs=lk)
