"""``parallel_runtime.hf.enable_context_parallel``: dynamic CP for a transformers model in the user's own loop.

In one process: a bound microbatch runs exactly like the model's own sdpa attention on the same packed
docs (loss and gradients), and misuse is one line. On 4 gloo ranks under ``accelerate launch``:
``examples/hf_dynamic_cp.py`` on the loader's hydra plans (CP groups of 2 and 4 lanes) equals one process.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

tr = pytest.importorskip("transformers")

from distributed import accelerate_launch, run_commands  # noqa: E402

from balanced_loader.cost import CostModel  # noqa: E402
from balanced_loader.wrapping import wrap  # noqa: E402
from parallel_runtime.integrations import enable_context_parallel  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "hf_dynamic_cp.py"
COST = {"quadratic_ms": 1e-3, "linear_ms": 0.01, "microbatch_ms": 0.5, "comm_bytes_per_token": 100,
        "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 256}


def _model(impl: str = "sdpa"):
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                         attn_implementation=impl)
    return tr.LlamaForCausalLM(cfg)


def _microbatch():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 128, int(n)) for n in (30, 7, 60, 3, 41, 12)]
    ld = wrap(docs, policy="hydra", cost=CostModel.from_dict(COST), world_size=1, rank=0, global_batch_tokens=4096,
              seed=0)
    batch = next(iter(ld))
    ld.close()
    return batch, max(batch.microbatches, key=lambda m: len(m.seq_lengths))


def test_a_bound_microbatch_equals_the_models_own_attention():
    batch, mb = _microbatch()
    assert len(mb.seq_lengths) > 2
    ref, model = _model(), _model()
    bind = enable_context_parallel(model)
    assert model.config._attn_implementation == "bl_cp"
    losses = []
    for m, ctx in ((ref, None), (model, bind)):
        hf = mb.to_hf()
        if ctx is None:
            out = m(**hf, num_items_in_batch=batch.num_valid_tokens)
        else:
            with ctx(mb):
                out = m(**hf, num_items_in_batch=batch.num_valid_tokens)
        out.loss.backward()
        losses.append(float(out.loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
    bind.disable()
    assert model.config._attn_implementation == "sdpa"
    model(**mb.to_hf())  # the model's own attention again: no binding needed


def test_misuse_is_one_line():
    batch, mb = _microbatch()
    model = _model()
    bind = enable_context_parallel(model)
    hf = mb.to_hf()
    cases = [(lambda: model(**hf), "inside `with bind(mb):`"),
             (lambda: _call(bind, mb, model, {**hf, "attention_mask": torch.ones_like(hf["input_ids"])}),
              "attention_mask with enable_context_parallel"),
             (lambda: _call(bind, mb, model, {**hf, "use_cache": True}), "use_cache=True"),
             (lambda: bind(object()).__enter__(), "takes a balanced_loader Microbatch"),
             (lambda: enable_context_parallel(torch.nn.Linear(2, 2)), "takes a transformers model"),
             (lambda: enable_context_parallel(_model(), cp_inner=0), "cp_inner must be an integer >= 1")]
    for fn, needle in cases:
        with pytest.raises(ValueError, match=re.escape(needle)) as e:
            fn()
        assert "\n" not in str(e.value)
    with bind(mb), pytest.raises(ValueError, match="already active"), bind(mb):
        pass


def test_a_rank_without_microbatches_gets_one_padding_microbatch():
    from types import SimpleNamespace

    from balanced_loader.plan import Group, Pool, StepPlan

    plan = StepPlan(step=0, world_size=2, pools=(Pool(tp=1, pp=1, ranks=((0, 1),),
                                                        microbatches=((Group(lanes=(0,), segments=((0, 0, 5),)),),)),))
    bind = enable_context_parallel(_model())
    (mb,) = bind.microbatches(SimpleNamespace(microbatches=(), plan=plan, rank=1))
    assert mb.padding and mb.lane == 1 and mb.num_valid_tokens == 0 and mb.to_hf()["input_ids"].shape == (1, 1)
    bind.disable()


def _call(bind, mb, model, kw):
    with bind(mb):
        return model(**kw)


@pytest.mark.multirank
def test_dynamic_cp_loop_on_four_ranks_equals_one_process(tmp_path):
    one, four = tmp_path / "one", tmp_path / "four"
    run_commands([[sys.executable, str(EXAMPLE), "--cpu", "--out", str(one)],
                  [*accelerate_launch(4), str(EXAMPLE), "--cpu", "--out", str(four)]], tmp_path)
    ref = json.loads((one / "rank0.json").read_text())
    ranks = [json.loads((four / f"rank{r}.json").read_text()) for r in range(4)]
    assert len(ref["losses"]) == 4 and all(d == 1 for step in ref["degrees"] for d in step)
    # hydra spread docs over CP groups of 2 and 4 lanes, in every step
    assert all(max(step) >= 2 for step in ranks[0]["degrees"]) and {4, 2} <= {d for s in ranks[0]["degrees"] for d in s}
    for rec in ranks:
        assert rec["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    p1, p4 = torch.load(one / "params.pt"), torch.load(four / "params.pt")
    assert max(float((p1[k] - p4[k]).abs().max()) for k in p1) < 1e-5
