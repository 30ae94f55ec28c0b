"""Recipes are strict YAML: every shipped recipe loads, unknown keys and impossible shapes fail with
one line naming the field, ``--set`` overrides by dotted path, and the accelerate configs match."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from balanced_loader.cost import CostModel
from parallel_runtime.config import apply_overrides, load_recipe, recipe_from_dict

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TRAINING = sorted(p for p in RECIPES.glob("*.yaml") if not p.name.startswith(("spindle-", "cost-")))


def test_the_required_recipes_are_shipped() -> None:
    names = {p.name for p in TRAINING}
    assert {"cpu-hetero.yaml", "cpu-dcp.yaml", "gpu-h100x8-dcp.yaml", "gpu-h100x64-hetero.yaml"} <= names


@pytest.mark.parametrize("path", TRAINING, ids=lambda p: p.name)
def test_every_recipe_loads(path: Path) -> None:
    r = load_recipe(str(path))
    raw = yaml.safe_load(path.read_text())
    assert "seed" in raw and "steps" in raw  # top level, so --set seed=3 works
    assert load_recipe(str(path), ["seed=3"]).seed == 3
    assert r.shapes() and all(r.world.size % (tp * pp) == 0 for tp, pp in r.shapes())
    assert r.cost_model().shape(*r.shapes()[0]).usable


@pytest.mark.parametrize("path", sorted(RECIPES.glob("cost-*.yaml")), ids=lambda p: p.name)
def test_cost_files_load(path: Path) -> None:
    assert CostModel.from_file(str(path)).base.max_tokens_per_lane > 0


def test_accelerate_configs_match_their_recipes() -> None:
    for cfg, recipe in (("h100x8.yaml", "gpu-h100x8-dcp.yaml"), ("h100x64.yaml", "gpu-h100x64-hetero.yaml")):
        acc = yaml.safe_load((RECIPES / "accelerate" / cfg).read_text())
        r = load_recipe(str(RECIPES / recipe))
        assert acc["num_processes"] == r.world.size and acc["distributed_type"] == "MULTI_GPU"
        assert r.world.size % acc["num_machines"] == 0
        assert f"recipes/accelerate/{cfg}" in (RECIPES / recipe).read_text()  # documented launch line


def _raw() -> dict:
    return yaml.safe_load((RECIPES / "cpu-hetero.yaml").read_text())


@pytest.mark.parametrize(("sets", "message"), [
    (["data.global_batch_tokns=5"], "unknown key 'data.global_batch_tokns'; allowed in data: source, "),
    (["optimiser.lr=1"], "unknown key 'optimiser'; allowed in recipe: seed, steps, data, model"),
    (["model.num_heads=6"], "model: ModelConfig.num_heads (6) must be a multiple of num_kv_heads (4)"),
    (["world.size=6"], "world.size / policy.extra: policy 'pools': extra.pools hold 2 + 2 = 4 ranks"),
    (["policy.extra.pools=[{tp: 3, pp: 1, lanes: 1}, {tp: 1, pp: 1, lanes: 1}]"],
     "shape tp=3, pp=1 of policy 'pools': ModelConfig.num_heads (4) is not divisible by tp=3"),
    (["policy.extra.pools=[{tp: 1, pp: 8, lanes: 1}]", "world.size=8"],
     "shape tp=1, pp=8 of policy 'pools': model.num_layers (4) is smaller than pp=8"),
    (["policy.name=hydra", "policy.extra={}", "world.size=6", "policy.tp=4"],
     "world.size 6 is not divisible by policy.tp x policy.pp = 4 x 1"),
    (["policy.name=maxlen", "policy.extra={}", "policy.tp=2", "world.cp_engine=ring"],
     "shape tp=2, pp=1 is not in the cost file"),
    (["policy.name=hydra", "policy.extra={}", "world.size=8"],
     "world.cp_engine ulysses with Ulysses size 8 needs model.num_kv_heads / tp (4) divisible by it"),
    (["world.cp_engine=zigzag"], "world.cp_engine must be one of ring, ulysses, nested"),
    (["world.cp_inner=2"], "world.cp_inner applies to the nested engine only (cp_engine is 'ulysses')"),
    (["seed=x"], "seed must be an integer, got 'x'"),
    (["optimizer.betas=[0.9]"], "optimizer.betas: expected a list of 2 values"),
    (["policy.compare=[fastest]"], "policy.compare: unknown policy 'fastest'"),
    (["cost.preset=analytic:tiny@cpu"], "cost: give exactly one of cost.file"),
    (["policy.plan_source=rank0"], "policy.plan_source must be one of local, broadcast"),
    (["train.overlap=sometimes"], "train.overlap must be true, false or auto, got 'sometimes'"),
    (["train.overlap=1"], "train.overlap: expected a string, got 1"),
])
def test_bad_recipes_fail_with_one_line_naming_the_field(sets: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        recipe_from_dict(apply_overrides(_raw(), sets), str(RECIPES / "cpu-hetero.yaml"))
    msg = str(info.value)
    assert message in msg and "\n" not in msg, msg


def test_missing_seed_and_bad_set_syntax() -> None:
    raw = _raw()
    del raw["seed"]
    with pytest.raises(ValueError, match="missing key 'seed'"):
        recipe_from_dict(raw)
    with pytest.raises(ValueError, match="expected key=value"):
        apply_overrides(_raw(), ["optimizer.lr"])


def test_overlap_is_auto_by_default_and_takes_true_or_false() -> None:
    from parallel_runtime.training.overlap import overlap_wanted

    path = str(RECIPES / "cpu-hetero.yaml")
    assert load_recipe(path).train.overlap == "auto"
    assert [load_recipe(path, [f"train.overlap={v}"]).train.overlap for v in ("true", "false", "auto")] == \
        [True, False, "auto"]
    # auto: on GPUs; on CPU only where the ranks' compute threads leave a core free; true / false as given
    assert overlap_wanted("auto", gpu=True, busy_cores=64, cores=8)
    assert not overlap_wanted("auto", gpu=False, busy_cores=2, cores=2)  # 2 ranks x 1 thread on 2 cores
    assert overlap_wanted("auto", gpu=False, busy_cores=2, cores=4)
    assert overlap_wanted(True, gpu=False, busy_cores=8, cores=2) and not overlap_wanted(False, gpu=True)


def test_overrides_reach_nested_fields() -> None:
    r = load_recipe(str(RECIPES / "cpu-hetero.yaml"), ["optimizer.lr=1e-3", "policy.compare=[maxlen, hydra]",
                                                       "data.max_seq_len=512"])
    assert r.optimizer.lr == 1e-3 and r.policy.compare == ("maxlen", "hydra") and r.data.max_seq_len == 512
    assert r.resolve("cost-cpu-tiny.yaml") == str(RECIPES / "cost-cpu-tiny.yaml")


def test_a_plan_the_world_cannot_host_is_one_line_naming_the_field() -> None:
    from balanced_loader.plan import Group, Pool, StepPlan, single_pool_ranks
    from parallel_runtime.training.plan_check import check_hostable

    r = load_recipe(str(RECIPES / "cpu-hetero.yaml"))
    ok = StepPlan(step=3, world_size=4, pools=(Pool(tp=2, pp=2, ranks=single_pool_ranks(4, 2, 2), microbatches=(
        (Group(lanes=(0,), segments=((0, 0, 9),)),),)),))
    check_hostable(ok, r)
    deep = StepPlan(step=3, world_size=4, pools=(Pool(tp=1, pp=4, ranks=single_pool_ranks(4, 1, 4), microbatches=()),))
    with pytest.raises(ValueError, match=r"^plan step 3, pool 0 \(tp=1, pp=4\): model.num_layers \(3\) is smaller "
                                         r"than pp=4"):
        check_hostable(deep, dataclasses_replace(r, num_layers=3))
    wide = StepPlan(step=3, world_size=4, pools=(Pool(tp=4, pp=1, ranks=single_pool_ranks(4, 4, 1), microbatches=()),))
    with pytest.raises(ValueError, match=r"pool 0 \(tp=4, pp=1\): ModelConfig.num_kv_heads \(2\) is not divisible"):
        check_hostable(wide, dataclasses_replace(r, num_kv_heads=2))
    cp4 = StepPlan(step=3, world_size=4, pools=(Pool(tp=1, pp=1, ranks=single_pool_ranks(4), microbatches=(
        (Group(lanes=(0, 1, 2, 3), segments=((0, 0, 64),)),),)),))
    check_hostable(cp4, r)
    with pytest.raises(ValueError, match="world.cp_engine ulysses with Ulysses size 4 needs model.num_kv_heads"):
        check_hostable(cp4, dataclasses_replace(r, num_kv_heads=2))


def dataclasses_replace(recipe, **model_changes):
    import dataclasses

    return dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, **model_changes))
