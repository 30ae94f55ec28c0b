"""Hugging Face clients: ``mb.to_hf()``, ``cp=1`` (plain data parallelism, equal microbatch counts) for
every policy, rank/world size defaults, argument errors before any data pass, a quiet interpreter exit,
``accelerator.skip_first_batches`` and ``wrap`` errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from balanced_loader import cli
from balanced_loader.cost import CostModel
from balanced_loader.loader import BalancedLoader, resolve_world
from balanced_loader.materialize import IGNORE_INDEX, Microbatch
from balanced_loader.plan import BatchItems, Plan
from balanced_loader.planning import POLICIES, make_plan
from balanced_loader.planning.config import PlanConfig
from balanced_loader.wrapping import wrap

torch = pytest.importorskip("torch")  # a dependency of the package: always there

COST = {"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0, "comm_bytes_per_token": 1e4,
        "bandwidth_gbs": {2: 10.0, 16: 1.0}, "max_tokens_per_lane": 64,
        "strategies": [{"tp": 2, "pp": 1, "max_tokens_per_lane": 128}]}
LENGTHS = [30, 7, 200, 64, 1, 15, 99, 3, 40, 250, 12, 8, 61, 5, 130, 22]
EXTRA = {"pools": {"pools": [{"tp": 1, "pp": 1, "lanes": 2}, {"tp": 1, "pp": 1, "lanes": 2}]}}


def cost() -> CostModel:
    return CostModel.from_dict(COST)


def docs(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, size=int(k)) for k in rng.integers(1, 300, size=n)]


def loader(rank, world=4, **kw):
    args = {"policy": "hydra", "cost": cost(), "global_batch_tokens": 900, "seed": 1, "cp": 1}
    args.update(kw)
    return wrap(docs(), world_size=world, rank=rank, **args)


# ---- to_hf ---------------------------------------------------------------------------------------

def test_to_hf_is_the_transformers_convention():
    ld = loader(0, world=1)
    seen = 0
    for batch in ld:
        for mb in batch.microbatches:
            hf = mb.to_hf()
            ids, labels, pos = hf["input_ids"], hf["labels"], hf["position_ids"]
            assert ids.shape == labels.shape == pos.shape == (1, mb.num_tokens) and ids.dtype == torch.int64
            np.testing.assert_array_equal(ids[0].numpy(), mb.input_ids)
            # unshifted: labels[t + 1] is the target of position t, i.e. mb.labels[t] (already shifted)
            np.testing.assert_array_equal(labels[0, 1:].numpy(), mb.labels[:-1])
            assert mb.labels[-1] == IGNORE_INDEX
            starts = mb.cu_seqlens[:-1]
            assert (labels[0, starts] == IGNORE_INDEX).all() and (pos[0, starts] == 0).all()
            for a, b in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:]):  # positions restart per doc
                np.testing.assert_array_equal(pos[0, a:b].numpy(), np.arange(b - a))
            keep = labels[0] != IGNORE_INDEX
            np.testing.assert_array_equal(labels[0, keep].numpy(), ids[0, keep].numpy())
            assert int(keep.sum()) == mb.num_valid_tokens
            for k in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens"):
                assert hf[k].dtype == torch.int32 and hf[k].tolist() == mb.cu_seqlens.tolist()
            longest = int(np.diff(mb.cu_seqlens).max())
            assert hf["max_length_q"] == hf["max_length_k"] == hf["max_seqlen"] == longest
            assert hf["use_cache"] is False
            seen += 1
    assert seen > 3


def test_to_hf_of_a_cp_lane_shard_gives_labels_shifted_before_sharding():
    ld = wrap(docs(), policy="maxlen", cost=cost(), world_size=4, rank=1, global_batch_tokens=900, cp=4)
    mb = next(iter(ld)).microbatches[0]
    assert mb.degree == 4
    hf = mb.to_hf()
    assert set(hf) == {"input_ids", "position_ids", "labels", "shift_labels", "use_cache"}
    np.testing.assert_array_equal(hf["input_ids"][0].numpy(), mb.input_ids)
    np.testing.assert_array_equal(hf["position_ids"][0].numpy(), mb.position_ids)  # the lane's true positions
    np.testing.assert_array_equal(hf["shift_labels"][0].numpy(), mb.labels)  # shifted before sharding
    assert torch.equal(hf["labels"], hf["shift_labels"]) and hf["use_cache"] is False


def test_flash_attention_kwarg_names_exist_in_transformers():
    fa = pytest.importorskip("transformers.modeling_flash_attention_utils")
    names = set(fa.FlashAttentionKwargs.__annotations__)
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= names


def test_transformers_loss_agrees_with_to_hf_and_packing_is_respected():
    """A tiny random Llama: the model's own ``labels=`` loss equals the manual shifted token sum, and
    packed docs give the same logits as each doc alone (no attention across doc boundaries)."""
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = tr.LlamaForCausalLM(cfg)
    mb = next(mb for b in loader(0, world=1) for mb in b.microbatches if len(mb.cu_seqlens) > 2)
    hf = mb.to_hf()
    out = model(**hf)
    manual = torch.nn.functional.cross_entropy(out.logits[0, :-1], hf["labels"][0, 1:], ignore_index=IGNORE_INDEX,
                                               reduction="sum")
    assert float(out.loss.detach()) * mb.num_valid_tokens == pytest.approx(float(manual.detach()), rel=1e-5)
    a, b = int(mb.cu_seqlens[1]), int(mb.cu_seqlens[2])
    alone = model(input_ids=hf["input_ids"][:, a:b], use_cache=False).logits
    assert (out.logits[0, a:b] - alone[0]).abs().max() < 1e-4


# ---- cp=1 in every policy ------------------------------------------------------------------------

@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_cp1_keeps_every_group_on_one_lane(policy):
    items = BatchItems.from_lengths(np.minimum(LENGTHS, 64))  # cp=1: a doc must fit one lane
    config = PlanConfig(policy=policy, world_size=4, cp=1, extra=EXTRA.get(policy, {}))
    plan = make_plan(items, cost(), config)
    plan.validate(np.minimum(LENGTHS, 64), cost())
    groups = [g for p in plan.pools for mb in p.microbatches for g in mb]
    assert groups and all(len(g.lanes) == 1 for g in groups)


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"pools"}))  # pools' layout is not a plan flag
def test_plan_cli_cp1_for_every_policy(policy, tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(map(str, LENGTHS)))
    out = tmp_path / "plan.json"
    argv = ["plan", "--lengths", str(lengths), "--world-size", "4", "--cost", "analytic:tiny@cpu",
            "--policy", policy, "--cp", "1", "--max-seq-len", "64", "--out", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    plan = Plan.load(str(out))
    assert all(len(g.lanes) == 1 for s in plan.steps for p in s.pools for mb in p.microbatches for g in mb)


@pytest.mark.parametrize("policy, flag, value", [("hydraulis", "tp", 2), ("hydraulis", "pp", 2),
                                                 ("hydraulis", "cp", 3), ("pools", "tp", 2),
                                                 ("hydra", "cp", 3), ("mcore-dcp", "cp", 8)])
def test_a_flag_a_policy_cannot_honour_is_one_clear_error(policy, flag, value):
    items = BatchItems.from_lengths(np.minimum(LENGTHS, 64))
    config = PlanConfig(policy=policy, world_size=4, **{flag: value}, extra=EXTRA.get(policy, {}))
    with pytest.raises(ValueError, match=f"--{flag} {value}") as e:
        make_plan(items, cost(), config)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("policy", ["hydra", "mcore-dcp", "flexsp", "greedy", "batch-ada"])
def test_cp_caps_the_degree_of_dynamic_policies(policy):
    items = BatchItems.from_lengths(LENGTHS)  # the longest (250) needs 4 lanes of 64
    for cp in (4, 8):
        plan = make_plan(items, cost(), PlanConfig(policy=policy, world_size=8, cp=cp))
        assert max(len(g.lanes) for p in plan.pools for mb in p.microbatches for g in mb) <= cp


def test_hydra_plan_config_cp1_forms_no_cp_groups():
    """The issue: hydra at world size 4 put 96% of microbatches on CP lane shards despite cp=1."""
    for r in range(4):
        ld = wrap(docs(), policy="hydra", cost="analytic:tiny@cpu", world_size=4, rank=r,
                  global_batch_tokens=2000, plan_config={"cp": 1})
        assert all(mb.degree == 1 for b in ld for mb in b.microbatches)


# ---- equal microbatch counts ---------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["hydra", "greedy", "token-kk", "flexsp", "mcore-dcp"])
def test_cp1_gives_every_rank_the_same_microbatch_count(policy):
    source = docs()
    world = 4
    loaders = [loader(r, world=world, policy=policy) for r in range(world)]
    seen: dict[int, list[tuple[int, np.ndarray]]] = {}
    padded = 0
    for steps in zip(*loaders):
        counts = {len(b.microbatches) for b in steps}
        assert len(counts) == 1 and counts.pop() >= 1
        valid = 0
        for b in steps:
            for mb in b.microbatches:
                hf = mb.to_hf()
                valid += int((hf["labels"][0, 1:] != IGNORE_INDEX).sum())
                if mb.padding:
                    padded += 1
                    assert mb.num_tokens == 1 and mb.num_valid_tokens == 0 and mb.segments == ((-1, 0, 1),)
                    continue
                o = 0
                for doc, start, n in mb.segments:
                    seen.setdefault(doc, []).append((start, mb.input_ids[o:o + n]))
                    o += n
        assert valid == steps[0].num_valid_tokens  # the plan's global count (no collective)
    for doc, pieces in seen.items():  # every doc delivered once, tokens intact
        pieces.sort(key=lambda p: p[0])
        np.testing.assert_array_equal(np.concatenate([p[1] for p in pieces]), source[doc])
    assert sorted(seen) == list(range(len(source)))
    if policy == "hydra":
        assert padded > 0  # the case the padding exists for is exercised


def test_cp1_microbatches_are_balanced_by_the_cost_model():
    """hydra under cp=1: the lanes' predicted loads are close (not just equal microbatch counts)."""
    c = cost()
    ld = BalancedLoader([int(x) for x in np.random.default_rng(3).integers(1, 64, size=2000)], policy="hydra",
                        cost=c, world_size=8, rank=0, global_batch_tokens=20000, cp=1)
    for batch in ld:
        loads = np.zeros(8)
        for mb in batch.plan.pools[0].microbatches:
            for g in mb:
                loads[g.lanes[0]] += c.group_ms([s[2] for s in g.segments], 1)
        # lanes differ by at most one pass's fixed cost (passes are whole) plus 2% of the work
        assert loads.max() - loads.min() <= c.base.microbatch_ms + 0.02 * loads.mean()


