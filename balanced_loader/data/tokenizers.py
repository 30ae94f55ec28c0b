"""Tokenizers for building shards: byte-level by default (no downloads), or a local Hugging Face file.

A tokenizer here is anything with ``encode(data: bytes) -> np.ndarray`` (unsigned ids),
``vocab_size`` and ``identity()`` (a small JSON-able dict stored next to the shards, so a
reader can tell which tokenizer produced them). ``encode_batch(docs)`` is optional
(:func:`encode_many` falls back to one ``encode`` per doc); the Hugging Face tokenizer uses the
fast tokenizer's batch call, which gives the same ids as encoding each doc alone.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, data: bytes) -> np.ndarray: ...

    def identity(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """Token id = byte value (vocab 256); text is taken as its UTF-8 bytes, other files as raw bytes."""

    vocab_size = 256

    def encode(self, data: bytes | str) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).copy()  # [num_tokens]

    def encode_batch(self, docs: list[bytes | str]) -> list[np.ndarray]:
        return [self.encode(d) for d in docs]

    def identity(self) -> dict[str, Any]:
        return {"name": "bytes", "vocab_size": 256}


class HFTokenizer:
    """A local Hugging Face tokenizer: a ``tokenizer.json`` file or a folder holding one.

    Uses the ``tokenizers`` package when installed, else ``transformers`` (local files only;
    nothing is ever downloaded). No special tokens are added. It reads text: bytes given to it must be
    valid UTF-8 (``build_from_files`` decodes files itself, refusing or counting invalid bytes).
    """

    reads_text = True

    def __init__(self, path: str, *, sha256: str | None = None) -> None:
        path = os.path.abspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"tokenizer {path}: no tokenizer.json found; pass a tokenizer.json file "
                             f"or a folder that holds one (use tokenizer='bytes' for byte-level)")
        self.path = file
        with open(file, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        if sha256 is not None and sha256 != self.sha256:  # reopened in a worker: the file changed meanwhile
            raise ValueError(f"tokenizer {file} changed while shards were being built; build again")
        try:
            import tokenizers
        except ModuleNotFoundError:
            tokenizers = None
        if tokenizers is not None:
            try:
                self._tok = tokenizers.Tokenizer.from_file(file)
            except Exception as e:  # the tokenizers package raises its own exception types
                raise ValueError(f"tokenizer {file} cannot be loaded: {e}") from None
            self._tok.no_padding()  # a padding setting in the file would pad batch calls to the longest doc
            self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
            self._encode = lambda text: self._tok.encode(text, add_special_tokens=False).ids
            self._encode_batch = lambda texts: [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
            return
        try:
            from transformers import PreTrainedTokenizerFast
        except ModuleNotFoundError:
            raise ValueError("a Hugging Face tokenizer needs the 'tokenizers' package "
                             "(pip install 'balanced-loader[hf]') or 'transformers'; "
                             "or use the default byte-level tokenizer") from None
        try:
            tok = PreTrainedTokenizerFast(tokenizer_file=file)
        except Exception as e:  # transformers raises many exception types for a bad file
            raise ValueError(f"tokenizer {file} cannot be loaded: {e}") from None
        self._tok = tok
        self.vocab_size = int(len(tok))
        self._encode = lambda text: tok.encode(text, add_special_tokens=False)
        self._encode_batch = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]

    @staticmethod
    def _text(data: bytes | str) -> str:
        if isinstance(data, str):
            return data
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"a doc is not valid UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                             f"decode it first (errors='replace' to keep going)") from None

    def encode(self, data: bytes | str) -> np.ndarray:
        ids = self._encode(self._text(data))
        return np.asarray(ids, dtype=token_dtype(self.vocab_size))  # [num_tokens]

    def encode_batch(self, docs: list[bytes | str]) -> list[np.ndarray]:
        """One batch call of the fast tokenizer (threads inside Rust); ids equal per-doc ``encode``."""
        if not docs:
            return []
        dt = token_dtype(self.vocab_size)
        return [np.asarray(ids, dtype=dt) for ids in self._encode_batch([self._text(d) for d in docs])]

    def __getstate__(self) -> dict[str, Any]:  # the loaded tokenizer holds lambdas: reload it from the file
        return {"path": self.path, "sha256": self.sha256}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], sha256=state["sha256"])  # type: ignore[misc]

    def identity(self) -> dict[str, Any]:
        return {"name": "hf", "path": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size}


def get_tokenizer(spec: Any = None) -> Tokenizer:
    """``None``/``"bytes"``: byte-level; a path: a local HF tokenizer; an object with ``encode``: itself."""
    if spec is None or (isinstance(spec, str) and spec in ("bytes", "byte")):
        return ByteTokenizer()
    if isinstance(spec, (str, os.PathLike)):
        return HFTokenizer(os.fspath(spec))
    if hasattr(spec, "encode") and hasattr(spec, "vocab_size") and hasattr(spec, "identity"):
        return spec
    raise ValueError(f"tokenizer must be 'bytes', a path to a tokenizer.json, or an object with "
                     f"encode/vocab_size/identity; got {type(spec).__name__}")


def encode_many(tok: Tokenizer, docs: list[bytes | str]) -> list[np.ndarray]:
    """Token ids of several docs: the tokenizer's ``encode_batch`` when it has one, else one ``encode`` each."""
    batch = getattr(tok, "encode_batch", None)
    if batch is not None:
        out = batch(docs)
        assert len(out) == len(docs)
        return out
    return [tok.encode(d) for d in docs]


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype that holds every id of a vocab."""
    for dt in ("<u1", "<u2", "<u4"):
        if vocab_size <= np.iinfo(np.dtype(dt)).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocab size {vocab_size} does not fit in 32-bit token ids")
