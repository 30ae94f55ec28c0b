"""HydraCPScheduler, the drop-in for megatron-core's BalancedCPScheduler: Megatron's output structure and
rules (checked by an independent validator that Megatron's own output also passes), Megatron's execution
model timed by simulate, never slower than Megatron's scheduler (the real one when installed, else the
faithful reproduction), a real process group object, and the wrapper swap."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from balanced_loader.integrations.megatron import HydraCPScheduler, check_schedule, megatron_cp_degrees
from balanced_loader.planning.megatron_cp import group_sizes, lower_bound_ms, modeled_ms, plan_samples, to_plan
from balanced_loader.planning.policies.mcore_dcp import schedule as mcore_schedule
from balanced_loader.simulate import step_ms


class Size:
    """What BalancedCPScheduler reads of its dp_cp_group: size()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def real_megatron():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError:
        return None
    return BalancedCPScheduler


def megatron_groups(lengths, world: int, cap: int):
    """Megatron's sample_id_groups: the real scheduler when installed, else the reproduction (identical on
    the batches test_mcore_dcp compares)."""
    pairs = list(enumerate(np.asarray(lengths).tolist()))
    real = real_megatron()
    if real is not None:
        return real(cap, Size(world)).get_groups_and_subsamples(pairs, None)[1]
    out = []
    for rnd in mcore_schedule(np.asarray(lengths), world, cap):
        per = [[] for _ in range(world)]
        for first, size, docs in rnd:
            for r in range(first, first + size):
                per[r] = list(docs)
        out.append(per)
    return out


def code_lengths(limit: int = 1500) -> np.ndarray:
    """Byte sizes of this machine's CPython standard library .py files (a real long-tailed corpus)."""
    from balanced_loader.build.corpus import stdlib_py_files

    return np.asarray([os.path.getsize(p) for p in stdlib_py_files()[:limit]], dtype=np.int64)


def test_group_sizes_are_megatrons():
    assert group_sizes(1) == [1]
    assert group_sizes(2) == [1, 2]
    assert group_sizes(8) == [1, 2, 4, 8]
    assert group_sizes(512) == [1 << i for i in range(10)]
    assert group_sizes(12) == [1, 2, 4, 12]  # create_hybrid_dp_cp_groups: 2..2^floor(log2 12) - 1, and all 12


def test_validator_names_each_broken_rule():
    pairs = [(10, 30), (11, 5), (12, 5), (13, 5)]
    ok = [[[10, 12], [10, 13], [11], [11]]]
    check_schedule(ok, pairs, 4, cap := 16, groups=[[[30, 5], [30, 5], [5], [5]]])
    bad = {
        "not one of Megatron's": [[[10], [10, 12], [10, 13], [11]]],  # ranks 0-2: no group of 3
        "aligned": [[[12], [10], [10], [11, 13]]],  # ranks 1-2: a size-2 block that is not aligned
        "over max_seq_len_per_rank": [[[10, 12], [11, 13], [], []]],
        "more than one group": [[[10], [10], [11], [12]], [[13], [13], [13, 10], [13, 10]]],
        "in no group": [[[10], [10], [11], [12]]],
        "no sample in the last group": [[[10, 12], [10, 13], [11], []]],
        "cycle": [[[10, 11], [10, 11], [11, 10], [11, 10], ]],
    }
    for what, sched in bad.items():
        with pytest.raises(ValueError, match=what):
            check_schedule(sched, pairs, 4, cap)
    with pytest.raises(ValueError, match="does not list the lengths"):
        check_schedule(ok, pairs, 4, cap, groups=[[[30], [30, 5], [5], [5]]])


def test_megatrons_own_output_passes_the_validator():
    real = real_megatron()
    if real is None:
        pytest.skip("megatron-core is not installed (pip install --no-deps megatron-core==0.16.1)")
    rng = np.random.default_rng(1)
    for _ in range(30):
        world = int(rng.choice([2, 4, 8, 16]))
        cap = int(rng.integers(8, 64))
        lengths = rng.integers(1, cap * world + 1, int(rng.integers(world, 80)))
        pairs = list(enumerate(lengths.tolist()))
        groups, ids = real(cap, Size(world)).get_groups_and_subsamples(pairs, None)
        check_schedule(ids, pairs, world, cap, groups=groups)


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16, 6, 12])
def test_valid_and_never_slower_on_random_batches(world):
    """Megatron's structure and rules on every output, batches from tiny (fewer samples than ranks) to a few
    per rank, power-of-two and other world sizes; never slower than Megatron's schedule (pow2 worlds, where
    Megatron's own output is valid)."""
    rng = np.random.default_rng(world)
    cap = 64
    for _ in range(25):
        n = int(rng.integers(1, 6 * world + 2))
        top = cap * world
        lengths = np.minimum(rng.lognormal(3.0, 1.4, n).astype(np.int64) + 1, top)
        pairs = [(1000 + 7 * i, int(s)) for i, s in enumerate(lengths)]  # ids are not positions
        sched = HydraCPScheduler(cap, world_size=world, cost="hydra-gpt7b-a100")
        groups, ids = sched.get_groups_and_subsamples(pairs, None)
        check_schedule(ids, pairs, world, cap, groups=groups)
        ours = modeled_ms(ids, pairs, sched.cost, world)
        assert np.isclose(ours, sched.last["modeled_ms"], rtol=1e-9)
        assert ours >= sched.last["lower_bound_ms"] * (1 - 1e-9)
        if world & (world - 1) == 0:
            meg = megatron_groups(lengths, world, cap)
            assert ours <= modeled_ms(meg, list(enumerate(lengths.tolist())), sched.cost, world) * (1 + 1e-9)