# ---- rank / world size defaults --------------------------------------------------------------------

def test_rank_and_world_size_from_the_environment(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert resolve_world(None, None) == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="rank is not set"):
        resolve_world(None, None)
    monkeypatch.setenv("RANK", "3")
    assert resolve_world(None, None) == (3, 4)
    assert resolve_world(1, 2) == (1, 2)  # arguments win
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="LOCAL_RANK=0"):
        BalancedLoader([5, 6], cost=cost(), global_batch_tokens=10)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        resolve_world(None, 4)


def test_rank_and_world_size_from_an_initialized_process_group(tmp_path):
    """A real 1-process gloo group in a fresh interpreter: the loader takes rank and world size from it."""
    code = textwrap.dedent(f"""
        import torch.distributed as dist
        from balanced_loader import BalancedLoader
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        ld = BalancedLoader([5, 6, 7], cost="analytic:tiny@cpu", global_batch_tokens=10)
        print(ld.rank, ld.world_size)
        dist.destroy_process_group()
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1"]


# ---- argument errors, wrap, exit, skip -------------------------------------------------------------

class Counting:
    def __init__(self, n=20):
        self.docs = docs(n)
        self.gets = 0

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        self.gets += 1
        return self.docs[i]


@pytest.mark.parametrize("kw, needle", [({"polcy": "hydra"}, "unknown keyword(s) ['polcy']"),
                                        ({"world_size": 0}, "world_size must be in 1..1,048,576, got 0"),
                                        ({"policy": "nope"}, "unknown policy 'nope'"),
                                        ({"cp": 0}, "cp must be a positive integer"),
                                        ({"plan_config": {"cpp": 1}}, "plan_config: unknown key"),
                                        ({"cost": "nope"}, "nope")])
def test_wrap_argument_errors_come_before_any_pass_over_the_data(kw, needle):
    ds = Counting()
    args = {"cost": cost(), "world_size": 2, "rank": 0, "global_batch_tokens": 100}
    args.update(kw)
    with pytest.raises(ValueError) as e:
        wrap(ds, **args)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert ds.gets == 0


def test_wrap_a_dict_of_columns_and_clear_errors():
    d = docs(10)
    ld = wrap({"input_ids": [x.tolist() for x in d]}, cost=cost(), world_size=1, global_batch_tokens=300)
    assert ld.source.num_docs == 10
    with pytest.raises(ValueError, match="no 'input_ids' column"):
        wrap({"text": ["a"]}, cost=cost(), world_size=1, global_batch_tokens=300)

    class Keyed(Counting):
        def __getitem__(self, i):
            return {"a": self.docs[0]}[i]

    with pytest.raises(ValueError, match=r"dataset\[0\] raised KeyError") as e:
        wrap(Keyed(), cost=cost(), world_size=1, global_batch_tokens=300)
    assert "\n" not in str(e.value)


def test_no_output_at_interpreter_exit(tmp_path):
    """A loader over shards left mid-epoch (planner thread and open files alive) exits silently."""
    code = textwrap.dedent(f"""
        import numpy as np, torch
        from balanced_loader import BalancedLoader
        from balanced_loader.build.writer import write_shards
        rng = np.random.default_rng(0)
        src = write_shards([rng.integers(1, 100, size=int(n)) for n in rng.integers(5, 300, size=300)],
                           "{tmp_path}/shards")
        loaders = [BalancedLoader("{tmp_path}/shards", cost="analytic:tiny@cpu", world_size=2, rank=r,
                                  global_batch_tokens=3000, cp=1, planner_workers=w) for r, w in ((0, 0), (1, 1))]
        for ld in loaders:
            it = iter(ld)
            next(it), next(it)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and r.stderr == "" and r.stdout == "", r.stderr


def test_accelerate_skip_first_batches_continues_the_loader():
    accelerate = pytest.importorskip("accelerate")
    ref = [b.plan.fingerprint() for b in loader(1, world=2)]
    ld = loader(1, world=2)
    skipped = accelerate.Accelerator(cpu=True).skip_first_batches(ld, 2)
    got = list(skipped)
    assert all(type(b).__name__ == "StepBatch" for b in got)
    assert [b.plan.fingerprint() for b in got] == ref[2:]
    assert len(ref) > 3


def test_padding_microbatch_is_a_real_microbatch():
    from balanced_loader.materialize import RankPlace, padding_microbatch

    mb = padding_microbatch(RankPlace(pool=0, stage=0, lane=3, tp_index=0, pp=1), lane=3, pad_id=7)
    assert isinstance(mb, Microbatch) and mb.padding and mb.input_ids.tolist() == [7]
    hf = mb.to_hf()
    assert hf["labels"].tolist() == [[IGNORE_INDEX]] and hf["max_seqlen"] == 1
