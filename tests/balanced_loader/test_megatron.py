"""Megatron indexed datasets as a source: byte-exact against megatron-core's own writer and reader (when
installed), every token once per epoch on 4 ranks, exact resume, the CLI on a prefix, HTTP range reads
with the bytes served counted, checksum sidecars, the data-path mixture form, and one-line bad input."""

from __future__ import annotations

import filecmp
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest

from balanced_loader import cli
from balanced_loader.cost import CostModel
from balanced_loader.data.megatron import (
    DTYPES,
    MappedLengths,
    MegatronSource,
    parse_data_path,
    write_indexed_dataset,
)
from balanced_loader.data.open import open_source
from balanced_loader.loader import BalancedLoader

WORLD = 4
CAP = 2048  # tokens per lane: longer docs take CP groups, and docs over WORLD * CAP are split
COST = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                            "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": CAP})


def corpus(seed: int = 0, n: int = 160, vocab: int = 60_000) -> list[list[np.ndarray]]:
    """Documents of one to four sequences; mostly short sequences, a tail up to 20K tokens, a few empty."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        k = int(rng.choice([1, 1, 1, 2, 4]))
        lens = np.where(rng.random(k) < 0.15, rng.integers(3_000, 20_000, k), rng.integers(0, 900, k))
        docs.append([rng.integers(0, vocab, int(s)) for s in lens])
    return docs


def megatron_build(prefix: str, docs: list[list[np.ndarray]], dtype) -> None:
    """The dataset as megatron-core's IndexedDatasetBuilder writes it (add_document: several sequences)."""
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for seqs in docs:
            b.add_document(torch.from_numpy(np.concatenate(seqs).astype(np.int64)), [len(s) for s in seqs])
        b.finalize(prefix + ".idx")


