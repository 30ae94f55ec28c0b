"""A hostile probe of what issue 38 built: bounded mixtures and schedules, checked calibration states, outputs
never clobbered, RL balancing at extremes, the HF vocabulary checks.

Four parts, each a count of cases and of failures (a failure: a traceback, an exception that is not one
``ValueError`` line, an exit code other than 2, more than one stderr line, a file written or changed
where nothing should be, a hang past its timeout):

* ``inputs``: hostile API and CLI cases (extreme weights and schedules, blank length lines, repeated
  plan steps, outputs that are inputs, devices or links to devices, RL extremes), and a fuzz of
  calibration states (random leaves of a real state replaced by hostile values: each must load, and
  then fit, or be one ``ValueError`` line that changed nothing);
* ``kill``: ``trace --out J --png P`` killed with SIGKILL at random moments over a previous pair: the
  pair left is always the old one or the new one, never mixed; the next run removes the hidden
  temporary files the killed ones left;
* ``concurrency``: runs of ``trace`` (two step ranges) and ``compare`` (two seeds) publishing into the
  same outputs at once: the set left is always one run's, whole;
* ``disk``: a full disk (a 256 KiB tmpfs when this process may mount one, else a file size limit):
  ``plan``, ``trace --png``, ``compare``, ``analyze`` exit 2 in one line, the previous outputs byte for
  byte, no folder or temporary file of theirs left.

    python tools/probe_reliability3.py --json docs/results/reliability3_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
COST = ("quadratic_ms: 0.0\nlinear_ms: 1.0\nmicrobatch_ms: 0.0\ncomm_bytes_per_token: 0.0\n"
        "bandwidth_gbs: {2: 100.0}\nmax_tokens_per_lane: 1000\n")


def cli(*argv, timeout: float = 300, limit: int | None = None) -> tuple[int, str]:
    def pre() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    r = subprocess.run([sys.executable, "-m", "balanced_loader", *map(str, argv)], capture_output=True, text=True,
                       env=ENV, timeout=timeout, preexec_fn=pre)
    return r.returncode, r.stderr


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
            for p in sorted(folder.rglob("*"))}


class Tally:
    def __init__(self) -> None:
        self.cases: dict[str, list[str]] = {}

    def add(self, part: str, name: str, ok: bool, why: str = "") -> None:
        self.cases.setdefault(part, [])
        if not ok:
            self.cases[part].append(f"{name}: {why[:200]}")
        self.counts = getattr(self, "counts", {})
        self.counts[part] = self.counts.get(part, 0) + 1


# ---- inputs -------------------------------------------------------------------------------------


def setup(root: Path) -> None:
    with gzip.open(REPO / "data" / "wikipedia_lengths.txt.gz", "rt") as f:
        wiki = [min(int(x), 2000) for _, x in zip(range(6000), f)]
    (root / "L1.txt").write_text("\n".join(map(str, wiki[:4000])) + "\n")
    (root / "L3.txt").write_text("\n".join(map(str, wiki[4000:])) + "\n")
    (root / "cost.yaml").write_text(COST)
    (root / "blank.txt").write_text("10\n20\n\n30\n")
    rc, err = cli("plan", "--lengths", root / "L1.txt", "--global-batch-tokens", 20000, "--world-size", 16,
                  "--cost-file", root / "cost.yaml", "--policy", "hydra", "--max-seq-len", 1000, "--steps", 3,
                  "--out", root / "p16.json")
    assert rc == 0, err
    plan = json.loads((root / "p16.json").read_text())
    plan["steps"] = [plan["steps"][0]] * 3
    (root / "p_repeat.json").write_text(json.dumps(plan))
    os.mkfifo(root / "fifo")
    (root / "null.json").symlink_to("/dev/null")


def cli_cases(root: Path) -> list[tuple[str, list]]:
    d, c = root, ["--cost-file", root / "cost.yaml"]
    mix = ["--global-batch-tokens", 65536, "--world-size", 2, *c, "--policy", "greedy", "--max-seq-len", 1000]
    return [
        ("plan --mix share 1e-9 (the issue's)", ["plan", "--mix", f"web={d}/L1.txt:1", f"code={d}/L3.txt:1e-9", *mix,
                                                "--out", d / "o.json"]),
        ("plan --mix share 1e-4, no --steps", ["plan", "--mix", f"web={d}/L1.txt:1", f"code={d}/L3.txt:1e-4", *mix,
                                              "--out", d / "o.json"]),
        ("plan --mix 1e200/1/1e-200", ["plan", "--mix", f"a={d}/L1.txt:1e200", f"b={d}/L3.txt:1",
                                       f"c={d}/L1.txt:1e-200", *mix, "--out", d / "o.json"]),
        ("plan --mix 4.9e-324 (subnormal)", ["plan", "--mix", f"a={d}/L1.txt:1", f"b={d}/L3.txt:4.9e-324", *mix]),
        ("plan --mix weight inf", ["plan", "--mix", f"a={d}/L1.txt:1", f"b={d}/L3.txt:inf", *mix]),
        ("plan --mix weight -1", ["plan", "--mix", f"a={d}/L1.txt:1", f"b={d}/L3.txt:-1", *mix]),
        ("plan schedule 10**15 tokens", ["plan", "--lengths", d / "L1.txt", "--global-batch-tokens",
                                         "1000@0,1000000000000000@5", "--world-size", 2, *c, "--policy", "greedy"]),
        ("plan --global-batch-tokens 1, no --steps", ["plan", "--lengths", d / "L1.txt", "--global-batch-tokens", 1,
                                                      "--world-size", 2, *c, "--policy", "greedy", "--out",
                                                      d / "o.json"]),
        ("plan every doc dropped", ["plan", "--lengths", d / "L1.txt", "--world-size", 2, *c, "--policy", "greedy",
                                    "--max-seq-len", 1, "--long-docs", "drop", "--out", d / "o.json"]),
        ("plan blank length line", ["plan", "--lengths", d / "blank.txt", "--world-size", 2, *c, "--policy",
                                    "greedy", "--out", d / "o.json"]),
        ("simulate steps 0,0,0", ["simulate", d / "p_repeat.json", *c]),
        ("trace --out = its plan", ["trace", d / "p16.json", *c, "--out", d / "p16.json"]),
        ("trace --png = its plan via a link", ["trace", d / "p16.json", *c, "--png", d / "p16link.json"]),
        ("trace --out /dev/full", ["trace", d / "p16.json", *c, "--out", "/dev/full"]),
        ("trace --out /dev/stdout", ["trace", d / "p16.json", *c, "--out", "/dev/stdout"]),
        ("trace --out a link to /dev/null", ["trace", d / "p16.json", *c, "--out", d / "null.json"]),
        ("trace --out a fifo", ["trace", d / "p16.json", *c, "--out", d / "fifo"]),
        ("trace --out = --png", ["trace", d / "p16.json", *c, "--out", d / "t.json", "--png", d / "t.json"]),
        ("trace --out /proc/self/status", ["trace", d / "p16.json", *c, "--out", "/proc/self/status"]),
        ("plan --out its --lengths", ["plan", "--lengths", d / "L1.txt", "--world-size", 2, *c, "--policy", "greedy",
                                      "--out", d / "L1.txt"]),
        ("plan --out its cost file", ["plan", "--lengths", d / "L1.txt", "--world-size", 2, *c, "--policy",
                                      "greedy", "--out", d / "cost.yaml"]),
        ("compare --out a file", ["compare", "--lengths", d / "L1.txt", "--world-size", 2, *c, "--policies",
                                  "greedy", "--out", d / "L1.txt"]),
        ("compare --out /dev", ["compare", "--lengths", d / "L1.txt", "--world-size", 2, *c, "--policies", "greedy",
                                "--out", "/dev"]),
        ("compare late error, new --out", ["compare", "--lengths", d / "L1.txt", "--world-size", 2, *c,
                                           "--policies", "greedy", "--steps", 2, "--global-batch-tokens", 20000,
                                           "--chart-step", 9, "--out", d / "new" / "cmp"]),
        ("analyze --out = an input folder", ["analyze", d / "an" / "analyze.json", "--out", d / "an"]),
        ("build-shards --out = its input", ["build-shards", d / "L1.txt", "--out", d / "L1.txt"]),
        ("candidates --out /dev/null", ["candidates", "--lengths", d / "L1.txt", "--world-size", 8, *c,
                                        "--out", "/dev/null"]),
    ]


def api_cases(root: Path) -> list[tuple[str, object]]:
    import numpy as np

    import balanced_loader as bl
    from balanced_loader.cost import CostModel
    from balanced_loader.data.mixture import mix
    from balanced_loader.schedule import setting

    cost = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                                "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": 512})
    L1, L3 = str(root / "L1.txt"), str(root / "L3.txt")

    def loader(weights=None, **kw):
        args = {"policy": "greedy", "cost": cost, "world_size": 2, "rank": 0, "global_batch_tokens": 8192,
                "max_seq_len": 512, "epochs": 1, **kw}
        ld = bl.BalancedLoader(mix({"a": L1, "b": L3}, weights=weights) if weights else [5, 6, 7], **args)
        next(ld)
        ld.close()

    import torch

    def rl(lengths, **kw):
        return bl.balance(lengths, **{"world_size": 2, "max_tokens_per_microbatch": 64, **kw})

    ids = torch.randint(1, 100, (5, 8))
    return [
        ("mix 1e200/1/1e-200", lambda: mix({"a": L1, "b": L3, "c": [5, 6]}, weights={"a": 1e200, "b": 1, "c": 1e-200})),
        ("mix weight nan", lambda: mix({"a": L1, "b": L3}, weights={"a": 1.0, "b": float("nan")})),
        ("mix weight 1e309 (inf)", lambda: mix({"a": L1, "b": L3}, weights={"a": 1.0, "b": 1e309})),
        ("mix weights [(0, 1e308)] schedules", lambda: loader({"a": [(0, 1e308), (5, 1.0)], "b": 1e308})),
        ("loader schedule 10**15", lambda: loader(None, global_batch_tokens=[(0, 4096), (3, 10**15)])),
        ("schedule step 2**70", lambda: setting([(0, 10), (2**70, 20)], "g")),
        ("rl world 10**9", lambda: rl([3, 5], world_size=10**9)),
        ("rl cap 2**70", lambda: rl([3, 5], max_tokens_per_microbatch=2**70)),
        ("rl lengths inf", lambda: rl([3.0, float("inf")])),
        ("rl lengths nan", lambda: rl([3.0, float("nan")])),
        ("rl lengths bf16", lambda: rl(torch.tensor([3.0, 5.0], dtype=torch.bfloat16))),
        ("rl lengths meta", lambda: rl(torch.zeros(3, dtype=torch.long, device="meta"))),
        ("rl lengths 2**63 uint64", lambda: rl(np.array([3, 2**63], dtype=np.uint64))),
        ("rl lengths object", lambda: rl(np.array([3, "x"], dtype=object))),
        ("rl batch pad_id -1", lambda: bl.balance_batch({"input_ids": ids}, world_size=2, max_tokens_per_microbatch=64,
                                                        pad_id=-1)),
        ("rl batch bf16 ids", lambda: bl.balance_batch({"input_ids": ids.to(torch.bfloat16)}, world_size=2,
                                                       max_tokens_per_microbatch=64)),
        ("rl batch a dict field", lambda: bl.balance_batch({"input_ids": ids, "x": {"a": 1}}, world_size=2,
                                                           max_tokens_per_microbatch=64)),
    ]


def probe_inputs(root: Path, tally: Tally, fuzz: int) -> None:
    (root / "p16link.json").symlink_to(root / "p16.json")
    rc, err = cli("analyze", root / "L1.txt", "--top", 3, "--out", root / "an")
    assert rc == 0, err
    for name, argv in cli_cases(root):
        before = listing(root)
        t0 = time.monotonic()
        try:
            rc, err = cli(*argv, timeout=120)
        except subprocess.TimeoutExpired:
            tally.add("inputs", name, False, "over 120 s")
            continue
        lines = err.strip().splitlines()
        after = listing(root)
        ok = rc == 2 and len(lines) == 1 and "Traceback" not in err and after == before
        why = f"rc {rc}, {len(lines)} lines, changed {sorted(set(after) ^ set(before))[:3]}: {err.strip()[-160:]}"
        tally.add("inputs", f"cli {name} ({time.monotonic() - t0:.1f} s)", ok, why)
    for name, fn in api_cases(root):
        try:
            fn()
            tally.add("inputs", f"api {name}", name.startswith("mix weights [(0, 1e308)]"), "no error")
        except ValueError as e:
            tally.add("inputs", f"api {name}", "\n" not in str(e), str(e))
        except Exception as e:
            tally.add("inputs", f"api {name}", False, f"{type(e).__name__}: {e}")
    fuzz_calibration(tally, fuzz)


HOSTILE = [-1, 0, 99, 2**70, 1e300, -1e300, float("nan"), float("inf"), None, True, "x", [], {}, [1, 2], 0.5]


def _leaves(d, path=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(d, list) and d:
        for i, v in enumerate(d):
            yield from _leaves(v, (*path, i))
    yield path


def fuzz_calibration(tally: Tally, n: int) -> None:
    import numpy as np

    from balanced_loader.calibration import CalibrationOptions, Calibrator, Samples, sample_rows
    from balanced_loader.cost import CostModel

    true = CostModel.from_dict({"quadratic_ms": 2e-5, "linear_ms": 0.01, "microbatch_ms": 1.5,
                                "comm_bytes_per_token": 2e5, "bandwidth_gbs": {2: 50.0}, "max_tokens_per_lane": 4096})
    rng = np.random.default_rng(0)

    def step(s):
        parts = []
        for r in range(2):
            groups = [(1, 1, 1, 1, rng.integers(16, 2000, 2).tolist()) for _ in range(4)]
            comp = [true.shape(1, 1).group_ms(g[4], 1) for g in groups]
            parts.append(sample_rows(s, r, groups, comp, comp))
        return Samples.concat(parts)

    opts = CalibrationOptions(every=1, first=1, window=4)
    cal = Calibrator(true.scaled(3), 2, opts)
    for s in range(3):
        cal.observe(s, step(s))
    good = json.loads(json.dumps(cal.state_dict()))
    paths = [p for p in _leaves(good) if p]
    r = random.Random(1)
    loaded = refused = 0
    for i in range(n):
        d = copy.deepcopy(good)
        path = r.choice(paths)
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = r.choice(HOSTILE)
        c = Calibrator(true.scaled(3), 2, opts)
        before = json.dumps(c.state_dict(), sort_keys=True, default=str)
        try:
            c.load_state_dict(d)
        except ValueError as e:
            refused += 1
            same = json.dumps(c.state_dict(), sort_keys=True, default=str) == before
            tally.add("fuzz", f"state {i} {path}", "\n" not in str(e) and same, f"changed: {not same}; {e}")
            continue
        except Exception as e:
            tally.add("fuzz", f"state {i} {path}", False, f"{type(e).__name__}: {e}")
            continue
        try:
            for s in range(3, 6):
                c.observe(s, step(s))
            loaded += 1
            tally.add("fuzz", f"state {i} {path}", True)
        except Exception as e:
            tally.add("fuzz", f"state {i} {path} (fit after load)", False, f"{type(e).__name__}: {e}")
    tally.fuzz = {"states": n, "loaded and fitted": loaded, "refused": refused}


# ---- kill -9 --------------------------------------------------------------------------------------


def probe_kill(root: Path, tally: Tally, runs: int) -> None:
    c = ["--cost-file", root / "cost.yaml"]
    ref = {}
    for tag, steps in (("old", "0"), ("new", "0-2")):
        out = root / f"ref_{tag}"
        out.mkdir()
        t0 = time.monotonic()
        rc, err = cli("trace", root / "p16.json", *c, "--steps", steps, "--out", out / "t.json", "--png", out / "t.png")
        assert rc == 0, err
        ref[tag] = ((out / "t.json").read_bytes(), (out / "t.png").read_bytes())
        full = time.monotonic() - t0  # the new run's length: kills fall anywhere in it
    work = root / "kill"
    work.mkdir()
    rnd = random.Random(7)
    outcomes: dict[str, int] = {}
    for i in range(runs):
        (work / "t.json").write_bytes(ref["old"][0])
        (work / "t.png").write_bytes(ref["old"][1])
        p = subprocess.Popen([sys.executable, "-m", "balanced_loader", "trace", str(root / "p16.json"), *map(str, c),
                              "--steps", "0-2", "--out", str(work / "t.json"), "--png", str(work / "t.png")],
                             env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rnd.uniform(0.3, 1.1) * full)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
        pair = ((work / "t.json").read_bytes(), (work / "t.png").read_bytes())
        kind = "old pair" if pair == ref["old"] else "new pair" if pair == ref["new"] else "mixed"
        outcomes[kind] = outcomes.get(kind, 0) + 1
        tally.add("kill", f"kill {i}", kind != "mixed", kind)
        if any(f.name.startswith(".") for f in work.iterdir()):  # a killed run's hidden temporary files
            outcomes["runs that left a hidden file"] = outcomes.get("runs that left a hidden file", 0) + 1
    rc, err = cli("trace", root / "p16.json", *c, "--steps", "0-2", "--out", work / "t.json", "--png", work / "t.png")
    left = sorted(f.name for f in work.iterdir() if f.name.startswith("."))
    outcomes["hidden files after the next run"] = len(left)  # it removes those of dead processes
    tally.add("kill", "the next run cleans up", rc == 0 and not left, f"rc {rc}, left {left}: {err[-160:]}")
    tally.kill = outcomes


# ---- concurrency ------------------------------------------------------------------------------------


def probe_concurrency(root: Path, tally: Tally, rounds: int) -> None:
    c = ["--cost-file", str(root / "cost.yaml")]
    ref = {s: ((root / f"ref_{t}" / "t.json").read_bytes(), (root / f"ref_{t}" / "t.png").read_bytes())
           for s, t in (("0", "old"), ("0-2", "new"))}
    out = root / "conc"
    out.mkdir()
    for i in range(rounds):
        procs = [subprocess.Popen([sys.executable, "-m", "balanced_loader", "trace", str(root / "p16.json"), *c,
                                   "--steps", s, "--out", str(out / "t.json"), "--png", str(out / "t.png")],
                                  env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for s in ("0", "0-2", "0", "0-2")]
        rcs = [p.wait(timeout=600) for p in procs]
        pair = ((out / "t.json").read_bytes(), (out / "t.png").read_bytes())
        whole = pair in ref.values()
        tally.add("concurrency", f"trace round {i}", whole and rcs == [0] * 4, f"rcs {rcs}, whole {whole}")
    cmp = root / "cmpc"
    base = ["compare", "--lengths", str(root / "L1.txt"), "--world-size", "4", *c, "--policies", "greedy,maxlen",
            "--global-batch-tokens", "20000", "--steps", "2", "--shuffle", "--out", str(cmp)]
    for i in range(max(1, rounds // 2)):
        procs = [subprocess.Popen([sys.executable, "-m", "balanced_loader", *base, "--seed", str(s)], env=ENV,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for s in (1, 2, 1, 2)]
        rcs = [p.wait(timeout=600) for p in procs]
        seed = json.loads((cmp / "compare.json").read_text())["settings"]["seed"]
        solo = root / f"cmp_seed{seed}"
        if not solo.exists():
            subprocess.run([sys.executable, "-m", "balanced_loader", *base[:-1], str(solo), "--seed", str(seed)],
                           env=ENV, capture_output=True, check=True)
        same = all((cmp / f).read_bytes() == (solo / f).read_bytes() for f in ("rank_load.png", "step_times.png"))
        tally.add("concurrency", f"compare round {i}", same and rcs == [0] * 4, f"rcs {rcs}, charts of seed {seed}: "
                                                                                f"{same}")


# ---- full disk ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def small_disk(root: Path):
    """A 256 KiB tmpfs (root may mount one), else None (the cases then run under a file size limit)."""
    mnt = root / "disk"
    mnt.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True).returncode
    try:
        yield mnt if ok == 0 else None
    finally:
        if ok == 0:
            subprocess.run(["umount", str(mnt)], capture_output=True)


def probe_disk(root: Path, tally: Tally) -> None:
    c = ["--cost-file", root / "cost.yaml"]
    with small_disk(root) as mnt:
        where = mnt or (root / "limited")
        where.mkdir(exist_ok=True)
        tally.disk_kind = "tmpfs 256 KiB" if mnt else "RLIMIT_FSIZE"
        cases = [("plan", ["plan", "--lengths", root / "L1.txt", "--global-batch-tokens", 20000, "--world-size", 64,
                           *c, "--policy", "hydra", "--max-seq-len", 1000, "--steps", 100, "--out", where / "p.json"]),
                 ("trace --png", ["trace", root / "p16.json", *c, "--out", where / "t.json", "--png", where / "t.png"]),
                 ("compare", ["compare", "--lengths", root / "L1.txt", "--world-size", 4, *c, "--policies",
                              "greedy,maxlen", "--global-batch-tokens", 20000, "--steps", 2, "--out", where / "cmp"]),
                 ("analyze", ["analyze", root / "L1.txt", "--out", where / "an" / "x"])]
        for name, argv in cases:
            for f in list(where.iterdir()):  # each case on an emptied disk, filled to leave ~40 KiB
                shutil.rmtree(f) if f.is_dir() else f.unlink()
            (where / "old.txt").write_text("previous output\n")
            if mnt:
                free = shutil.disk_usage(mnt).free
                (where / "fill").write_bytes(b"\0" * max(0, free - 40_000))
            before = listing(where)
            rc, err = cli(*argv, limit=None if mnt else 40_000)
            after = listing(where)
            lines = err.strip().splitlines()
            ok = rc == 2 and len(lines) == 1 and after == before and ("space" in err or "too large" in err)
            tally.add("disk", name, ok, f"rc {rc}, {len(lines)} lines, left {sorted(set(after) - set(before))}: "
                                        f"{err.strip()[-160:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fuzz", type=int, default=300, help="mutated calibration states")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4, help="concurrency rounds")
    ap.add_argument("--json", help="write the tally here")
    a = ap.parse_args()
    tally = Tally()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        setup(root)
        probe_inputs(root, tally, a.fuzz)
        probe_kill(root, tally, a.kills)
        probe_concurrency(root, tally, a.rounds)
        probe_disk(root, tally)
    report = {"seconds": round(time.monotonic() - t0), "cases": tally.counts,
              "failures": {k: v for k, v in tally.cases.items() if v}, "fuzz": getattr(tally, "fuzz", None),
              "kill": getattr(tally, "kill", None), "disk": getattr(tally, "disk_kind", None)}
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
