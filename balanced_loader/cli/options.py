"""Options shared by the commands that cut a lengths file or a source into global batches."""

from __future__ import annotations

import argparse


def add_batch_arguments(p: argparse.ArgumentParser, *, max_seq_len_default: str) -> None:
    """``--lengths|--source`` (one required), ``--global-batch-tokens``, ``--shuffle``, ``--seed``,
    ``--shuffle-window``, ``--max-seq-len`` and ``--long-docs``, with the same meaning as the loader's batching."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="FILE",
                     help="length file: .txt (one length a line, also .txt.gz) or .npy; doc_id = line")
    src.add_argument("--source", metavar="DIR", help="a shard folder (balanced-loader build-shards) or .jsonl")
    p.add_argument("--global-batch-tokens", type=int, metavar="N",
                   help="tokens per global batch, cut between docs (default: the whole input is one batch)")
    p.add_argument("--shuffle", action="store_true", help="shuffle docs by --seed before batching")
    p.add_argument("--seed", type=int, default=0, help="shuffle and planner seed (default 0)")
    p.add_argument("--shuffle-window", type=int, default=1 << 16, metavar="N",
                   help="docs shuffled together, as the loader's shuffle_window (default 65536)")
    p.add_argument("--max-seq-len", type=int, metavar="N",
                   help=f"context limit; longer docs are handled by --long-docs (default: {max_seq_len_default})")
    p.add_argument("--long-docs", default="split", choices=("split", "truncate", "drop", "error"),
                   help="docs over --max-seq-len: split into segments (default), truncate, drop or error")
