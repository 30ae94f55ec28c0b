"""Reliability III (issue 38), mixtures in the runtime: weights of 1e308 train at equal shares (was a
``TypeError`` and an empty ``--out``), a share under one token per step is one line, and ``data.mixture: []``
is an error, not a silent run on the standard-library corpus."""

from __future__ import annotations

import os

import pytest
from test_mixture_recipe import HETERO, folders, raw  # noqa: F401  (folders: the fixture)

from parallel_runtime.config import recipe_from_dict
from parallel_runtime.training.metrics import read_metrics


def test_weights_of_1e308_train_at_equal_shares(folders, tmp_path) -> None:  # noqa: F811
    from parallel_runtime.training.trainer import Trainer

    mixture = f"data.mixture=[{{name: prose, source: {folders['prose']}, weight: 1e308}}, " \
              f"{{name: code, source: {folders['code']}, weight: 1e308}}]"
    r = recipe_from_dict(raw(folders, mixture, "train.checkpoint_every=0", "data.max_seq_len=256",
                             "data.global_batch_tokens=2048"), HETERO)
    Trainer(r, str(tmp_path / "run"), reference=True).train(2)
    rows = read_metrics(os.path.join(tmp_path, "run", "metrics.jsonl"))
    assert len(rows) == 2
    for m in rows:
        t = m["mixture_tokens"]
        assert abs(t["prose"] - t["code"]) <= 300, t  # halves, within about one doc


def test_a_share_under_one_token_per_step_is_one_line(folders) -> None:  # noqa: F811
    mixture = f"data.mixture=[{{name: prose, source: {folders['prose']}, weight: 1e200}}, " \
              f"{{name: code, source: {folders['code']}, weight: 1}}]"
    with pytest.raises(ValueError, match="source 'code' .* under one token per step") as e:
        recipe_from_dict(raw(folders, mixture), HETERO)
    assert "\n" not in str(e.value)


def test_an_empty_mixture_is_an_error_not_the_stdlib_corpus(folders) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="data.mixture is an empty list"):
        recipe_from_dict(raw(folders, "data.mixture=[]"), HETERO)
    assert recipe_from_dict(raw(folders, "data.mixture=null"), HETERO).data.mixture is None  # no mixture: fine


def test_a_checkpoint_whose_mixture_cursor_moved_is_refused_on_resume(folders, tmp_path) -> None:  # noqa: F811
    """A checkpoint's loader state with one source's place moved by +1 or -2 units (or a carry of 1e300) is one
    line on resume (was: resumed, and step 7 trained 3,332 tokens instead of 3,404), and OUT stays as it was."""
    import json
    import shutil

    from parallel_runtime.training.trainer import Trainer

    r = recipe_from_dict(raw(folders, "train.checkpoint_every=3", "data.max_seq_len=256",
                             "data.global_batch_tokens=2048"), HETERO)
    run = tmp_path / "run"
    Trainer(r, str(run), reference=True).train(3)
    meta_path = next(run.glob("checkpoint/step-*/meta.json"))
    good = json.loads(meta_path.read_text())
    for name, key, delta in (("prose", "unit", 1), ("code", "unit", -2), ("code", "carry", 1e300)):
        bad = json.loads(json.dumps(good))
        cursor = bad["loader"]["position"]["cursor"]["sources"][name]
        if key == "unit" and cursor[key] + delta < 0:
            delta = 1
        cursor[key] += delta
        copy = tmp_path / f"copy-{name}-{key}"
        shutil.copytree(run, copy)
        next(copy.glob("checkpoint/step-*/meta.json")).write_text(json.dumps(bad))
        before = sorted(p.name for p in copy.rglob("*"))
        with pytest.raises(ValueError, match="loader state") as e:
            Trainer(r, str(copy), reference=True).train(5)
        assert "\n" not in str(e.value)
        assert sorted(p.name for p in copy.rglob("*")) == before
    Trainer(r, str(run), reference=True).train(5)  # the checkpoint as saved resumes
    assert len(read_metrics(os.path.join(run, "metrics.jsonl"))) == 5
