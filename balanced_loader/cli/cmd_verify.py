"""``balanced-loader verify DIR``: check a shard folder fully (reads every byte once, writes nothing).

Prints one line per problem (and notes on what could not be checked, such as folders built
before checksums), then a summary. Exit code 0: no problems; 2: problems.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", metavar="DIR", help="shard folder (balanced-loader build-shards)")


def run(args: argparse.Namespace) -> int:
    from balanced_loader.build.verify import verify_folder

    report = verify_folder(args.folder)
    for line in report.problems:
        print(f"problem: {line}")
    for line in report.notes:
        print(f"note: {line}")
    print(report.summary())
    return 2 if report.problems else 0
