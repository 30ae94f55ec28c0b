"""Options shared by the commands: checked number types, and the options that cut a lengths file or a
source into global batches.

Every number on the command line goes through :func:`int_in` or :func:`float_in`: the type, finiteness
and a sane range are checked while parsing, so a value like ``--gpus 10000000000`` or
``--time-limit nan`` is one error line (exit 2) before any work starts.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

MAX_RANKS = 1 << 20  # ranks, GPUs, and tp/pp/cp degrees: 1,048,576
MAX_TOKENS = 1 << 40  # tokens of a doc, a sequence or a global batch
MAX_COUNT = 1 << 30  # steps, docs per shard, list lengths
MAX_SECONDS = 1e6  # solver time limits
MAX_SEED = (1 << 63) - 1


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``[lo, hi]``."""

    def parse(text: str) -> int:
        try:
            v = int(text, 10) if len(text) <= 40 else None  # 40 digits: no slow parse of huge numbers
        except ValueError:
            v = None
        if v is None:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}")
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v:,} is outside {lo:,}..{hi:,}")
        return v

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text[:40]!r}")
        if v < lo or v > hi or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"{v:g} is outside {'(' if lo_open else '['}{lo:g}, {hi:g}]")
        return v

    parse.__name__ = "number"
    return parse


RANKS = int_in(1, MAX_RANKS)
DEGREE = int_in(1, MAX_RANKS)
TOKENS = int_in(1, MAX_TOKENS)
COUNT = int_in(1, MAX_COUNT)
INDEX = int_in(0, MAX_COUNT)
SEED = int_in(0, MAX_SEED)
SECONDS = float_in(0.0, MAX_SECONDS, lo_open=True)
MEGABYTES = float_in(0.0, float(1 << 20), lo_open=True)


def tokens_or_schedule(text: str) -> Any:
    """An argparse ``type``: a token count ``N`` in 1..MAX_TOKENS, or a schedule ``N@STEP,...``."""
    from balanced_loader.schedule import parse_text, schedule

    if "@" not in text:
        return TOKENS(text)
    try:
        value = parse_text(text, "schedule")
        sc = schedule(value, "schedule")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("schedule: ")) from None
    if sc.largest > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{sc.largest:,} is outside 1..{MAX_TOKENS:,}")
    return value


def mix_entry(text: str) -> tuple[str, str, Any] | str:
    """An argparse ``type`` for ``NAME=PATH:WEIGHT``: ``(name, path, weight or [(step, weight), ...])``; a word
    without ``=`` is kept as it is, a part of Megatron's data-path form (:class:`MixAction` reads it)."""
    from balanced_loader.schedule import parse_text

    if "=" not in text:
        return text
    name, eq, rest = text.partition("=")
    path, colon, weight = rest.rpartition(":")
    if not eq or not name or not colon or not path or not weight:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH:WEIGHT (e.g. web=shards/web:0.7)")
    try:
        return name, path, parse_text(weight, f"--mix {name}", integer=False)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class MixAction(argparse.Action):
    """``--mix NAME=PATH:WEIGHT ...``, or Megatron's data-path form ``--mix 0.3 PREFIX_A 0.7 PREFIX_B`` (or prefixes
    only): stored as ``[(name, path, weight or None), ...]`` (``None``: every source weighs its size)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from balanced_loader.data.megatron import data_path_sources

        named = [v for v in values if isinstance(v, tuple)]
        if named and len(named) != len(values):
            parser.error("--mix: give NAME=PATH:WEIGHT entries, or Megatron's data path (W1 PREFIX1 W2 PREFIX2 ...), "
                         "not both")
        if not named:
            try:
                sources, weights = data_path_sources(values)
            except ValueError as e:
                parser.error(f"--mix: {e}")
            values = [(n, p, None if weights is None else weights[n]) for n, p in sources.items()]
        setattr(namespace, self.dest, values)


MIX_HELP = ("a mixture of sources (shard folders, Megatron prefixes, datatrove folders, .jsonl or length files) at set "
            "shares of every step: NAME=PATH:WEIGHT ..., WEIGHT a number or a schedule W@STEP,W@STEP (linear "
            "between steps); or Megatron's data path W1 PREFIX1 W2 PREFIX2 ... (prefixes only: by size)")


def add_mix_arguments(p: argparse.ArgumentParser, group: Any) -> None:
    """``--mix`` (into ``group``, the ``--lengths``/``--source`` choice) and ``--mix-by``."""
    group.add_argument("--mix", nargs="+", type=mix_entry, action=MixAction, metavar="NAME=PATH:WEIGHT", help=MIX_HELP)
    p.add_argument("--mix-by", default="tokens", choices=("tokens", "docs"),
                   help="--mix weights are shares of each step's tokens (default) or of its docs")


def add_batch_arguments(p: argparse.ArgumentParser, *, max_seq_len_default: str) -> None:
    """``--lengths|--source|--mix`` (one required), ``--mix-by``, ``--global-batch-tokens``, ``--shuffle``,
    ``--seed``, ``--shuffle-window``, ``--max-seq-len`` and ``--long-docs``, with the same meaning as the
    loader's batching (a schedule ``N@STEP,...`` for the token settings, see :mod:`.streams`)."""
    src = p.add_mutually_exclusive_group(required=True)
    add_mix_arguments(p, src)
    src.add_argument("--lengths", metavar="FILE",
                     help="length file: .txt (one length a line, also .txt.gz) or .npy; doc_id = line")
    src.add_argument("--source", metavar="DIR|URL", nargs="+",
                     help="a shard folder (balanced-loader build-shards), local or remote (http(s)://, s3://, gs://, "
                          "any fsspec URL), or a .jsonl file; several folders are opened as one source (the parts "
                          "of a build-shards --part build, in part order)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="remote --source: keep its fetched index files here, so the next run reads them locally")
    p.add_argument("--global-batch-tokens", type=tokens_or_schedule, metavar="N",
                   help="tokens per global batch, cut between sequences (default: the whole input is one batch); a "
                        "schedule N@STEP,N@STEP ramps it up")
    p.add_argument("--shuffle", action="store_true", help="shuffle docs by --seed before batching")
    p.add_argument("--seed", type=SEED, default=0, help="shuffle and planner seed (default 0)")
    p.add_argument("--shuffle-window", type=COUNT, default=1 << 16, metavar="N",
                   help="docs shuffled together, as the loader's shuffle_window (default 65536)")
    p.add_argument("--max-seq-len", type=tokens_or_schedule, metavar="N",
                   help=f"context limit; longer docs are handled by --long-docs (default: {max_seq_len_default}); "
                        f"a schedule N@STEP,N@STEP warms it up")
    p.add_argument("--long-docs", default="split", choices=("split", "truncate", "drop", "error"),
                   help="docs over --max-seq-len: split into segments (default), truncate, drop or error")


def si_units(x: float) -> str:
    """``x`` with a K/M/G suffix for tables (``254.19K``)."""
    for unit, k in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= k:
            return f"{x / k:.2f}{unit}"
    return f"{x:.0f}"