def test_single_group_without_waits_on_a_real_corpus():
    """On the standard library's file sizes (8 ranks, 4 x ranks x cap tokens a batch): one group, no rank
    idles (the step time is the busiest rank's sum of sample times), within 3% of the lower bound, and
    faster than Megatron's schedule without the reproduction's help."""
    lengths = code_lengths()
    world, cap = 8, 8192
    rng = np.random.default_rng(0)
    lengths = lengths[rng.permutation(len(lengths))]
    lengths = np.minimum(lengths, cap * world)
    cut = int(np.searchsorted(np.cumsum(lengths), 4 * world * cap))
    batch = lengths[:cut]
    sched = HydraCPScheduler(cap, world_size=world, megatron_candidate=False)
    pairs = list(enumerate(batch.tolist()))
    groups, ids = sched.get_groups_and_subsamples(pairs)
    assert len(ids) == 1 and sched.last["how"] == "target"
    check_schedule(ids, pairs, world, cap, groups=groups)
    sc = sched.cost.shape(1, 1)
    deg = megatron_cp_degrees(ids)
    busy = [sum(sc.group_ms([batch[i]], deg[i]) for i in lst) for lst in ids[0]]
    t = modeled_ms(ids, pairs, sched.cost, world)
    assert np.isclose(t, max(busy), rtol=1e-9)  # nobody waits for a partner
    assert t <= 1.03 * lower_bound_ms(batch, sc, world, cap)
    assert t < modeled_ms(megatron_groups(batch, world, cap), pairs, sched.cost, world)


def test_to_plan_orders_and_barriers():
    ids = [[[5, 6], [5, 7], [8], [8, 9]], [[1], [1], [2], [3]]]
    pairs = [(5, 40), (6, 3), (7, 4), (8, 40), (9, 2), (1, 9), (2, 1), (3, 1)]
    plan = to_plan(ids, pairs, 4)
    pool = plan.pools[0]
    assert pool.barriers == (2,)  # group 1 starts at microbatch 2, after group 0's two
    assert [sorted(g.lanes for g in mb) for mb in pool.microbatches] == [[(0, 1), (2, 3)], [(0,), (1,), (3,)],
                                                                         [(0, 1), (2,), (3,)]]
    from balanced_loader.presets import cost_preset

    cost = cost_preset("hydra-gpt7b-a100")
    assert step_ms(plan, cost) == modeled_ms(ids, pairs, cost, 4)


def test_bad_arguments_are_one_line():
    with pytest.raises(ValueError, match="dp_cp_group or world_size"):
        HydraCPScheduler(8192)
    with pytest.raises(ValueError, match="max_seq_len_per_rank must be a positive integer"):
        HydraCPScheduler(0, world_size=4)
    with pytest.raises(ValueError, match="world_size=4 but dp_cp_group has 8"):
        HydraCPScheduler(8, Size(8), world_size=4)
    s = HydraCPScheduler(8, world_size=4)
    with pytest.raises(ValueError, match="more than max_seq_len_per_rank 8 x 4"):
        s.get_groups_and_subsamples([(0, 33)])
    with pytest.raises(ValueError, match="sample id 3 appears twice"):
        s.get_groups_and_subsamples([(3, 4), (3, 5)])
    with pytest.raises(ValueError, match="has length 0"):
        s.get_groups_and_subsamples([(3, 0)])
    assert plan_samples(np.zeros(0, np.int64), 4, 8, s.cost).groups == [[[], [], [], []]]


SWAP = r"""
import warnings; warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
from balanced_loader.integrations.megatron import HydraCPScheduler, check_schedule
g = dist.group.WORLD
h = HydraCPScheduler(64, g)
assert h.total_hdp_gpus == 8
pairs = [(i, 10 + 37 * i % 300) for i in range(40)]
groups, ids = h.get_groups_and_subsamples(pairs, None)
check_schedule(ids, pairs, 8, 64, groups=groups)
try:
    from megatron.core.datasets.data_schedule import HybridCPDataLoaderWrapper
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    from megatron.core.process_groups_config import ProcessGroupCollection
except ImportError:
    print("swap: megatron-core absent"); raise SystemExit(0)
class Config: max_seqlen_per_dp_cp_rank = 64
w = HybridCPDataLoaderWrapper(iter([]), Config(), pg_collection=ProcessGroupCollection(dp_cp=g, dp=g, tp=g))
assert isinstance(w.cp_balancing_scheduler, BalancedCPScheduler)
w.cp_balancing_scheduler = HydraCPScheduler(Config.max_seqlen_per_dp_cp_rank, w.dp_cp_group)
groups, ids = w.cp_balancing_scheduler.get_groups_and_subsamples(pairs, w.config)  # as __next__ calls it
check_schedule(ids, pairs, 8, 64, groups=groups)
import megatron.core.datasets.data_schedule as data_schedule  # or: replace the class before the wrapper is built
data_schedule.BalancedCPScheduler = HydraCPScheduler
w = HybridCPDataLoaderWrapper(iter([]), Config(), pg_collection=ProcessGroupCollection(dp_cp=g, dp=g, tp=g))
assert isinstance(w.cp_balancing_scheduler, HydraCPScheduler) and w.cp_balancing_scheduler.total_hdp_gpus == 8
assert iter(w) is w
print("swap: ok")
"""


def test_real_process_group_and_the_wrapper_swap():
    """With torch's fake process group (no GPU): the scheduler takes the DP x CP group object, and replaces the
    BalancedCPScheduler of megatron-core's HybridCPDataLoaderWrapper (when installed) as docs/megatron.md says."""
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-c", SWAP], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "swap:" in r.stdout
