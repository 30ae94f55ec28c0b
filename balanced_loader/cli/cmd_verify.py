"""``balanced-loader verify DIR|PREFIX``: check a dataset fully (reads every byte once, writes nothing).

A shard folder, a Megatron dataset (``PREFIX``, or its ``.idx``/``.bin``; ``--write-checksums`` writes
``PREFIX.crc32.npy``, the crc32 of every sequence, which reads check from then on) or a folder of
datatrove token files. Prints one line per problem (and notes on what could not be checked, such as
folders built before checksums), then a summary. Exit code 0: no problems; 2: problems.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", metavar="DIR|PREFIX", help="a shard folder (balanced-loader build-shards), a Megatron "
                   "dataset PREFIX (of PREFIX.bin + PREFIX.idx) or a folder of datatrove .ds files")
    p.add_argument("--write-checksums", action="store_true",
                   help="Megatron dataset: write PREFIX.crc32.npy (crc32 per sequence) when its structure is sound; "
                        "reads check it from then on")


def run(args: argparse.Namespace) -> int:
    from balanced_loader.build.verify import verify

    report = verify(args.folder, write_checksums=args.write_checksums)
    for line in report.problems:
        print(f"problem: {line}")
    for line in report.notes:
        print(f"note: {line}")
    print(report.summary())
    return 2 if report.problems else 0
