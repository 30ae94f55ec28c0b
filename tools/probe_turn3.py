"""A hostile probe of what this turn's other issues built (33: sequences as the unit of a step; 34: Megatron
indexed datasets, datatrove token files, ``HydraCPScheduler``; 35: the planner portfolio), in the style of
``probe_reliability3.py``: each case counts as held or failed (a failure: a traceback or an exception that is
not one ``ValueError`` line, a CLI exit other than 0/2 or a multi-line error, a hang past its timeout, or
changed data accepted silently where the format can tell).

* ``megatron``: a real dataset (Wikipedia lengths, random ids) with its crc32 sidecar; random byte flips and
  truncations of ``.idx`` / ``.bin`` / the sidecar: open, read every doc, then ``verify PREFIX``;
* ``datatrove``: the same on ``.ds`` / ``.ds.index`` (a moved doc boundary that keeps the index sound
  is undetectable: the format has no checksum; counted apart);
* ``hydra``: ``HydraCPScheduler`` on hostile lengths, ids and sizes, its schedule checked by Megatron's rules;
* ``steps``: ``plan`` and ``analyze`` with docs of 2**40 tokens, max_seq_len 1, schedules crossing the budget,
  and hydra on 2**20 ranks (each in a process limited to 180 s and 6 GiB of address space);
* ``kill`` / ``concurrency`` / ``disk``: ``verify PREFIX --write-checksums`` killed with SIGKILL at random
  moments, three at once, and with a file size limit below the sidecar: the sidecar is absent or whole,
  one line on a full disk, no temporary file left.

    python tools/probe_turn3.py --json docs/results/turn3_probe.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


class Cases:
    def __init__(self) -> None:
        self.parts: dict[str, dict[str, int]] = {}
        self.failures: list[str] = []

    def add(self, part: str, name: str, outcome: str, ok: bool, detail: str = "") -> None:
        p = self.parts.setdefault(part, {})
        p[outcome] = p.get(outcome, 0) + 1
        if not ok:
            self.failures.append(f"{part}: {name}: {outcome}: {detail[:300]}")


def guarded(fn, timeout: int = 60) -> tuple[str, str]:
    """Run ``fn()`` in this process with an alarm: ('ok', ''), ('one line', msg), ('FAIL ...', detail)."""
    def alarm(*_):
        raise TimeoutError("hang")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    try:
        fn()
        return "ok", ""
    except ValueError as e:
        msg = str(e)
        return ("one line", msg) if msg and "\n" not in msg.strip() else ("FAIL multi-line", msg)
    except TimeoutError:
        return "FAIL hang", ""
    except Exception as e:  # any other exception is what the probe counts
        return f"FAIL {type(e).__name__}", str(e)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def wiki(n: int) -> list[int]:
    with gzip.open(REPO / "data" / "wikipedia_lengths.txt.gz", "rt") as f:
        return [max(1, min(int(x), 5000)) for _, x in zip(range(n), f)]


def cli(*argv, timeout: float = 120, limit: int | None = None, memory: int | None = None) -> tuple[int, str, str]:
    def pre() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        if memory is not None:  # address space: a run that would hold too much fails instead of swapping
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    try:
        r = subprocess.run([sys.executable, "-m", "balanced_loader", *map(str, argv)], capture_output=True, text=True,
                           env=ENV, timeout=timeout, preexec_fn=pre)
    except subprocess.TimeoutExpired:
        return -1, "", "hang"
    return r.returncode, r.stdout, r.stderr


def read_all(path: str) -> None:
    from balanced_loader.data.open import open_source

    src = open_source(path)
    n = src.num_docs
    for i in range(n):
        src.tokens(i)


def mutate(rng: random.Random, path: str) -> str:
    data = bytearray(Path(path).read_bytes())
    if rng.random() < 0.3 and len(data) > 1:
        cut = rng.randrange(len(data))
        Path(path).write_bytes(bytes(data[:cut]))
        return f"truncated to {cut} of {len(data)}"
    k = rng.choice([1, 1, 2, 8])
    where = []
    for _ in range(k):
        i = rng.randrange(min(len(data), 4096) if rng.random() < 0.6 else len(data))
        data[i] ^= 1 << rng.randrange(8)
        where.append(i)
    Path(path).write_bytes(bytes(data))
    return f"bits flipped at {where}"


def probe_files(root: Path, cases: Cases, part: str, n: int, seed: int) -> None:
    """Random damage to one file of a dataset, then open + read every doc + verify."""
    import shutil

    import numpy as np

    rng = random.Random(seed)
    base = root / f"{part}_good"
    base.mkdir()
    lens = wiki(400)
    ids = np.random.default_rng(seed)
    docs = [ids.integers(0, 50_000, n_).astype(np.uint16) for n_ in lens]
    if part == "megatron":
        from balanced_loader.data.megatron import write_indexed_dataset

        write_indexed_dataset(str(base / "c"), docs)
        assert cli("verify", base / "c", "--write-checksums")[0] == 0
        files = ["c.idx", "c.bin", "c.crc32.npy"]
    else:
        with open(base / "x_00000.ds", "wb") as f:
            for d in docs:
                f.write(d.astype("<u2").tobytes())
        np.cumsum(np.asarray(lens, dtype="<u8")).astype("<u8").tofile(base / "x_00000.ds.index")
        (base / "x_00000.ds.metadata").write_text(f"gpt2|2\n{sum(lens)}\n")
        files = ["x_00000.ds", "x_00000.ds.index", "x_00000.ds.metadata"]
    for k in range(n):
        work = root / f"{part}_{k}"
        shutil.copytree(base, work)
        name = rng.choice(files)
        how = mutate(rng, str(work / name))
        changed = (work / name).read_bytes() != (base / name).read_bytes()
        path = str(work / "c") if part == "megatron" else str(work)
        outcome, msg = guarded(lambda path=path: read_all(path))
        rc, out, err = cli("verify", path)
        if not outcome.startswith("FAIL") and rc == 2 and (len(err.strip().splitlines()) > 1 or
                                                           (not err.strip() and "problem:" not in out)):
            outcome, msg = "FAIL verify said nothing" if not err.strip() else "FAIL verify multi-line", out + err
        if rc not in (0, 1, 2) or "Traceback" in err:
            outcome, msg = f"FAIL verify rc {rc}", err[-300:]
        if outcome == "ok" and changed and rc == 0:
            # accepted: a datatrove index edit that keeps the index sound moves a boundary no format check sees
            outcome = "accepted (no checksum in the format)" if part == "datatrove" and not name.endswith("metadata") \
                else "accepted (metadata: token count unused)" if name.endswith(".metadata") else "FAIL silent"
        elif outcome == "ok" and rc in (1, 2):
            outcome = "found by verify"
        cases.add(part, f"{name} {how}", outcome, not outcome.startswith("FAIL"), msg or err[-300:])
        shutil.rmtree(work)


def probe_hydra(cases: Cases) -> None:
    import numpy as np

    from balanced_loader.integrations.megatron import HydraCPScheduler, check_schedule

    w = wiki(2000)
    inputs = {
        "empty": [], "one zero": [(0, 0)], "negative": [(0, -5), (1, 10)], "nan": [(0, float("nan"))],
        "float": [(0, 1.5)], "2**40": [(0, 2**40)], "2**70": [(0, 2**70)], "bool": [(0, True)],
        "string length": [(0, "10")], "too long for the world": [(0, 8 * 4096 + 1)],
        "duplicate ids": [(0, 10), (0, 20)], "unhashable ids": [([1], 10)], "none": None,
        "dict": {0: 100, 1: 200}, "numpy pairs": np.asarray([[0, 100], [1, 200]]),
        "tensor-like ids": [(np.int64(3), np.int32(40))], "10^5 samples": list(enumerate(w * 50)),
        "all at the cap": [(i, 4096 * 8) for i in range(16)],
    }
    for world in (8, 3, 1):
        try:
            s = HydraCPScheduler(4096, world_size=world)
        except ValueError as e:
            cases.add("hydra", f"world {world}", "one line", "\n" not in str(e))
            continue
        for name, x in inputs.items():
            res: dict = {}

            def run(x=x, s=s, res=res) -> None:
                t0 = time.perf_counter()
                res["out"] = s.get_groups_and_subsamples(x)
                res["s"] = time.perf_counter() - t0
            outcome, msg = guarded(run, timeout=120)
            if outcome == "ok":
                groups, sid = res["out"]
                pairs = list(x.items()) if isinstance(x, dict) else list(x)
                check = guarded(lambda sid=sid, pairs=pairs, world=world: check_schedule(sid, pairs, world, 4096))
                if check[0] != "ok":
                    outcome, msg = "FAIL invalid schedule", check[1]
                elif res["s"] > 30:
                    outcome, msg = "FAIL slow", f"{res['s']:.1f} s"
            cases.add("hydra", f"world {world} {name}", outcome, not outcome.startswith("FAIL"), msg)


def probe_steps(root: Path, cases: Cases) -> None:
    """The loader and plan on extreme sequence shapes, each in a child process with limits."""
    (root / "big.txt").write_text(f"{2**40}\n5\n")
    (root / "one.txt").write_text("1000000000\n")
    (root / "w.txt").write_text("\n".join(map(str, wiki(3000))) + "\n")
    (root / "cost.yaml").write_text("quadratic_ms: 1e-6\nlinear_ms: 0.001\nmicrobatch_ms: 0.1\n"
                                    "comm_bytes_per_token: 0\nbandwidth_gbs: {2: 100.0}\nmax_tokens_per_lane: 4096\n")
    c = ["--cost-file", root / "cost.yaml"]
    runs = {
        "plan a 2**40-token doc, max_seq_len 4096, 2 steps": [
            "plan", "--lengths", root / "big.txt", "--global-batch-tokens", 65536, "--max-seq-len", 4096,
            "--world-size", 16, "--policy", "hydra", "--steps", 2, *c],
        "plan a 10^9-token doc in 1-token pieces, 2 steps": ["plan", "--lengths", root / "one.txt",
                                                             "--global-batch-tokens", 1, "--max-seq-len", 1,
                                                             "--world-size", 2, "--policy", "greedy", "--steps", 2, *c],
        "plan without --steps, 1-token pieces of 10^9": ["plan", "--lengths", root / "one.txt", "--global-batch-tokens",
                                                         1, "--max-seq-len", 1, "--world-size", 2, "--policy",
                                                         "greedy", *c],
        "plan max_seq_len above the budget at step 3": ["plan", "--lengths", root / "w.txt", "--global-batch-tokens",
                                                        "8192@0,2048@3", "--max-seq-len", 4096, "--world-size", 4,
                                                        "--policy", "greedy", "--steps", 5, *c],
        "plan hydra on 2**20 ranks": ["plan", "--lengths", root / "w.txt", "--global-batch-tokens", 2**22,
                                      "--max-seq-len", 4096, "--world-size", 2**20, "--policy", "hydra", "--steps", 1,
                                      *c],
        "plan flexsp with --time-limit 0.001": ["plan", "--lengths", root / "w.txt", "--global-batch-tokens", 65536,
                                                "--max-seq-len", 4096, "--world-size", 16, "--policy", "flexsp",
                                                "--time-limit", 0.001, "--steps", 2, *c],
        "analyze steps of a 2**40 doc": ["analyze", root / "big.txt", "--global-batch-tokens", 65536,
                                         "--max-seq-len", 4096, "--out", root / "an"],
    }
    for name, argv in runs.items():
        t0 = time.perf_counter()
        rc, out, err = cli(*argv, timeout=180, memory=6 << 30)
        dt = time.perf_counter() - t0
        lines = err.strip().splitlines()
        if rc == -1:
            outcome = "FAIL hang"
        elif "Traceback" in err or rc not in (0, 2) or (rc == 2 and len(lines) != 1):
            outcome = f"FAIL rc {rc}"
        else:
            outcome = "ok" if rc == 0 else "one line"
        cases.add("steps", name, outcome, not outcome.startswith("FAIL"), f"{dt:.1f} s: {err[-300:]}")
        cases.parts.setdefault("steps seconds", {})[name] = round(dt, 1)


def probe_sidecar(root: Path, cases: Cases, kills: int) -> None:
    """verify PREFIX --write-checksums killed, run three at once, and on a full disk."""
    import numpy as np

    from balanced_loader.data.megatron import write_indexed_dataset

    folder = root / "side"
    folder.mkdir()
    rng = np.random.default_rng(1)
    write_indexed_dataset(str(folder / "c"), [rng.integers(0, 60_000, n).astype(np.uint16) for n in wiki(20000)])
    prefix, side = str(folder / "c"), folder / "c.crc32.npy"
    assert cli("verify", prefix, "--write-checksums")[0] == 0
    good = side.read_bytes()
    side.unlink()
    t0 = time.perf_counter()
    assert cli("verify", prefix, "--write-checksums")[0] == 0
    full = time.perf_counter() - t0
    r = random.Random(3)
    argv = [sys.executable, "-m", "balanced_loader", "verify", prefix, "--write-checksums"]
    for k in range(kills):
        if side.exists() and r.random() < 0.5:
            side.unlink()
        p = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(r.uniform(0.2, full))
        p.kill()
        p.wait()
        state = "absent" if not side.exists() else "whole" if side.read_bytes() == good else "damaged"
        rc, _, err = cli("verify", prefix)
        cases.add("kill", f"kill {k}", state, state != "damaged" and rc == 0, err[-200:])
    left = [f.name for f in folder.iterdir() if f.name.startswith(".")]
    cases.add("kill", "hidden files of killed runs", f"{len(left)} left", True)
    for k in range(3):
        if side.exists():
            side.unlink()
        ps = [subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for _ in range(3)]
        codes = [p.wait(timeout=300) for p in ps]
        errs = [p.stderr.read() for p in ps]
        whole = side.exists() and side.read_bytes() == good
        ok = whole and all(c == 0 or (c == 2 and len(e.strip().splitlines()) == 1) for c, e in zip(codes, errs))
        cases.add("concurrency", f"three at once {k}", f"codes {sorted(codes)}, sidecar {'whole' if whole else 'BAD'}",
                  ok, " | ".join(errs)[-300:])
    side.unlink()
    rc, _, err = cli("verify", prefix, "--write-checksums", limit=len(good) // 2)
    tmp = [f.name for f in folder.iterdir() if f.name not in ("c.idx", "c.bin")]
    ok = rc == 2 and len(err.strip().splitlines()) == 1 and not tmp
    cases.add("disk", "sidecar over the file size limit", f"rc {rc}, left {tmp}", ok, err[-300:])
    disk = folder / "new"
    rc, _, err = cli("verify", prefix, "--write-checksums", limit=len(good) * 4)
    cases.add("disk", "sidecar under the limit", f"rc {rc}", rc == 0 and side.read_bytes() == good, err[-300:])
    del disk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=150, help="damaged datasets per format")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--json", metavar="OUT.json")
    args = ap.parse_args()
    cases = Cases()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        probe_files(root, cases, "megatron", args.files, 1)
        probe_files(root, cases, "datatrove", args.files, 2)
        probe_hydra(cases)
        probe_steps(root, cases)
        probe_sidecar(root, cases, args.kills)
    total = sum(v for p, d in cases.parts.items() if p != "steps seconds" for v in d.values())
    report = {"command": "python tools/probe_turn3.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
              "seconds": round(time.time() - t0), "cases": total, "failures": len(cases.failures),
              "parts": cases.parts, "failed": cases.failures}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
