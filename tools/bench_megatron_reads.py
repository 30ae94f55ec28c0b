"""Bytes a Megatron dataset costs the loader: one epoch on 4 ranks, bytes read (and served over HTTP) against
the bytes of the tokens delivered, without and with a checksum sidecar.

A dataset of ``--docs`` sequences (mostly short, a 15% tail of 3K-20K tokens) is written to a temporary folder;
hydra on 4 ranks, lane cap 2048, ``max_seq_len`` 6144 (long docs split), one epoch. Rows: local reads and
HTTP range reads (the project's range server), each without and with ``PREFIX.crc32.npy`` (``verify
--write-checksums``), where a piece of a doc fetches the whole doc to check it.

    PYTHONPATH=. python tools/bench_megatron_reads.py [--docs 400]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from balanced_loader import cli
from balanced_loader.cost import CostModel
from balanced_loader.data.megatron import write_indexed_dataset
from balanced_loader.diagnostics.range_server import RangeServer
from balanced_loader.loader import BalancedLoader

WORLD, CAP = 4, 2048
COST = CostModel.from_dict({"quadratic_ms": 1e-4, "linear_ms": 0.01, "microbatch_ms": 1.0,
                            "comm_bytes_per_token": 1e4, "bandwidth_gbs": {2: 10.0}, "max_tokens_per_lane": CAP})


def epoch(spec: str) -> tuple[int, int]:
    """(bytes the 4 sources read, bytes of the tokens delivered) over one epoch."""
    loaders = [BalancedLoader(spec, policy="hydra", cost=COST, world_size=WORLD, rank=r,
                              global_batch_tokens=6 * CAP * WORLD, seed=4, epochs=1, max_seq_len=3 * CAP)
               for r in range(WORLD)]
    delivered = 0
    for batches in zip(*loaders, strict=True):
        for b in batches:
            for mb in b.microbatches:
                delivered += sum(length for doc, _, length in mb.segments if doc >= 0)
    read = sum(ld.source.bytes_read for ld in loaders)
    for ld in loaders:
        ld.close()
    return read, delivered * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=400)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lens = np.where(rng.random(args.docs) < 0.15, rng.integers(3_000, 20_000, args.docs),
                    rng.integers(1, 900, args.docs))
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "corpus_text_document")
        write_indexed_dataset(prefix, [rng.integers(0, 60_000, int(n)) for n in lens])
        print(f"{args.docs} sequences, {int(lens.sum()):,} tokens; 4 ranks, one epoch\n")
        print("| reads | checksum sidecar | bytes read / bytes delivered | bytes served / bytes delivered |")
        print("|---|---|---|---|")
        for crc in (False, True):
            if crc:
                cli.main(["verify", prefix, "--write-checksums"])
            read, need = epoch(prefix)
            print(f"| local | {'yes' if crc else 'no'} | {read / need:.4f} | |")
            with RangeServer(d) as server:
                read, need = epoch(f"{server.url}/corpus_text_document")
                served = server.bytes_served.get("/corpus_text_document.bin", 0)
                print(f"| HTTP | {'yes' if crc else 'no'} | {read / need:.4f} | {served / need:.4f} |")


if __name__ == "__main__":
    main()
