"""balanced_loader.wrap over a torch DataLoader / map-style Dataset."""

from __future__ import annotations

import numpy as np
import pytest

from balanced_loader.wrapping import DatasetSource, default_tokens, wrap

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset, IterableDataset  # noqa: E402

KW = {"policy": "greedy", "cost": "analytic:tiny@cpu", "world_size": 4, "global_batch_tokens": 600, "seed": 3}


class Docs(Dataset):
    def __init__(self, n=40):
        rng = np.random.default_rng(2)
        self.docs = [torch.from_numpy(rng.integers(0, 256, size=int(k))) for k in rng.integers(1, 300, size=n)]
        self.gets = 0

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        self.gets += 1
        return {"input_ids": self.docs[i], "label": i}


def delivered(loaders):
    got: dict[int, list[tuple[int, int, np.ndarray]]] = {}
    for steps in zip(*loaders):
        assert len({b.plan.fingerprint() for b in steps}) == 1
        for b in steps:
            for mb in b.microbatches:
                o = 0
                for doc, start, n in mb.segments:
                    if doc >= 0:
                        got.setdefault(doc, []).append((start, n, mb.input_ids[o:o + n]))
                    o += n
    return got


def test_wrap_a_dataloader_delivers_every_doc_once():
    ds = Docs()
    dl = DataLoader(ds, batch_size=8, shuffle=True)  # its sampler and batching are not used
    loaders = [wrap(dl, rank=r, **KW) for r in range(4)]
    got = delivered(loaders)
    assert sorted(got) == list(range(len(ds)))
    for doc, pieces in got.items():
        pieces.sort(key=lambda p: p[0])
        np.testing.assert_array_equal(np.concatenate([p[2] for p in pieces]), ds.docs[doc].numpy())


def test_wrap_with_lengths_and_length_fn():
    ds = Docs(10)
    lengths = [len(d) for d in ds.docs]
    ld = wrap(ds, lengths=lengths, **KW)
    assert ds.gets == 0 and ld.source.lengths.tolist() == lengths  # no pass over the data
    ld2 = wrap(ds, length_fn=lambda s: len(s["input_ids"]), **KW)
    assert ld2.source.lengths.tolist() == lengths
    mine = {doc for b in ld2 for mb in b.microbatches for doc, _, _ in mb.segments if doc >= 0}
    assert 0 < len(mine) < len(ds.docs)  # rank 0 loads only the samples of its own segments
    assert ld2.source.bytes_read == sum(ds.docs[d].numpy().nbytes for d in mine)


def test_wrap_errors():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from ()

    with pytest.raises(ValueError, match="needs a map-style dataset"):
        wrap(DataLoader(Stream()), **KW)
    with pytest.raises(ValueError, match="3 lengths given for a dataset of 10"):
        wrap(Docs(10), lengths=[1, 2, 3], **KW)
    ld = wrap(Docs(10), lengths=[5] * 10, **KW)
    with pytest.raises(ValueError, match="lengths do not match the dataset"):
        next(ld)
    with pytest.raises(ValueError, match="not a map-style dataset"):
        DatasetSource(iter([1, 2]))


def test_dataset_source_pickles():
    import pickle

    src = pickle.loads(pickle.dumps(DatasetSource([np.arange(4), np.arange(2)])))
    assert src.tokens(0).tolist() == [0, 1, 2, 3] and src.lengths.tolist() == [4, 2]


def test_default_tokens():
    assert default_tokens([1, 2]).tolist() == [1, 2]
    assert default_tokens((np.array([3]), "x")).tolist() == [3]
    with pytest.raises(ValueError, match="no 'input_ids'"):
        default_tokens({"ids": [1]})
    with pytest.raises(ValueError, match="1-D integer array"):
        default_tokens(np.zeros((2, 2), dtype=np.int64))


def test_package_level_wrap_is_callable_after_importing_the_module():
    import balanced_loader
    import balanced_loader.wrapping

    ld = balanced_loader.wrap([[1, 2, 3], [4, 5]], **KW)
    assert ld.source.lengths.tolist() == [3, 2] and balanced_loader.wrap is not None
    (b,) = list(ld)
    assert b.num_valid_tokens == 3
