"""open_source(datasets.Dataset): every doc once through the loader, cached lengths, zero-copy reads, errors."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from balanced_loader.cost import CostModel  # noqa: E402
from balanced_loader.data.hf_datasets import HFDatasetSource  # noqa: E402
from balanced_loader.data.open import open_source  # noqa: E402
from balanced_loader.loader import BalancedLoader  # noqa: E402
from balanced_loader.wrapping import wrap  # noqa: E402

datasets.disable_progress_bars()


def rows(lengths, seed=0, vocab=50_000):
    rng = np.random.default_rng(seed)
    return [None if n is None else rng.integers(0, vocab, size=n).tolist() for n in lengths]


def saved(tmp_path, data, features=None, name="ds"):
    """A dataset written with save_to_disk and reopened memory-mapped (as load_dataset gives)."""
    ds = datasets.Dataset.from_dict(data, features=datasets.Features(features) if features else None)
    ds.save_to_disk(str(tmp_path / name))
    return datasets.load_from_disk(str(tmp_path / name))


def ids(value="int32"):
    return {"input_ids": datasets.List(datasets.Value(value))}


def cost(cap):
    return CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                                "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0},
                                "max_tokens_per_lane": cap})


def expected(row):
    return np.asarray(row if row is not None else [], dtype=np.int64)


def test_every_doc_once_through_the_loader_two_ranks(tmp_path):
    lengths = [int(n) for n in np.random.default_rng(1).integers(0, 300, size=80)] + [0, 5]
    data = rows(lengths)
    ds = saved(tmp_path, {"input_ids": data}, ids("int32"))
    delivered: dict[int, list[tuple[int, int]]] = {}
    steps = []
    for rank in range(2):
        loader = BalancedLoader(ds, policy="greedy", cost=cost(128), world_size=2, rank=rank,
                                global_batch_tokens=700, max_seq_len=256, seed=3, validate=True)
        assert loader.source.dtype == np.uint16  # int32 ids under 50,000: the smallest unsigned dtype
        n = 0
        for batch in loader:
            n += 1
            for mb in batch.microbatches:
                o = 0
                for doc, start, length in mb.segments:
                    if doc >= 0:
                        assert np.array_equal(mb.input_ids[o:o + length], expected(data[doc])[start:start + length])
                        delivered.setdefault(doc, []).append((start, length))
                    o += length
        steps.append(n)
    assert steps[0] == steps[1] > 1
    want = {d for d, n in enumerate(lengths) if n}
    assert set(delivered) == want  # empty rows are skipped, every other row delivered
    for d in want:
        pos = 0
        for start, length in sorted(delivered[d]):  # the segments tile the doc exactly once
            assert start == pos
            pos += length
        assert pos == lengths[d]


def test_lengths_computed_once_then_memory_mapped(tmp_path):
    lengths = [3, 0, 7, 0, 1]
    ds = saved(tmp_path, {"input_ids": rows(lengths), "text": list("abcde")}, {**ids("uint16"),
                                                                              "text": datasets.Value("string")})
    first = open_source(ds)
    assert first.lengths_computed
    assert first.cache_path is not None and os.path.exists(first.cache_path)
    assert os.path.dirname(first.cache_path) == os.path.dirname(ds.cache_files[0]["filename"])
    assert ds._fingerprint in os.path.basename(first.cache_path)
    again = open_source(datasets.load_from_disk(str(tmp_path / "ds")))
    assert not again.lengths_computed  # read from the cache file, not recomputed
    assert again.lengths.tolist() == first.lengths.tolist() == [3, 0, 7, 0, 1]
    assert isinstance(again.lengths.base, np.memmap)
    assert again.fingerprint() == first.fingerprint()
    # another column is another cache entry
    other = saved(tmp_path, {"ids2": rows(lengths)}, {"ids2": datasets.List(datasets.Value("int64"))}, "other")
    src = open_source(other, token_field="ids2")
    assert src.lengths_computed and src.lengths.tolist() == [3, 0, 7, 0, 1]
    assert open_source(other, token_field="ids2").lengths_computed is False
    # a changed dataset (new fingerprint) is a new cache entry, never the stale one
    sel = ds.select([2, 0])
    s = open_source(sel)
    assert s.lengths_computed and s.lengths.tolist() == [7, 3]


def test_in_memory_dataset_keeps_lengths_in_memory():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]})
    src = open_source(ds)
    assert src.cache_path is None and src.lengths.tolist() == [2, 1]
    assert pickle.loads(pickle.dumps(src)).tokens(0).tolist() == [1, 2]


def test_reads_are_views_of_the_arrow_buffer(tmp_path):
    lengths = [5000] * 400  # 2M uint16 tokens: 4 MB
    ds = saved(tmp_path, {"input_ids": rows(lengths)}, ids("uint16"))
    src = open_source(ds)
    chunks = ds.data.table.column("input_ids").chunks
    values = [c.values.to_numpy(zero_copy_only=True) for c in chunks]
    for d in (0, 199, 399):
        got = src.read(d, 10, 100)
        assert got.dtype == np.uint16 and not got.flags.writeable
        assert any(np.shares_memory(got, v) for v in values)  # no copy: a slice of the memory-mapped buffer
        assert got.tolist() == ds[d]["input_ids"][10:110]
    assert src.bytes_read == 3 * 100 * 2


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_open_does_not_load_the_column(tmp_path):
    import pyarrow as pa

    n_docs, n = 400, 40_000  # 16M uint16 tokens: 32 MB of values, 1.6 KB of offsets
    rng = np.random.default_rng(0)
    values = pa.array(rng.integers(0, 60_000, size=n_docs * n, dtype=np.uint16))
    col = pa.ListArray.from_arrays(pa.array(np.arange(0, n_docs * n + 1, n, dtype=np.int32)), values)
    datasets.Dataset(pa.table({"input_ids": col})).save_to_disk(str(tmp_path / "big"))
    del values, col
    for computed in (True, False):  # first open (lengths from the offsets), then the cached one
        ds = datasets.load_from_disk(str(tmp_path / "big"))
        before = rss_bytes()
        src = open_source(ds)
        got = src.read(7, 5, 10)
        grown = rss_bytes() - before
        assert src.lengths_computed is computed
        assert got.tolist() == ds[7]["input_ids"][5:15]
        assert grown < 4 << 20, f"open + read grew RSS by {grown >> 20} MiB for a 32 MiB token column"


def test_signed_and_wide_ids_give_the_smallest_unsigned_dtype(tmp_path):
    ds = saved(tmp_path, {"input_ids": [[1, 70_000], [5]]}, ids("int64"))
    src = open_source(ds)
    assert src.dtype == np.uint32 and src.tokens(0).tolist() == [1, 70_000]
    small = saved(tmp_path, {"input_ids": [[1, 200], [5]]}, ids("int64"), "small")
    s = open_source(small)
    assert s.dtype == np.uint8 and s.tokens(0).dtype == np.uint8 and s.tokens(0).tolist() == [1, 200]
    neg = saved(tmp_path, {"input_ids": [[1, -3]]}, ids("int32"), "neg")
    with pytest.raises(ValueError, match="negative token id"):
        open_source(neg)


def test_vocab_size_skips_the_id_pass_and_checks_each_read(tmp_path):
    ds = saved(tmp_path, {"input_ids": [[1, 299], [400, 2]]}, ids("int64"))
    src = HFDatasetSource(ds, vocab_size=300)
    assert "max_id" not in src._meta  # no min/max pass over the values
    assert src.dtype == np.uint16 and src.tokens(0).tolist() == [1, 299]
    assert src.read(1, 1, 1).tolist() == [2]
    with pytest.raises(ValueError, match="doc 1 of .* holds token id 400, outside vocab_size 300"):
        src.tokens(1)
    again = open_source(ds)  # the cached lengths, and now the id range the dtype needs
    assert not again.lengths_computed and again.dtype == np.uint16 and again.tokens(1).tolist() == [400, 2]
    with pytest.raises(ValueError, match="vocab_size must be an integer"):
        HFDatasetSource(ds, vocab_size=0)


def test_shuffled_dataset_reads_its_rows_in_its_order(tmp_path):
    data = rows([4, 9, 0, 2, 6, 1])
    ds = saved(tmp_path, {"input_ids": data}, ids("int32")).shuffle(seed=1)
    src = open_source(ds)
    for d in range(len(ds)):
        assert src.tokens(d).tolist() == ds[d]["input_ids"]
    back = pickle.loads(pickle.dumps(src))  # a DataLoader worker's copy: re-maps the cache, same tokens
    assert back.lengths.tolist() == src.lengths.tolist()
    assert [back.tokens(d).tolist() for d in range(len(ds))] == [src.tokens(d).tolist() for d in range(len(ds))]


def test_sliced_and_split_datasets(tmp_path):
    data = rows([4, 9, 0, 2, 6, 1, 8, 3])
    ds = saved(tmp_path, {"input_ids": data}, ids("uint16"))
    parts = [ds.select(range(2, 7)), ds.shard(3, 1, contiguous=True), *ds.train_test_split(0.25, seed=0).values()]
    for part in parts:  # contiguous selects slice the Arrow table; splits use an indices mapping
        src = open_source(part)
        assert src.lengths.tolist() == [len(r["input_ids"]) for r in part]
        assert [src.tokens(d).tolist() for d in range(len(part))] == [r["input_ids"] for r in part]


def test_importing_the_loader_does_not_import_datasets():
    import subprocess
    import sys

    code = ("import sys, balanced_loader, balanced_loader.loader, balanced_loader.data.open, balanced_loader.cli; "
            "assert 'datasets' not in sys.modules and 'pyarrow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_wrap_reads_a_dataset_through_its_arrow_column(tmp_path):
    ds = saved(tmp_path, {"input_ids": rows([30, 40])}, ids("int32"))
    loader = wrap(ds, policy="greedy", cost=cost(64), world_size=1, rank=0, global_batch_tokens=100,
                  max_seq_len=64)
    assert isinstance(loader.source, HFDatasetSource)
    with pytest.raises(ValueError, match="pick one"):
        wrap(datasets.DatasetDict({"train": ds}), policy="greedy", cost=cost(64), world_size=1, rank=0,
             global_batch_tokens=100, max_seq_len=64)


def test_errors(tmp_path):
    ds = saved(tmp_path, {"input_ids": rows([3, 2]), "n": [1, 2], "words": [["a"], ["b"]]},
               {**ids("int32"), "n": datasets.Value("int32"), "words": datasets.List(datasets.Value("string"))})
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]; pick one, e.g. open_source\(ds\['train'\]\)"):
        open_source(datasets.DatasetDict({"train": ds, "test": ds}))
    with pytest.raises(ValueError, match="IterableDataset has no random access"):
        open_source(ds.to_iterable_dataset())
    with pytest.raises(ValueError, match=r"no token column 'tokens' \(columns: \['input_ids', 'n', 'words'\]\)"):
        open_source(ds, token_field="tokens")
    with pytest.raises(ValueError, match="column 'n' is int32, not a list of integer token ids"):
        open_source(ds, token_field="n")
    with pytest.raises(ValueError, match="not a list of integer token ids"):
        open_source(ds, token_field="words")
    text = datasets.Dataset.from_dict({"text": ["hello", "world"]})
    with pytest.raises(ValueError, match=r"ds.map\(lambda b: tok\(b\[\"text\"\]\), batched=True\)"):
        open_source(text)
    with pytest.raises(ValueError, match="does not tokenize a Hugging Face dataset"):
        open_source(ds, tokenizer="bytes")
    src = open_source(ds)
    with pytest.raises(ValueError, match="outside doc 1"):
        src.read(1, 1, 2)
    with pytest.raises(ValueError, match=r"row 1 of column 'input_ids' is None \(null\)"):  # not an empty doc
        open_source(saved(tmp_path, {"input_ids": [[1], None, [2]]}, ids("int32"), "null"))
    empty = saved(tmp_path, {"input_ids": [[], []]}, ids("int32"), "empty")
    with pytest.raises(ValueError, match="has no tokens to train on"):
        BalancedLoader(empty, policy="greedy", cost=cost(64), world_size=1, rank=0, global_batch_tokens=100,
                       max_seq_len=64)
