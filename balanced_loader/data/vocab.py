"""The model's vocabulary covers the data: one line before a step, never an embedding's ``IndexError`` in it.

* :func:`check_vocab` (before the first step): the largest token id the source records (a shard index,
  a Hugging Face dataset's id range), else the vocabulary it was tokenized with, must be below the
  model's vocabulary; the error names the first doc holding an id too large (docs read in order, on
  the error path only, up to 2**28 tokens).
* :func:`check_step_ids` (each step, for sources that record neither): every token id of a rank's
  microbatches; the error names the doc that holds the first id out of range, and the id.

The runtime (``parallel_runtime.training.guards``) and the Hugging Face trainers
(:mod:`balanced_loader.integrations.transformers`) both use them; ``fix`` is how their users raise the
vocabulary (``--set model.vocab_size=N``; the model config's ``vocab_size``).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def check_vocab(source: Any, vocab: int, key: str, *, fix: str = "") -> None:
    """The data's token ids must be embeddable: its recorded largest id, else its tokenizer's vocabulary."""
    top = getattr(source, "max_token_id", None)
    if top is not None:
        if top >= vocab:
            found = first_id_at_least(source, vocab)
            first = f"; the first is id {found[2]} in doc {found[0]} (token {found[1]} of it)" if found else ""
            raise ValueError(f"{key} is {vocab} but {source.describe()} holds token id {top} (recorded in its "
                             f"index{first}); set {key} to at least {top + 1}{_fix(fix, top + 1)}")
        return
    data_vocab = getattr(source, "vocab_size", None)
    if data_vocab is not None and int(data_vocab) > vocab:
        raise ValueError(f"{key} is {vocab} but {source.describe()} was tokenized with a vocabulary of "
                         f"{int(data_vocab)} ids; set {key} to at least {int(data_vocab)}{_fix(fix, int(data_vocab))}")


def check_step_ids(batch: Any, vocab: int, key: str, *, fix: str = "") -> None:
    """Every token id of this rank's microbatches is below ``vocab`` (a source that records no largest id);
    the error names the doc holding the first id out of range, its position in the doc, and the id."""
    for mb in batch.microbatches:
        ids = mb.input_ids
        if not ids.size or int(ids.max()) < vocab:
            continue
        at = int(np.flatnonzero(ids >= vocab)[0])
        bad = int(ids[at])
        doc, where = _doc_at(mb, at)
        raise ValueError(f"step {batch.step}: doc {doc} holds token id {bad}{where}, outside {key} {vocab}; set "
                         f"{key} to at least {int(ids.max()) + 1}{_fix(fix, int(ids.max()) + 1)}, or check the "
                         f"data's tokenizer")


def first_id_at_least(source: Any, vocab: int, *, budget: int = 1 << 28) -> tuple[int, int, int] | None:
    """``(doc, position in it, id)`` of the first token id >= ``vocab``, docs read in order (only on the error
    path: the source records an id that large); None when ``budget`` tokens hold none."""
    seen = 0
    for d in range(int(source.num_docs)):
        n = int(source.lengths[d])
        if n <= 0:
            continue
        try:
            t = np.asarray(source.read(d, 0, n))
        except ValueError:
            return None
        if t.size and int(t.max()) >= vocab:
            at = int(np.flatnonzero(t >= vocab)[0])
            return d, at, int(t[at])
        seen += n
        if seen >= budget:
            return None
    return None


def _doc_at(mb: Any, at: int) -> tuple[Any, str]:
    """``(doc_id, " (token N of it)")`` of position ``at`` of a microbatch's ``input_ids`` (its ``segments`` are
    the runs ``(doc_id, start, length)`` in order; a CP lane's shard holds several runs per doc)."""
    pos = 0
    for doc, start, length in mb.segments:
        if at < pos + length:
            return doc, f" (token {start + at - pos} of it)"
        pos += length
    return "?", ""


def _fix(fix: str, n: int) -> str:
    return f" ({fix.format(n=n)})" if fix else ""
