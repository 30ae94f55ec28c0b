"""Sources: lengths-only, jsonl (byte-level and a local HF tokenizer), open_source dispatch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from balanced_loader.data.open import open_source
from balanced_loader.data.sources import JsonlSource, LengthSource
from balanced_loader.data.tokenizers import ByteTokenizer, get_tokenizer, token_dtype


def test_length_list_is_planning_only():
    src = open_source([5, 10, 3])
    assert isinstance(src, LengthSource) and src.lengths.tolist() == [5, 10, 3] and src.lengths.dtype == np.int64
    assert not src.has_tokens
    with pytest.raises(ValueError, match="holds lengths only .planning only."):
        src.tokens(1)
    assert open_source(np.array([1, 2], dtype=np.int32)).num_docs == 2


@pytest.mark.parametrize("bad,match", [([1, -2], "doc 1 has a negative length -2"), ([[1, 2]], "1-D"),
                                       ([1.5], "must be integers"), (["x"], "source x does not exist")])
def test_bad_length_lists(bad, match):
    with pytest.raises(ValueError, match=match):
        open_source(bad)


def test_npy_lengths_file(tmp_path):
    p = tmp_path / "lengths.npy"
    np.save(p, np.array([3, 0, 9]))
    src = open_source(str(p))
    assert src.lengths.tolist() == [3, 0, 9] and "lengths file" in src.describe()
    txt = tmp_path / "lengths.txt"
    txt.write_text("3\n# a comment\n0\n9\n")
    assert open_source(str(txt)).lengths.tolist() == [3, 0, 9]


def test_int64_lengths_and_memory_maps_are_not_copied(tmp_path, monkeypatch):
    from balanced_loader.data import lengths as lengths_mod

    monkeypatch.setattr(lengths_mod, "CHECK_DOCS", 3)  # several blocks even for a few docs
    given = np.array([4, 0, 7, 1, 2, 9, 3], dtype=np.int64)
    src = LengthSource(given)
    assert np.shares_memory(src.lengths, given)  # the caller's array, as is
    assert src.num_tokens == 26
    p = tmp_path / "lengths.npy"
    np.save(p, given)
    src = open_source(str(p))
    assert isinstance(src.lengths.base, np.memmap)  # still the memory map: nothing was copied
    assert src.lengths.tolist() == given.tolist() and src.num_tokens == 26
    mm = np.load(p, mmap_mode="r")
    assert np.shares_memory(LengthSource(mm).lengths, mm)
    converted = LengthSource(given.astype(np.int32)).lengths  # other dtypes are converted to int64
    assert converted.dtype == np.int64 and converted.tolist() == given.tolist()


@pytest.mark.parametrize("values,match", [
    ([5, 1, -2, 3, -1, 4, 0], "lengths: doc 2 has a negative length -2"),  # the first negative, in block 0
    ([5, 1, 3, 0, 0, -7, 4], "lengths: doc 5 has a negative length -7"),  # in a later block
    ([1, 2, 3, 2**41, 0, 2**45, 2**45], r"lengths: doc 5 has length 35184372088832, over the limit"),  # the max
    ([-1, 2, 3, 4, 2**50], r"doc 4 has length \d+, over the limit"),  # over the limit is reported first
])
def test_streamed_length_checks_keep_their_messages(values, match, monkeypatch, tmp_path):
    from balanced_loader.data import lengths as lengths_mod

    monkeypatch.setattr(lengths_mod, "CHECK_DOCS", 3)
    arr = np.array(values, dtype=np.int64)
    with pytest.raises(ValueError, match=match):
        LengthSource(arr)
    with pytest.raises(ValueError, match=match):  # the old converting path gives the same line
        LengthSource(arr.tolist())
    p = tmp_path / "bad.npy"
    np.save(p, arr)
    with pytest.raises(ValueError, match=f"length file {p}: doc"):  # read_lengths' own messages
        open_source(str(p))


def test_open_source_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        open_source(str(tmp_path / "nope.jsonl"))
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(ValueError, match="unsupported file type"):
        open_source(str(tmp_path / "a.csv"))
    with pytest.raises(ValueError, match="cannot open a source from dict"):
        open_source({"a": 1})
    with pytest.raises(ValueError, match="holds no .tar shards"):
        open_source(str(tmp_path))


def write_jsonl(path, rows):
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in rows))


def test_jsonl_byte_level(tmp_path):
    texts = ["hello", "", "naïve café ☕", "x" * 1000]
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [{"text": t, "id": i} for i, t in enumerate(texts)] + ["   "])  # blank line: not a doc
    src = open_source(str(p))
    assert isinstance(src, JsonlSource) and src.num_docs == 4
    assert src.lengths.tolist() == [len(t.encode()) for t in texts]
    for i, t in enumerate(texts):
        assert src.tokens(i).tobytes() == t.encode()
    assert src.read(2, 2, 3).tobytes() == "naïve".encode()[2:5]
    assert src.bytes_read > 0
    with pytest.raises(ValueError, match=r"tokens \[998, 1002\) are outside doc 3"):
        src.read(3, 998, 4)
    with pytest.raises(ValueError, match="doc_id 4 is outside 0..3"):
        src.tokens(4)


def test_jsonl_other_field_and_errors(tmp_path):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [{"body": "abc"}, {"body": "de"}])
    assert open_source(str(p), text_field="body").lengths.tolist() == [3, 2]
    with pytest.raises(ValueError, match=r"d.jsonl line 1: no 'text' field"):
        open_source(str(p))
    write_jsonl(p, [{"text": "ok"}, "{not json"])
    with pytest.raises(ValueError, match="d.jsonl line 2: not JSON"):
        open_source(str(p))
    write_jsonl(p, [{"text": 5}])
    with pytest.raises(ValueError, match="'text' is not a string"):
        open_source(str(p))


def test_jsonl_change_after_open_is_detected(tmp_path):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [{"text": "abcdef"}, {"text": "gh"}])
    src = open_source(str(p))
    write_jsonl(p, [{"text": "abcdeX"}, {"text": "ghijk"}])
    assert src.tokens(0).tobytes() == b"abcdeX"  # same length: re-read as is
    with pytest.raises(ValueError, match="changed since it was opened"):
        src.tokens(1)


def test_tokenizer_choice():
    assert isinstance(get_tokenizer(None), ByteTokenizer) and isinstance(get_tokenizer("bytes"), ByteTokenizer)
    assert ByteTokenizer().encode("é").tolist() == [0xC3, 0xA9]
    assert token_dtype(256) == np.uint8 and token_dtype(257) == np.uint16 and token_dtype(70_000) == np.uint32
    with pytest.raises(ValueError, match="no tokenizer.json found"):
        get_tokenizer("/nonexistent/tok")
    with pytest.raises(ValueError, match="tokenizer must be"):
        get_tokenizer(42)


def test_hf_tokenizer_from_a_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "big": 3}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = get_tokenizer(str(tmp_path))
    assert hf.vocab_size == 4 and hf.identity()["name"] == "hf"
    assert hf.encode("hello big world zzz").tolist() == [1, 3, 2, 0]
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [{"text": "hello world"}, {"text": "big"}])
    src = open_source(str(p), tokenizer=str(tmp_path / "tokenizer.json"))
    assert src.lengths.tolist() == [2, 1] and src.tokens(0).tolist() == [1, 2]
