"""Recipes take ``data.mixture`` and schedules (issue 21): strict parsing with one-line errors, and a
one-process run whose ``metrics.jsonl`` logs each step's tokens per source."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from balanced_loader.build.writer import write_shards
from parallel_runtime.config import apply_overrides, recipe_from_dict
from parallel_runtime.training.metrics import read_metrics

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
HETERO = str(RECIPES / "cpu-hetero.yaml")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    rng = np.random.default_rng(2)
    out = {}
    for name, n, hi in (("prose", 60, 300), ("code", 30, 200)):
        docs = [rng.integers(0, 256, size=int(k)) for k in rng.integers(8, hi, size=n)]
        out[name] = write_shards(docs, str(tmp_path_factory.mktemp(name)), dtype=np.uint8).folder
    return out


def raw(folders: dict[str, str], *sets: str) -> dict:
    base = yaml.safe_load(Path(HETERO).read_text())
    mixture = f"data.mixture=[{{name: prose, source: {folders['prose']}, weight: [[0, 0.8], [2, 0.5]]}}, " \
              f"{{name: code, source: {folders['code']}, weight: 0.2}}]"
    return apply_overrides(base, ["data.source=stdlib", mixture, "data.max_seq_len=[[0, 128], [2, 256]]",
                                  "data.global_batch_tokens=[[0, 1024], [2, 2048]]", *sets])


def test_a_mixture_recipe_parses_its_schedules(folders) -> None:
    r = recipe_from_dict(raw(folders), HETERO)
    assert [e.name for e in r.data.mixture] == ["prose", "code"]
    assert r.data.mixture[0].weight == ((0, 0.8), (2, 0.5)) and r.data.max_seq_len == ((0, 128), (2, 256))
    assert r.data.longest_seq_len == 256


@pytest.mark.parametrize(("sets", "message"), [
    (["data.mixture=[{name: a, source: x, weight: -1}]"], "data.mixture: weights: 'a' at step 0 must be >= 0"),
    (["data.mixture=[{name: a, source: x, weight: 0}, {name: b, source: y, weight: 0}]"], "are all zero"),
    (["data.mixture=[{name: a, source: x}, {name: a, source: y}]"], "source name 'a' is listed twice"),
    (["data.max_seq_len=[[5, 128], [2, 256]]"], "data.max_seq_len: schedule steps must increase"),
    (["data.global_batch_tokens=[[0, 0]]"], "data.global_batch_tokens at step 0 must be >= 1"),
    (["data.mixture_by=bytes"], "data.mixture_by must be one of tokens, docs"),
    (["data.order=strict"], "data.order strict keeps the source order: set data.shuffle: false"),
    (["data.source=elsewhere"], "data.source and data.mixture are both set"),
    (["data.mixture=[{name: a, sorce: x}]"], "unknown key 'data.mixture[0].sorce'"),
])
def test_bad_mixture_recipes_fail_with_one_line(folders, sets: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        recipe_from_dict(raw(folders, *sets), HETERO)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_metrics_log_each_steps_tokens_per_source(folders, tmp_path) -> None:
    from parallel_runtime.training.trainer import Trainer

    r = recipe_from_dict(raw(folders, "world.timeout_s=60", "train.checkpoint_every=0"), HETERO)
    Trainer(r, str(tmp_path), reference=True).train(3)
    rows = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert len(rows) == 3 and all(set(m["mixture_tokens"]) == {"code", "prose"} for m in rows)
    assert all(sum(m["mixture_tokens"].values()) == m["tokens"] for m in rows)
    assert rows[0]["tokens"] <= 1024 < rows[2]["tokens"] <= 2048  # the budget ramp reached step 2
