"""Reliability III (issue 38): extreme values bounded, outputs never clobbered, nothing silent.

Each test is a case of the issue's probe (or a neighbour of one) that failed on the code before it:
mixture weights and schedules in overflow-safe, bounded arithmetic; ``plan`` without ``--steps``
stating and bounding its steps; an empty plan, repeated step numbers and blank length lines refused.
Calibration state, outputs, RL balancing and the HF integrations have files of their own
(``test_calibration_state.py``, ``test_outputs_clobber.py``, ``test_rl_extremes.py``,
``tests/parallel_runtime/integrations/test_hf_cp_sync.py``).
"""

from __future__ import annotations

import json

import pytest
from test_cli_errors import GOOD_COST

from balanced_loader import cli
from balanced_loader.cost import CostModel
from balanced_loader.data.lengths import read_lengths
from balanced_loader.data.mixture import mix
from balanced_loader.loader import BalancedLoader
from balanced_loader.plan import Group, Plan, Pool, StepPlan
from balanced_loader.schedule import check_shares, epoch_steps, setting, weight_schedule

COST = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                            "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 512})


@pytest.fixture(scope="module")
def lens(tmp_path_factory):
    """Two length files of real shapes (the project's Wikipedia lengths, cut at 2,000 tokens) and a cost file."""
    import gzip
    import os

    root = tmp_path_factory.mktemp("rel3")
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with gzip.open(os.path.join(here, "data", "wikipedia_lengths.txt.gz"), "rt") as f:
        wiki = [min(int(x), 2000) for _, x in zip(range(8000), f)]
    (root / "L1.txt").write_text("\n".join(map(str, wiki[:5000])) + "\n")
    (root / "L3.txt").write_text("\n".join(map(str, wiki[5000:])) + "\n")
    (root / "cost.yaml").write_text(GOOD_COST)
    return root


