"""Tier 1 (pure): the one group cache creates groups in one order on every rank, each once.

``torch.distributed`` is replaced by a recorder of ``new_group`` calls, one per simulated rank, so the
order every rank creates its groups in is compared without starting a world.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

import parallel_runtime.groups as groups_module
from parallel_runtime.groups import GroupCache, declared_groups, plan_groups
from parallel_runtime.topology import GroupSpec, Topology, required_groups

WORLD = 8


def _fake_world(monkeypatch: pytest.MonkeyPatch, rank: int, calls: list[tuple[int, ...]]) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=("world",)))  # the world's default group

    def new_group(ranks, *, backend=None, timeout_s=None):
        calls.append(tuple(ranks))
        return ("pg", tuple(ranks))

    monkeypatch.setattr(groups_module, "new_group", new_group)


def _calls_on(monkeypatch: pytest.MonkeyPatch, rank: int, make) -> tuple[list[tuple[int, ...]], GroupCache]:
    calls: list[tuple[int, ...]] = []
    with monkeypatch.context() as m:
        _fake_world(m, rank, calls)
        cache = make()
    return calls, cache


def test_build_creates_every_group_once_in_one_order_on_every_rank(monkeypatch) -> None:
    topos = [Topology.uniform(WORLD), Topology.uniform(WORLD, tp=2), Topology.uniform(WORLD, pp=2)]
    specs = required_groups(topos, inner_sizes=[2])
    runs = [_calls_on(monkeypatch, r, lambda: GroupCache.build(topos, inner_sizes=[2])) for r in range(WORLD)]
    world_spans = [s.ranks for s in specs if len(s.ranks) == WORLD]
    want = [s.ranks for s in specs if len(s.ranks) < WORLD]  # the world's group is reused, not created
    assert world_spans and want
    for rank, (calls, cache) in enumerate(runs):
        assert calls == want  # member or not, same groups in the same order
        assert len(cache) == len(specs) == len({s.ranks for s in specs})
        for s in specs:
            if rank in s.ranks:
                want_pg = ("world",) if s.ranks in world_spans else ("pg", s.ranks)
                assert cache.get(s.ranks) == want_pg
                assert cache.has(tuple(reversed(s.ranks)))
        with pytest.raises(ValueError, match="not a member"):
            cache.get(next(s.ranks for s in specs if rank not in s.ranks))


def test_ensure_adds_only_new_groups_and_build_equals_ensure(monkeypatch) -> None:
    topo = Topology.uniform(WORLD, pp=2)
    declared = declared_groups([topo], "nested", 2)
    plan_specs = declared[:3] + [GroupSpec(kind="extra", ranks=(1, 6))]

    def run() -> tuple[GroupCache, int, int]:
        cache = GroupCache(rank=1)
        return cache, cache.ensure(declared), cache.ensure(plan_specs)

    calls, (cache, first, second) = _calls_on(monkeypatch, 1, run)
    assert first == len(declared) and second == 1  # a group already created is not created again
    assert calls[-1] == (1, 6) and len(calls) == len(set(calls))
    built_calls, built = _calls_on(monkeypatch, 1, lambda: GroupCache.build([topo], inner_sizes=[2]))
    assert built_calls == calls[:-1] and built.created == {s.ranks for s in declared}


def test_a_spec_outside_the_world_creates_no_group(monkeypatch) -> None:
    def run() -> GroupCache:
        cache = GroupCache(rank=0)
        with pytest.raises(ValueError, match="names rank 9 but the world has 8 ranks"):
            cache.ensure([GroupSpec(kind="tp", ranks=(0, 1)), GroupSpec(kind="extra", ranks=(0, 9))])
        return cache

    calls, cache = _calls_on(monkeypatch, 0, run)
    assert calls == [] and len(cache) == 0  # no rank is left half-way through a collective list
    with pytest.raises(ValueError, match="was not pre-created"):
        cache.get([0, 1])


def test_build_needs_a_world() -> None:
    if dist.is_initialized():
        pytest.skip("a world is running in this process")
    with pytest.raises(ValueError, match="not initialized"):
        GroupCache.build([Topology.uniform(2)])


def test_plan_groups_are_the_plans_groups() -> None:
    from balanced_loader.plan import Group, Pool, StepPlan, single_pool_ranks

    pool = Pool(tp=1, pp=2, ranks=single_pool_ranks(4, 1, 2),
                microbatches=((Group(lanes=(0, 1), segments=((0, 0, 8),)),),))
    plan = StepPlan(step=0, world_size=4, pools=(pool,))
    kinds = {s.kind for s in plan_groups(plan, "ring", 1)}
    assert "pp" in kinds and "cp" in kinds


def test_a_world_group_of_its_own_when_asked(monkeypatch) -> None:
    topo = Topology.uniform(WORLD)
    calls, cache = _calls_on(monkeypatch, 3, lambda: GroupCache.build([topo], reuse_world=False))
    assert tuple(range(WORLD)) in calls  # not the default group, whose collectives a user's DDP issues too
    assert cache.get(range(WORLD)) == ("pg", tuple(range(WORLD)))
