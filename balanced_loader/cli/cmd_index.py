"""``balanced-loader index DIR``: rebuild a shard folder's length index explicitly, after checking every
shard and doc against the checksums the build recorded (:mod:`balanced_loader.build.reindex`).

Readers never index a folder on their own: a folder without an index, or whose index disagrees with
its shards, is refused with a line naming this command. Exit code 0: indexed; 2: a check failed
(nothing was written).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", metavar="DIR", help="shard folder whose length index to (re)build")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from balanced_loader.build.reindex import reindex_folder

    report = reindex_folder(args.folder, progress=not args.no_progress and sys.stderr.isatty())
    for line in report.notes:
        print(f"note: {line}")
    print(report.summary())
    return 0