def have_megatron() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.datasets.indexed_dataset  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A uint16 dataset: written by Megatron's own builder when megatron-core is installed, else by ours
    (which writes the same bytes, see test_same_bytes_and_tokens_as_megatron)."""
    folder = tmp_path_factory.mktemp("mega")
    prefix = str(folder / "corpus_text_document")
    docs = corpus()
    if have_megatron():
        megatron_build(prefix, docs, np.uint16)
    else:
        write_indexed_dataset(prefix, docs, dtype=np.uint16)
    return prefix, [s for d in docs for s in d]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_same_bytes_and_tokens_as_megatron(tmp_path, dtype):
    """The must-hold: Megatron's own IndexedDatasetBuilder writes the dataset (documents of several
    sequences); our lengths and every doc's tokens equal Megatron's IndexedDataset, and our writer
    produces the same two files byte for byte."""
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = corpus(seed=1, vocab=60_000 if dtype == np.uint16 else 150_000)
    prefix = str(tmp_path / "m")
    megatron_build(prefix, docs, dtype)
    write_indexed_dataset(str(tmp_path / "ours"), docs, dtype=dtype)
    for ext in (".idx", ".bin"):
        assert filecmp.cmp(prefix + ext, str(tmp_path / "ours") + ext, shallow=False)
    ref = IndexedDataset(prefix)
    src = open_source(prefix)
    assert isinstance(src, MegatronSource) and src.dtype == np.dtype(dtype)
    assert np.array_equal(np.asarray(src.lengths), ref.sequence_lengths)
    assert src.num_docs == len(ref) and any(len(d) > 1 for d in docs)
    for i in range(len(ref)):
        assert np.array_equal(src.tokens(i), ref[i])
        if ref.sequence_lengths[i] > 10:  # a piece: Megatron's get(idx, offset, length)
            assert np.array_equal(src.read(i, 3, 7), ref.get(i, offset=3, length=7))


def test_every_dtype_code_round_trips(tmp_path):
    rng = np.random.default_rng(2)
    for code, t in DTYPES.items():
        seqs = [rng.integers(0, 100, int(n)).astype(t) for n in rng.integers(0, 50, 12)]
        prefix = str(tmp_path / f"d{code}")
        write_indexed_dataset(prefix, seqs, dtype=t)
        with open(prefix + ".idx", "rb") as f:
            assert f.read(18)[17] == code
        src = open_source(prefix + ".idx")
        assert src.dtype == np.dtype(t) and [len(s) for s in seqs] == np.asarray(src.lengths).tolist()
        assert all(np.array_equal(src.tokens(i), s) for i, s in enumerate(seqs))


def epoch_pieces(loaders, read) -> dict[int, list[tuple[int, int]]]:
    """Every (start, length) piece of each doc the loaders deliver over their run, checking each piece's
    tokens against ``read(doc, start, length)``; the plans agree on every rank."""
    pieces: dict[int, list[tuple[int, int]]] = {}
    for batches in zip(*loaders, strict=True):
        assert len({b.plan.fingerprint() for b in batches}) == 1
        for b in batches:
            for mb in b.microbatches:
                o = 0
                for doc, start, length in mb.segments:
                    if doc >= 0:
                        assert np.array_equal(mb.input_ids[o:o + length], read(doc, start, length))
                        pieces.setdefault(doc, []).append((start, length))
                    o += length
    return pieces


def assert_each_token_once(pieces, lengths) -> None:
    nonempty = [d for d in range(len(lengths)) if int(lengths[d]) > 0]
    assert sorted(pieces) == nonempty
    for doc, ps in pieces.items():
        pos = 0
        for start, length in sorted(ps):
            assert start == pos
            pos += length
        assert pos == int(lengths[doc])


def make_loader(source, rank, **kw):
    args = {"policy": "hydra", "cost": COST, "world_size": WORLD, "rank": rank, "global_batch_tokens": 6 * CAP * WORLD,
            "seed": 4, "epochs": 1, "max_seq_len": 3 * CAP}
    args.update(kw)
    return BalancedLoader(source, **args)


def test_four_ranks_every_token_once_and_exact_resume(dataset):
    prefix, seqs = dataset
    src = open_source(prefix)
    loaders = [make_loader(prefix, r) for r in range(WORLD)]
    pieces = epoch_pieces(loaders, src.read)
    assert_each_token_once(pieces, np.asarray(src.lengths))
    assert any(length < int(src.lengths[d]) for d, ps in pieces.items() for _, length in ps)  # split docs
    # exact resume: k steps, save, a fresh loader on each rank continues bitwise identically
    def sig(b):
        return b.plan.fingerprint(), [(m.segments, m.input_ids.tobytes()) for m in b.microbatches]

    ref = [[sig(b) for b in make_loader(prefix, r, epochs=2)] for r in range(WORLD)]
    k = len(ref[0]) // 3
    for r in range(WORLD):
        ld = make_loader(prefix, r, epochs=2)
        assert [sig(b) for _, b in zip(range(k), ld)] == ref[r][:k]
        state = json.loads(json.dumps(ld.state_dict()))
        fresh = make_loader(prefix, r, epochs=2)
        fresh.load_state_dict(state)
        assert [sig(b) for b in fresh] == ref[r][k:]


def test_cli_plan_analyze_compare_take_the_prefix(dataset, tmp_path, capsys):
    prefix, _ = dataset
    cost = tmp_path / "cost.yaml"
    COST.save(str(cost))
    common = ["--world-size", "4", "--cost-file", str(cost), "--global-batch-tokens", str(6 * CAP * WORLD),
              "--max-seq-len", str(3 * CAP)]
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--source", prefix, *common, "--policy", "hydra", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    src = open_source(prefix)
    covered = sum(s[2] for st in plan["steps"] for p in st["pools"] for mb in p["microbatches"] for g in mb
                  for s in g["segments"])
    assert covered == src.num_tokens
    assert cli.main(["analyze", prefix + ".idx", "--out", str(tmp_path / "an")]) == 0
    assert cli.main(["compare", "--source", prefix, *common, "--policies", "hydra,mcore-dcp",
                     "--out", str(tmp_path / "cmp")]) == 0
    assert "hydra" in capsys.readouterr().out


def test_mapped_lengths_sum_streams(tmp_path):
    prefix = str(tmp_path / "x")
    write_indexed_dataset(prefix, [np.zeros(n, np.uint16) for n in range(300)])
    src = open_source(prefix)
    assert isinstance(src.lengths, MappedLengths) and src.lengths.dtype == np.int32
    assert int(src.lengths.sum()) == int(np.sum(src.lengths)) == sum(range(300)) == src.num_tokens
    assert int(src.lengths[10:20].sum()) == sum(range(10, 20))
    assert np.asarray(src.lengths[[3, 5]]).tolist() == [3, 5]


def test_several_prefixes_are_one_source(tmp_path):
    rng = np.random.default_rng(3)
    parts = [[rng.integers(0, 9, int(n)) for n in rng.integers(1, 40, k)] for k in (5, 0, 7)]
    prefixes = []
    for j, seqs in enumerate(parts):
        prefixes.append(str(tmp_path / f"p{j}_tokens"))
        write_indexed_dataset(prefixes[-1], seqs)
    for spec in (prefixes, str(tmp_path)):  # a list, or a folder of pairs (name order)
        src = open_source(spec)
        flat = [s for p in parts for s in p]
        assert src.num_docs == len(flat) and src.shard_bounds.tolist() == [0, 5, 5, 12]
        assert all(np.array_equal(src.tokens(i), s) for i, s in enumerate(flat))
    again = pickle.loads(pickle.dumps(src))  # DataLoader workers get the source pickled
    assert again.fingerprint() == src.fingerprint() and np.array_equal(again.tokens(7), flat[7])
    assert cli.main(["verify", str(tmp_path)]) == 0  # every prefix of the folder


def test_data_path_form_and_mix(tmp_path):
    a, b = str(tmp_path / "web_text_document"), str(tmp_path / "code_text_document")
    write_indexed_dataset(a, [np.ones(100, np.uint16)] * 30)
    write_indexed_dataset(b, [np.ones(50, np.uint16)] * 20)
    assert parse_data_path(f"0.3 {a} 0.7 {b}") == [(0.3, a), (0.7, b)]
    assert parse_data_path(f"{a} {b}") == [(None, a), (None, b)]
    import balanced_loader as bl

    m = bl.mix(f"0.3 {a} 0.7 {b}")
    assert m.names == ("code_text_document", "web_text_document")
    assert m.weights.to_json() == {"code_text_document": 0.7, "web_text_document": 0.3}
    assert bl.mix(f"{a} {b}").weights.to_json() == {"code_text_document": 1000.0, "web_text_document": 3000.0}
    for bad in (f"0.3 {a} 0.7", f"0.3 {a} x {b}", "", f"-1 {a} 2 {b}"):
        with pytest.raises(ValueError):
            parse_data_path(bad)
    # the command line: --mix in the data-path form
    out = tmp_path / "p.json"
    cost = tmp_path / "cost.yaml"
    COST.save(str(cost))
    assert cli.main(["plan", "--mix", "0.3", a, "0.7", b, "--world-size", "2", "--cost-file", str(cost),
                     "--policy", "greedy", "--global-batch-tokens", "2000", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["steps"]


# ---- over HTTP ------------------------------------------------------------------------------------------

def test_four_ranks_over_http_read_only_the_bytes_they_need(dataset, tmp_path):
    """The must-hold over HTTP: the same epoch through the loader from a range server; the .bin bytes served
    are within 1.05x of the .bin bytes of the docs read (exactly those here: no read-ahead)."""
    pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    from balanced_loader.diagnostics.range_server import RangeServer

    prefix, _ = dataset
    local = open_source(prefix)
    with RangeServer(os.path.dirname(prefix)) as server:
        url = f"{server.url}/{os.path.basename(prefix)}"
        loaders = [make_loader(url, r) for r in range(WORLD)]
        assert all(ld.source.remote for ld in loaders)
        pieces = epoch_pieces(loaders, local.read)
        assert_each_token_once(pieces, np.asarray(local.lengths))
        served = server.bytes_served
        bin_served = served.get("/corpus_text_document.bin", 0)
        needed = sum(length for ps in pieces.values() for _, length in ps) * 2
        idx = served.get("/corpus_text_document.idx", 0)
        print(f"bin bytes served / needed: {bin_served / needed:.4f}; .idx served {idx:,} "
              f"({WORLD} ranks x {os.path.getsize(prefix + '.idx'):,}); {server.requests} requests")
        assert needed <= bin_served <= 1.05 * needed
        assert sum(ld.source.bytes_read for ld in loaders) == bin_served
        assert idx <= WORLD * (os.path.getsize(prefix + ".idx") + 16)
        # a bare prefix URL and its .bin name open the same source
        assert open_source(url + ".bin").num_docs == open_source(url).num_docs == local.num_docs


# ---- checksums and bad input ----------------------------------------------------------------------------

def test_checksum_sidecar_catches_a_changed_byte(tmp_path, capsys):
    prefix = str(tmp_path / "c")
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 60_000, int(n)) for n in rng.integers(1, 300, 40)]
    write_indexed_dataset(prefix, seqs)
    assert cli.main(["verify", prefix]) == 0
    assert "no checksums" in capsys.readouterr().out
    assert cli.main(["verify", prefix, "--write-checksums"]) == 0
    src = open_source(prefix)
    assert src.has_checksums and src.tokens_fingerprint() is not None
    assert np.array_equal(src.read(7, 2, 5), seqs[7][2:7])
    with open(prefix + ".bin", "r+b") as f:  # one byte of sequence 11
        f.seek(int(sum(len(s) for s in seqs[:11])) * 2 + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    src = open_source(prefix)
    with pytest.raises(ValueError, match=r"c\.bin: sequence 11 \(doc 11\) has crc32"):
        src.tokens(11)
    assert np.array_equal(src.tokens(10), seqs[10])
    assert len(MegatronSource(prefix, verify="off").tokens(11)) == len(seqs[11])  # unchecked on request
    assert cli.main(["verify", prefix]) == 2
    out = capsys.readouterr().out
    assert "sequence 11" in out and "1 problem" in out


def damage(prefix: str, kind: str) -> str:
    """Spoil a copy of the dataset one way; returns the file the error must name."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if kind == "truncated bin":
        with open(bin_, "r+b") as f:
            f.truncate(os.path.getsize(bin_) - 3)
        return bin_
    with open(idx, "rb") as f:
        raw = bytearray(f.read())
    if kind == "magic":
        raw[:9] = b"NOTANIDX\x00"
    elif kind == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif kind == "dtype code":
        raw[17] = 9
    elif kind == "truncated idx":
        raw = raw[:-5]
    elif kind == "missing bin":
        os.remove(bin_)
        return bin_
    with open(idx, "wb") as f:
        f.write(bytes(raw))
    return idx


