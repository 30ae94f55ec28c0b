"""Reliability III (issue 38), the HF integrations: token ids past the model's vocabulary are one line naming
the doc and the id, before the step that would embed them (was: the embedding's ``IndexError``), whatever the
source (samples through ``wrap``, a ``datasets.Dataset`` with its id range recorded, one without); a damaged
``balanced_loader_state.json`` is one line naming the file (was: a ``JSONDecodeError`` traceback)."""

from __future__ import annotations

import numpy as np
import pytest

tr = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")

from balanced_loader.cost import CostModel  # noqa: E402
from balanced_loader.integrations.transformers import LOADER_STATE_NAME, BalancedTrainer  # noqa: E402

COST = {"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0, "comm_bytes_per_token": 0,
        "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 256}
LK = {"cost": CostModel.from_dict(COST), "global_batch_tokens": 1024}


def _model():
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                              attn_implementation="sdpa", pad_token_id=0, eos_token_id=1))


def _docs(bad: int | None = None) -> list[list[int]]:
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, 128, int(n)).tolist() for n in np.clip(rng.lognormal(3.0, 1.0, 48), 4, 300)]
    if bad is not None:
        docs[17][5] = bad
    return docs


def _args(path, **kw):
    kw = {"max_steps": 2, "save_strategy": "no", **kw}
    return tr.TrainingArguments(output_dir=str(path), learning_rate=1e-3, use_cpu=True, report_to=[],
                                disable_tqdm=True, **kw)


def _data(kind: str):
    docs = _docs(bad=500)
    if kind == "samples":
        return docs
    feature = "int64" if kind == "dataset int64" else "uint16"  # uint16 is read zero-copy: no id range recorded
    feats = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(feature))})
    return datasets.Dataset.from_dict({"input_ids": docs}, features=feats)


@pytest.mark.parametrize("kind, needle", [
    ("samples", "sample 17 holds token id 500, outside vocab_size 128"),
    ("dataset int64", "holds token id 500 (recorded in its index; the first is id 500 in doc 17 (token 5 of it))"),
    ("dataset uint16", "doc 17 holds token id 500 (token 5 of it), outside the model's vocab_size 128"),
])
def test_token_ids_past_the_vocabulary_are_one_line_naming_the_doc(tmp_path, kind, needle):
    trainer = BalancedTrainer(model=_model(), args=_args(tmp_path), train_source=_data(kind), loader_kwargs=LK)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        trainer.train()  # was: IndexError: index out of range in self (the embedding)
    assert "\n" not in str(e.value)
    if kind != "dataset uint16":  # recorded or read before any step
        assert trainer.state.global_step == 0


def test_a_damaged_loader_state_names_its_file(tmp_path):
    out = tmp_path / "run"
    BalancedTrainer(model=_model(), args=_args(out, save_strategy="steps", save_steps=1), train_source=_docs(),
                    loader_kwargs=LK).train()
    state = out / "checkpoint-1" / LOADER_STATE_NAME
    good = state.read_text()
    for damaged, needle in ((good[: len(good) // 2], "is not JSON (line"), ("[1, 2]", "a JSON list"),
                            ('{"format": 1}', "not a BalancedLoader state")):
        state.write_text(damaged)
        trainer = BalancedTrainer(model=_model(), args=_args(out, max_steps=3), train_source=_docs(),
                                  loader_kwargs=LK)
        with pytest.raises(ValueError, match=f"the loader state {state}") as e:
            trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))  # was: JSONDecodeError, no file named
        assert needle in str(e.value) and "\n" not in str(e.value)
