"""The loader's closed loop with injected timings (no torch): a 4-rank world in one process, every rank's
loader fed the same gathered samples, rank 2 at half speed. Plans stay identical on every rank, switch
at the step every rank knows, keep their cost when made ahead, give the slow rank less work, resume
exactly from a state (also at another world size), and every step is planned exactly once."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import balanced_loader.loader as loader_module
from balanced_loader import BalancedLoader
from balanced_loader.calibration import Samples, sample_rows
from balanced_loader.cost import CostModel
from balanced_loader.simulate import simulate_step

TRUE = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                            "comm_bytes_per_token": 2e4, "bandwidth_gbs": {2: 100.0}, "max_tokens_per_lane": 64})
PRIOR = TRUE.scaled(2.0)  # the cost file the loaders start from: twice the true times
LENGTHS = np.random.default_rng(0).integers(1, 200, 300)  # [300] docs, some longer than a lane holds
SPEED = [1.0, 1.0, 0.5, 1.0]  # rank 2 at half speed
WORLD = 4
PREFETCH = 2
CALIBRATE = {"every": 2, "first": 2}


def _loaders(world: int = WORLD, calibrate=CALIBRATE, max_seq_len: int = 128, **kw) -> list[BalancedLoader]:
    return [BalancedLoader(LENGTHS, policy="hydra", cost=PRIOR, world_size=world, rank=r, global_batch_tokens=1500,
                           max_seq_len=max_seq_len, seed=3, prefetch_steps=PREFETCH, calibrate=calibrate, **kw)
            for r in range(world)]


def _samples(batches, speed=SPEED) -> Samples:
    """Every rank's samples of one step: compute the true model's prediction, wall = compute / speed."""
    parts = []
    for b in batches:
        mbs = [mb for mb in b.microbatches if not mb.padding]
        groups = [(1, 1, mb.degree, mb.cp_inner, mb.seq_lengths) for mb in mbs]
        comp = [TRUE.group_ms(mb.seq_lengths, mb.degree) for mb in mbs]
        parts.append(sample_rows(b.step, b.rank, groups, comp, [c / speed[b.rank] for c in comp]))
    return Samples.concat(parts)


def _run(loaders, steps: int, *, observe: bool = True, record=None):
    """``steps`` steps of every loader; returns ``[fingerprint]`` per step and the switches seen
    ``{step of the fit: first step planned with it}``."""
    fps, switches = [], {}
    for _ in range(steps):
        batches = [next(ld) for ld in loaders]
        fp = {b.plan.fingerprint() for b in batches}
        assert len(fp) == 1, f"step {batches[0].step}: ranks disagree on the plan"
        assert len({b.step for b in batches}) == 1
        fps.append(fp.pop())
        if record is not None:
            record.append(batches[0])
        if observe:
            s = _samples(batches)
            ups = [ld.observe(batches[0].step, s, gathered=True) for ld in loaders]
            assert len({None if u is None else json.dumps(u.to_json(), sort_keys=True) for u in ups}) == 1
            if ups[0] is not None:
                starts = {ld.costs.entries[-1][0] for ld in loaders}
                assert starts == {loaders[0].step + PREFETCH}
                switches[batches[0].step] = starts.pop()
    return fps, switches


def test_closed_loop_plans_agree_switch_at_a_known_step_and_spare_the_slow_rank():
    loaders = _loaders()
    plain = _loaders(calibrate=False)
    record = []
    fps, switches = _run(loaders, 10, record=record)
    ref, _ = _run(plain, 10, observe=False)
    # fits after steps 1, 3, 5, 7, 9 (first=2, every=2); the first applies from step 2 + 2 = 4
    assert switches == {1: 4, 3: 6, 5: 8, 7: 10, 9: 12}
    # plans made before the first switch are the un-calibrated run's; after it they differ
    assert fps[:4] == ref[:4]
    assert fps[4] != ref[4]
    costs = loaders[0].costs
    assert costs.at(3) is costs.entries[0][1] and costs.at(3) == PRIOR
    fitted = costs.at(4)
    assert fitted.rank_speeds(WORLD).tolist() == SPEED
    assert fitted.linear_ms == pytest.approx(TRUE.linear_ms, rel=1e-3)
    for b in record[4:]:
        assert b.plan.predicted_ms > 0
        work = simulate_step(b.plan, TRUE).rank_busy_ms  # [4] busy ms at speed 1: the work each rank got
        assert work[2] < min(work[r] for r in (0, 1, 3)), (b.step, work)
        b.plan.validate(b.sequences, costs.at(b.step))
    for b in record[:4]:  # made ahead with the prior: rank 2 gets its share
        work = simulate_step(b.plan, TRUE).rank_busy_ms
        assert work[2] > 0.6 * np.mean(work)


def test_resume_from_a_state_gives_the_same_plans():
    full = _loaders()
    fps, _ = _run(full, 12)
    for k in (3, 5):  # after a fit that has not applied yet (3), and between fits (5)
        first = _loaders()
        _run(first, k)
        state = json.loads(json.dumps(first[0].state_dict()))
        assert [s[0] for s in state["costs"]][-1] >= k and state["calibration"]["steps_seen"] == k
        resumed = _loaders()
        for ld in resumed:
            ld.load_state_dict(state)
        rest, _ = _run(resumed, 12 - k)
        assert rest == fps[k:], k
        for ld in first + resumed:
            ld.close()


def test_resume_at_another_world_size_keeps_the_batches_and_the_fit():
    first = _loaders()
    _run(first, 5)
    state = json.loads(json.dumps(first[0].state_dict()))
    two = _loaders(world=2)
    for ld in two:
        ld.load_state_dict(state)
    record = []
    _run(two, 4, record=record)
    docs = [sorted(d for p in b.plan.pools for mb in p.microbatches for g in mb for d, _, _ in g.segments)
            for b in record]
    ref = _loaders(calibrate=False)
    _run(ref, 5, observe=False)
    ref_record = []
    _run(ref, 4, observe=False, record=ref_record)
    assert docs == [sorted(d for p in b.plan.pools for mb in p.microbatches for g in mb for d, _, _ in g.segments)
                    for b in ref_record]  # the same global batches
    cal = two[0].costs.calibrator
    assert cal.world_size == 2 and cal.cost.linear_ms == pytest.approx(TRUE.linear_ms, rel=1e-3)
    for b in record:
        b.plan.validate(b.sequences, two[0].costs.at(b.step))
        assert two[0].costs.at(b.step).rank_speeds(2).tolist() == [1.0, 1.0]  # rank 2's speed was another world's


def test_the_closed_loop_plans_docs_up_to_the_default_max_seq_len():
    # the default max_seq_len (4 lanes x 64) comes from the uniform prior; once rank 2 is slow no block of
    # alike lanes holds 256 tokens, yet every step must still be planned (and within every lane's cap)
    loaders = _loaders(max_seq_len=None)
    assert loaders[0].max_seq_len == 256
    record = []
    _, switches = _run(loaders, 8, record=record)
    assert min(switches.values()) == 4 and loaders[0].costs.at(4).rank_speeds(WORLD).tolist() == SPEED
    longest = max(length for b in record[4:] for p in b.plan.pools for mb in p.microbatches for g in mb
                  for _, _, length in g.segments)
    assert longest > 128  # a doc only the whole pool holds, planned after the switch
    for b in record:
        b.plan.validate(b.sequences, loaders[0].costs.at(b.step))


def test_each_step_is_planned_exactly_once(monkeypatch):
    calls = Counter()
    real = loader_module.make_plan

    def counting(items, cost, config, step=0):
        calls[step] += 1
        return real(items, cost, config, step)

    monkeypatch.setattr(loader_module, "make_plan", counting)
    (ld,) = _loaders(world=1, calibrate=False, max_seq_len=64)
    n = len(ld)
    steps = [b.step for b in ld]
    assert steps == list(range(n)) and n > 5
    assert dict(calls) == {s: 1 for s in range(n)}


def test_observe_needs_calibrate_and_set_cost_needs_a_cost_model():
    (ld,) = _loaders(world=1, calibrate=False, max_seq_len=64)
    b = next(ld)
    with pytest.raises(ValueError, match="create the loader with calibrate=True") as e:
        ld.observe(b, _samples([b], speed=[1.0]), gathered=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="set_cost needs a CostModel, got dict"):
        ld.set_cost(TRUE.to_dict())
    (cal,) = _loaders(world=1, max_seq_len=64)
    with pytest.raises(ValueError, match="observe\\(\\) needs Samples"):
        cal.observe(0, [[0, 0]], gathered=True)
    # set_cost applies from the first step not planned yet, the same on every rank
    assert ld.set_cost(TRUE) == ld.step + PREFETCH
    with pytest.raises(ValueError, match="calibrate must be True, a mapping"):
        _loaders(world=1, calibrate="yes", max_seq_len=64)
    with pytest.raises(ValueError, match="'every' must be an integer"):
        _loaders(world=1, calibrate={"every": 0}, max_seq_len=64)