def _cli(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---- mixture weights and schedules ----------------------------------------------------------------


def test_weights_of_1e308_mix_by_halves_in_the_api_and_the_cli(lens, capsys, tmp_path):
    src = mix({"a": str(lens / "L1.txt"), "b": str(lens / "L3.txt")}, weights={"a": 1e308, "b": 1e308})
    assert src.weights.at(0) == (0.5, 0.5)
    ld = BalancedLoader(src, policy="greedy", cost=COST, world_size=2, rank=0, global_batch_tokens=8192,
                        max_seq_len=512, epochs=None, prefetch_steps=1)
    batch = next(ld)  # was: TypeError: cannot unpack non-iterable NoneType object (data/mixing.py)
    ld.close()
    a, b = batch.mixture_tokens["a"], batch.mixture_tokens["b"]
    assert abs(a - b) <= 2000
    out = tmp_path / "p.json"
    rc, _, err = _cli(["plan", "--mix", f"a={lens}/L1.txt:1e308", f"b={lens}/L3.txt:1e308", "--global-batch-tokens",
                       8192, "--world-size", 2, "--cost-file", lens / "cost.yaml", "--policy", "greedy",
                       "--max-seq-len", 512, "--steps", 2, "--out", out], capsys)
    assert rc == 0, err
    assert len(Plan.load(str(out)).steps) == 2


def test_a_share_under_one_token_per_step_is_refused_not_an_endless_epoch(lens):
    # 1e200 / 1 / 1e-200: the middle share is 1e-200, the last underflows to 0 (was: epochs=1 never ended)
    with pytest.raises(ValueError, match=r"source 'b' \(weight 1\) gets a share of 1e-200 .* never end"):
        mix({"a": str(lens / "L1.txt"), "b": str(lens / "L3.txt"), "c": [5, 6, 7]},
            weights={"a": 1e200, "b": 1.0, "c": 1e-200})
    w = weight_schedule({"a": 1.0, "b": 1e-9}, ["a", "b"])  # 1e-9 of a 65,536-token step: under one token
    with pytest.raises(ValueError, match=r"source 'b' gets a share of 1e-09 of a 65,536-token step"):
        check_shares(w, setting(65536, "global_batch_tokens"))
    check_shares(w, setting(2 * 10**9, "global_batch_tokens"))  # 2 tokens of a 2e9-token step: fine
    # a zero weight (the source left out) and a ramp from 0 are fine
    check_shares(weight_schedule({"a": 1.0, "b": [(0, 0.0), (1000, 0.5)]}, ["a", "b"]), setting(4096, "g"))


def test_the_loader_refuses_a_share_under_one_token_of_its_budget(lens):
    src = mix({"a": str(lens / "L1.txt"), "b": str(lens / "L3.txt")}, weights={"a": 1.0, "b": 1e-9})
    with pytest.raises(ValueError, match="under one token per step"):
        BalancedLoader(src, policy="greedy", cost=COST, world_size=2, rank=0, global_batch_tokens=65536,
                       max_seq_len=512, epochs=1)


def test_schedule_values_obey_the_scalar_bounds():
    with pytest.raises(ValueError, match=r"global_batch_tokens at step 10 must be <= 1099511627776"):
        setting([(0, 4096), (10, 10**15)], "global_batch_tokens")
    with pytest.raises(ValueError, match="global_batch_tokens"):
        BalancedLoader([100, 200, 300], policy="greedy", cost=COST, world_size=2, rank=0,
                       global_batch_tokens=[(0, 4096), (10, 10**15)])
    assert setting([(0, 4096), (10, 1 << 40)], "g").largest == 1 << 40


def test_epoch_steps_estimate_matches_a_constant_mixture():
    w = weight_schedule({"a": 3.0, "b": 1.0}, ["a", "b"])
    # a needs 3,000 units at 0.75 * 100 a step = 40 steps; b 2,000 at 25 = 80 steps: the epoch is 80 steps
    assert epoch_steps([3000, 2000], w, setting(100, "g")) == pytest.approx(80)


def test_plan_without_steps_states_and_bounds_the_steps_it_plans(lens, capsys, tmp_path):
    out = tmp_path / "p.json"
    common = ["--global-batch-tokens", 65536, "--world-size", 2, "--cost-file", lens / "cost.yaml", "--policy",
              "greedy", "--max-seq-len", 1000, "--out", out]
    # the command: a share of 1e-9 of a step (under one token) is refused before any step is cut
    rc, _, err = _cli(["plan", "--mix", f"web={lens}/L1.txt:1", f"code={lens}/L3.txt:1e-9", *common], capsys)
    assert rc == 2 and "under one token per step" in err and len(err.strip().splitlines()) == 1
    # a small share that still makes the first epoch ~10^5 steps: one line naming --steps, nothing written
    rc, _, err = _cli(["plan", "--mix", f"web={lens}/L1.txt:1", f"code={lens}/L3.txt:1e-4", *common], capsys)
    assert rc == 2 and "pass --steps K" in err and "steps, more than the 10,000" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    rc, _, err = _cli(["plan", "--lengths", lens / "L1.txt", "--global-batch-tokens", 100, *common[2:8],
                       "--max-seq-len", 100, "--out", out], capsys)
    assert rc == 2 and "pass --steps K" in err and not out.exists()
    # an epoch under the limit: the count is stated, and it is about what was planned
    rc, _, err = _cli(["plan", "--mix", f"web={lens}/L1.txt:1", f"code={lens}/L3.txt:0.5", *common], capsys)
    assert rc == 0, err
    stated = float(err.split("about ")[1].split(" step")[0].replace(",", ""))
    planned = len(Plan.load(str(out)).steps)
    assert abs(stated - planned) <= 0.1 * planned + 2, (stated, planned)


# ---- old ones ----------------------------------------------------------------------------------------


def test_a_plan_with_every_doc_dropped_is_an_error_and_writes_nothing(lens, capsys, tmp_path):
    (tmp_path / "l.txt").write_text("100\n200\n")
    out = tmp_path / "p.json"
    rc, _, err = _cli(["plan", "--lengths", tmp_path / "l.txt", "--world-size", 2, "--cost-file", lens / "cost.yaml",
                       "--policy", "greedy", "--max-seq-len", 50, "--long-docs", "drop", "--out", out], capsys)
    assert rc == 2 and "nothing to plan" in err and "dropped 2" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_plan_file_with_repeated_step_numbers_is_refused(lens, capsys, tmp_path):
    pool = Pool(tp=1, pp=1, ranks=((0, 1),), microbatches=((Group(lanes=(0,), segments=((0, 0, 10),)),),))
    step = StepPlan(step=0, world_size=2, pools=(pool,))
    (tmp_path / "p.json").write_text(Plan(policy="hand", world_size=2, steps=(step, step, step)).dumps())
    rc, _, err = _cli(["simulate", tmp_path / "p.json", "--cost-file", lens / "cost.yaml"], capsys)
    assert rc == 2 and "step numbers must increase, but step 0 comes after step 0" in err
    with pytest.raises(ValueError, match="step numbers must increase"):
        Plan.from_json(json.loads((tmp_path / "p.json").read_text()))


@pytest.mark.parametrize("text,line", [("5\n\n6\n", 2), ("\n5\n", 1), ("# h\n5\n  \n7\n", 3), ("5\r\n\r\n6\r\n", 2)])
def test_a_blank_line_between_lengths_is_refused_naming_it(tmp_path, text, line):
    (tmp_path / "a.txt").write_text(text)
    with pytest.raises(ValueError, match=rf"a.txt, line {line} is blank: .* shift the ids"):
        read_lengths(tmp_path / "a.txt")


def test_blank_lines_at_the_end_and_comment_lines_keep_doc_ids(tmp_path, monkeypatch):
    from balanced_loader.data import lengths as lengths_mod

    (tmp_path / "a.txt").write_text("5\n# note\n6\n\n\n")
    assert read_lengths(tmp_path / "a.txt").tolist() == [5, 6]
    monkeypatch.setattr(lengths_mod, "_BLOCK", 16)  # the blank line and the length after it in other blocks
    (tmp_path / "b.txt").write_text("".join(f"{i}\n" for i in range(1, 20)) + "\n" + "7\n")
    with pytest.raises(ValueError, match="b.txt, line 20 is blank"):
        read_lengths(tmp_path / "b.txt")


# ---- a mixture's whole state on load ---------------------------------------------------------------


def _mixture_states(steps: int) -> tuple[object, list[dict]]:
    """A two-source mixture of real Wikipedia lengths (epoch 0 ends near step 38) and its saved states."""
    import gzip
    import os

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with gzip.open(os.path.join(here, "data", "wikipedia_lengths.txt.gz"), "rt") as f:
        wiki = [max(1, min(int(x), 600)) for _, x in zip(range(500), f)]
    src = mix({"a": wiki[:300], "b": [max(1, x // 2) for x in wiki[300:]]}, weights={"a": 0.7, "b": 0.3})
    ld = _mix_loader(src)
    states = []
    for _ in range(steps):
        next(ld)
        states.append(json.loads(json.dumps(ld.state_dict())))
    ld.close()
    return src, states


def _mix_loader(src):
    return BalancedLoader(src, policy="greedy", cost=COST, world_size=2, rank=0, global_batch_tokens=4096,
                          max_seq_len=512, epochs=None, validate=False, prefetch_steps=1)


def test_a_later_epochs_moved_start_is_refused_for_a_mixture():
    """Past epoch 0 a state's epoch start was trusted: at an epoch's first step (cursor = epoch start) a
    source moved by -2 or +1 units, a carry of 1e300 or an epoch +5, in both, resumed (was: accepted)."""
    src, states = _mixture_states(50)
    later = [s for s in states if s["position"]["cursor"]["epoch"] >= 1]
    first, inside = later[0], later[3]
    assert first["position"]["cursor"]["step_in_epoch"] == 0 and inside["position"]["cursor"]["step_in_epoch"] == 3
    for state in (first, inside):
        for name, key, delta in (("a", "unit", -2), ("a", "unit", 1), ("b", "carry", 1e300), ("a", "epoch", 5),
                                 ("b", "mark", -1)):
            bad = json.loads(json.dumps(state))
            for part in ("cursor", "epoch_start"):
                bad["position"][part]["sources"][name][key] += delta
            with pytest.raises(ValueError, match="loader state"):
                _mix_loader(src).load_state_dict(bad)
    for state in (first, inside):  # the states as saved resume, at their step
        ld = _mix_loader(src)
        ld.load_state_dict(state)
        assert next(ld).step == state["position"]["cursor"]["step"]
        ld.close()


def test_a_claimed_far_epoch_is_refused_without_replaying_it():
    src, states = _mixture_states(3)
    bad = json.loads(json.dumps(states[-1]))
    for part in ("cursor", "epoch_start"):
        bad["position"][part]["epoch"] = 10**9
    bad["epoch"] = 10**9
    with pytest.raises(ValueError, match="loader state"):
        _mix_loader(src).load_state_dict(bad)


# ---- found by this turn's probe (issue 33: sequences as the unit of a step) --------------------------------


def test_simulate_and_trace_read_a_plan_whose_long_docs_were_split(lens, capsys, tmp_path):
    """``plan`` splits docs longer than --max-seq-len into pieces that may fall in different steps; simulate
    and trace checked each step against whole docs (was: 'doc 24 covers 2000 of its 6592 tokens', exit 2)."""
    import gzip
    import os

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with gzip.open(os.path.join(here, "data", "wikipedia_lengths.txt.gz"), "rt") as f:
        (tmp_path / "l.txt").write_text("".join(line for _, line in zip(range(3000), f)))
    plan = tmp_path / "p.json"
    rc, _, err = _cli(["plan", "--lengths", tmp_path / "l.txt", "--global-batch-tokens", 20000, "--world-size", 16,
                       "--cost-file", lens / "cost.yaml", "--policy", "hydra", "--max-seq-len", 1000, "--steps", 3,
                       "--out", plan], capsys)
    assert rc == 0 and "split" in err + _, err
    for extra in ([], ["--lengths", tmp_path / "l.txt"]):
        rc, _, err = _cli(["simulate", plan, "--cost-file", lens / "cost.yaml", *extra], capsys)
        assert rc == 0, err
    rc, _, err = _cli(["trace", plan, "--cost-file", lens / "cost.yaml", "--out", tmp_path / "t.json"], capsys)
    assert rc == 0 and (tmp_path / "t.json").exists(), err
    # what the check still finds: two segments of one doc overlapping in a step, a run past its doc's end
    data = json.loads(plan.read_text())
    seg = data["steps"][0]["pools"][0]["microbatches"][0][0]["segments"]
    d, a, k = seg[0]
    seg.append([d, a, k])
    (tmp_path / "bad.json").write_text(json.dumps(data))
    rc, _, err = _cli(["simulate", tmp_path / "bad.json", "--cost-file", lens / "cost.yaml"], capsys)
    assert rc == 2 and "overlaps" in err, err
    (tmp_path / "short.txt").write_text("1\n" * 3000)
    rc, _, err = _cli(["simulate", plan, "--cost-file", lens / "cost.yaml", "--lengths", tmp_path / "short.txt"],
                      capsys)
    assert rc == 2 and "past its 1 tokens" in err, err


def test_hydra_cp_scheduler_refuses_what_is_not_a_batch_of_integer_lengths():
    """Found by tools/probe_turn3.py (issue 34): None gave a TypeError, a length of 2**70 an OverflowError,
    1.5 / "10" / True were read as 1 / 10 / 1, and [] returned a schedule Megatron's rules refuse (no sample
    on any rank in the last group)."""
    import numpy as np

    from balanced_loader.integrations.megatron import HydraCPScheduler

    s = HydraCPScheduler(4096, world_size=4)
    for bad, what in ((None, "must be a list of"), ([], "is empty"), ([(0, 2**70)], "over 1,099,511,627,776"),
                      ([(0, 1.5)], "pair of integers"), ([(0, "10")], "pair of integers"),
                      ([(0, True)], "pair of integers"), ([(0, float("nan"))], "pair of integers")):
        with pytest.raises(ValueError, match=what):
            s.get_groups_and_subsamples(bad)
    groups, ids = s.get_groups_and_subsamples([(np.int64(3), np.int32(40)), (7, 5000)])  # numpy scalars: fine
    assert {i for g in ids for r in g for i in r} == {3, 7}


def test_a_damaged_checksum_sidecar_header_is_one_line(tmp_path, capsys):
    """Found by tools/probe_turn3.py (issue 34): two bits flipped in PREFIX.crc32.npy's header made numpy's
    header parser raise tokenize.TokenError, a traceback out of `verify PREFIX` (exit 1)."""
    import numpy as np

    from balanced_loader.data.megatron import write_indexed_dataset
    from balanced_loader.data.open import open_source

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "c")
    write_indexed_dataset(prefix, [rng.integers(0, 50_000, int(n)).astype(np.uint16) for n in rng.integers(1, 900, 40)])
    assert _cli(["verify", prefix, "--write-checksums"], capsys)[0] == 0
    side = tmp_path / "c.crc32.npy"
    data = bytearray(side.read_bytes())
    data[60] ^= 1 << 3  # inside the header's shape tuple: '(40,)' loses its closing parenthesis
    side.write_bytes(bytes(data))
    rc, out, _ = _cli(["verify", prefix], capsys)
    assert rc == 2 and "checksum file" in out and "cannot be read" in out and "--write-checksums" in out, out
    with pytest.raises(ValueError, match="checksum file .* cannot be read"):
        src = open_source(prefix)
        for i in range(src.num_docs):
            src.tokens(i)


def test_analyze_of_a_doc_cut_into_too_many_sequences_is_one_line(tmp_path, capsys):
    """Found by tools/probe_turn3.py (issue 33): `analyze` of a 2**40-token doc at --max-seq-len 4096 built
    2**28 sequences with their ids and starts (a MemoryError after a minute under 6 GiB); now the lengths
    alone, and above 2**27 sequences one line."""
    from balanced_loader.cli.cmd_analyze import piece_lengths

    (tmp_path / "big.txt").write_text(f"{2**40}\n5\n")
    rc, _, err = _cli(["analyze", tmp_path / "big.txt", "--global-batch-tokens", 65536, "--max-seq-len", 4096,
                       "--out", tmp_path / "an"], capsys)
    assert rc == 2 and "cuts these docs into 268,435,457 sequences" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "an").exists()
    assert sorted(piece_lengths([10, 3, 8], 4).tolist()) == [2, 3, 4, 4, 4, 4]