@pytest.mark.parametrize("kind", ["truncated bin", "magic", "version", "dtype code", "truncated idx", "missing bin"])
def test_bad_input_is_one_line_naming_the_file(dataset, tmp_path, kind, capsys):
    prefix, _ = dataset
    copy = str(tmp_path / "bad")
    for ext in (".idx", ".bin"):
        shutil.copy(prefix + ext, copy + ext)
    named = damage(copy, kind)
    with pytest.raises(ValueError) as e:
        open_source(copy)
    assert named in str(e.value) and "\n" not in str(e.value)
    rc = cli.main(["plan", "--source", copy, "--world-size", "2", "--cost", "hydra-gpt7b-a100", "--policy", "greedy"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and named in err and len(err.splitlines()) == 1
    assert cli.main(["verify", copy]) == 2


def test_no_megatron_import_needed():
    """The reader never imports megatron-core (nor torch.distributed)."""
    code = ("import sys, numpy as np, tempfile; from balanced_loader.data.megatron import write_indexed_dataset;"
            "from balanced_loader import open_source; d = tempfile.mkdtemp(); "
            "write_indexed_dataset(d + '/x', [np.arange(5)]); s = open_source(d + '/x'); s.tokens(0);"
            "assert 'megatron' not in sys.modules and 'torch.distributed' not in sys.modules, sorted(sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr


# ---- verify: two old cases of issue 38 --------------------------------------------------------------------

def test_verify_counts_in_index_json_and_names_a_length_file(tmp_path, capsys):
    """`verify` on a shard folder whose index.json num_tokens was raised by 7 reports it (it said 'no
    problems'); `verify lengths.txt` says what the file is and what verify takes (it said 'shard folder
    does not exist')."""
    from balanced_loader.build.writer import write_shards
    from balanced_loader.data.index import INDEX_FILE

    folder = str(tmp_path / "shards")
    write_shards([np.arange(n, dtype=np.uint16) for n in (5, 9, 300)], folder)
    assert cli.main(["verify", folder]) == 0
    path = os.path.join(folder, INDEX_FILE)
    with open(path) as f:
        index = json.load(f)
    index["num_tokens"] += 7
    with open(path, "w") as f:
        json.dump(index, f)
    capsys.readouterr()
    assert cli.main(["verify", folder]) == 2
    out = capsys.readouterr().out
    assert "records num_tokens 321 but index.lengths.npy holds 314" in out and "1 problem(s)" in out
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5\n9\n")
    assert cli.main(["verify", str(lengths)]) == 2
    err = capsys.readouterr().err
    assert "is a length file (lengths only, no tokens)" in err and "shard folder" in err
    assert "does not exist" not in err
