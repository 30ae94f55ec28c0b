"""Tokenizers for building shards: byte-level by default (no downloads), or a local Hugging Face file.

A tokenizer here is anything with ``encode(data: bytes) -> np.ndarray`` (unsigned ids),
``vocab_size`` and ``identity()`` (a small JSON-able dict stored next to the shards, so a
reader can tell which tokenizer produced them).
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

    def identity(self) -> dict[str, Any]:
        return {"name": "bytes", "vocab_size": 256}


class HFTokenizer:
    """A local Hugging Face tokenizer: a ``tokenizer.json`` file or a folder holding one.

    Uses the ``tokenizers`` package when installed, else ``transformers`` (local files only;
    nothing is ever downloaded). No special tokens are added.
    """

    def __init__(self, path: str) -> None:
        path = os.path.abspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"tokenizer {path}: no tokenizer.json found; pass a tokenizer.json file "
                             f"or a folder that holds one (use tokenizer='bytes' for byte-level)")
        self.path = file
        with open(file, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        try:
            import tokenizers
        except ModuleNotFoundError:
            tokenizers = None
        if tokenizers is not None:
            try:
                self._tok = tokenizers.Tokenizer.from_file(file)
            except Exception as e:  # the tokenizers package raises its own exception types
                raise ValueError(f"tokenizer {file} cannot be loaded: {e}") from None
            self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
            self._encode = lambda text: self._tok.encode(text, add_special_tokens=False).ids
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

    def encode(self, data: bytes | str) -> np.ndarray:
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        ids = self._encode(text)
        return np.asarray(ids, dtype=token_dtype(self.vocab_size))  # [num_tokens]

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


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype that holds every id of a vocab."""
    for dt in ("<u1", "<u2", "<u4"):
        if vocab_size <= np.iinfo(np.dtype(dt)).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocab size {vocab_size} does not fit in 32-bit token ids")
