"""HydraCPScheduler beside Megatron-Core's BalancedCPScheduler, on CPU, over real sample lengths.

Megatron-Core 0.16's hybrid (dynamic) context parallelism asks a scheduler for each global batch's
``(groups, sample_id_groups)``; this script gives both schedulers the same ``sample_id_seqlens`` (one global
batch of about 4 x ranks x max_seq_len_per_rank tokens of Wikipedia doc lengths, or the byte sizes of this
machine's Python standard library files with ``--corpus stdlib``) and prints the modeled step time of each
schedule under Megatron's execution model (each sample its own forward/backward, a barrier after each
group; contract-2 cost ``hydra-gpt7b-a100``) side by side, with a lower bound no schedule beats::

    python examples/megatron_hybrid_cp.py                      # 64 ranks, 32K and 256K context
    python examples/megatron_hybrid_cp.py --ranks 512 --corpus stdlib

Megatron's scheduler runs on CPU as it is (it reads only ``dp_cp_group.size()``); without megatron-core
installed (``pip install --no-deps megatron-core==0.16.1``) the project's faithful reproduction stands in.
In a Megatron job the swap is one line (docs/megatron.md)::

    wrapper = HybridCPDataLoaderWrapper(train_data_iterator, config)
    wrapper.cp_balancing_scheduler = HydraCPScheduler(config.max_seqlen_per_dp_cp_rank, wrapper.dp_cp_group)
"""

import argparse
import gzip
import os
import sysconfig
import time
import warnings

import numpy as np

from balanced_loader.integrations.megatron import HydraCPScheduler, check_schedule, megatron_cp_degrees
from balanced_loader.planning.megatron_cp import modeled_ms
from balanced_loader.planning.policies.mcore_dcp import schedule as mcore_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DpCpGroup:
    """The one thing BalancedCPScheduler reads of its process group."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def megatron_class():
    """megatron-core's BalancedCPScheduler, or None (imported once, outside the timed calls)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError:
        return None
    return BalancedCPScheduler


def megatron_schedule(cls, cap: int, ranks: int, pairs: list) -> tuple[str, list]:
    if cls is None:
        groups = []
        for rnd in mcore_schedule(np.asarray([s for _, s in pairs]), ranks, cap):
            per = [[] for _ in range(ranks)]
            for first, size, docs in rnd:
                for r in range(first, first + size):
                    per[r] = list(docs)
            groups.append(per)
        return "Megatron (reproduction)", groups
    return "Megatron-Core", cls(cap, DpCpGroup(ranks)).get_groups_and_subsamples(pairs, None)[1]


def lengths_of(corpus: str) -> np.ndarray:
    if corpus == "wikipedia":
        with gzip.open(os.path.join(REPO, "data", "wikipedia_lengths.txt.gz")) as f:
            return np.loadtxt(f, dtype=np.int64)
    root = sysconfig.get_paths()["stdlib"]
    return np.asarray([os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
                       if f.endswith(".py")], dtype=np.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=64, help="DP x CP ranks (default 64)")
    p.add_argument("--max-seq-len-per-rank", type=int, default=8192)
    p.add_argument("--corpus", choices=("wikipedia", "stdlib"), default="wikipedia")
    a = p.parse_args()
    cap, ranks = a.max_seq_len_per_rank, a.ranks
    raw = lengths_of(a.corpus)
    hydra = HydraCPScheduler(cap, world_size=ranks)  # in a job: HydraCPScheduler(cap, dp_cp_group)
    cls = megatron_class()
    print(f"{ranks} DP x CP ranks, max_seq_len_per_rank {cap}, cost {hydra.cost.name}, {a.corpus} lengths\n")
    print(f"{'context':>8} {'samples':>8} {'scheduler':>24} {'groups':>6} {'largest CP':>10} {'modeled ms':>11} "
          f"{'/ bound':>8} {'plan s':>7}")
    for ctx in (32768, min(262144, cap * ranks)):
        docs = raw[(raw > 0) & (raw <= ctx)]
        docs = docs[np.random.default_rng(0).permutation(len(docs))]
        batch = docs[:int(np.searchsorted(np.cumsum(docs), 4 * ranks * cap, side="right"))]
        pairs = list(enumerate(batch.tolist()))  # sample_id_seqlens, as HybridCPDataLoaderWrapper builds it
        t0 = time.perf_counter()
        name, meg = megatron_schedule(cls, cap, ranks, pairs)
        meg_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        groups, ours = hydra.get_groups_and_subsamples(pairs, None)
        our_s = time.perf_counter() - t0
        check_schedule(ours, pairs, ranks, cap, groups=groups)  # Megatron's rules
        bound = hydra.last["lower_bound_ms"]
        rows = [(name, meg, meg_s), ("HydraCPScheduler", ours, our_s)]
        times = []
        for label, ids, secs in rows:
            t = modeled_ms(ids, pairs, hydra.cost, ranks)
            times.append(t)
            print(f"{ctx // 1024:>7}K {len(batch):>8,} {label:>24} {len(ids):>6} "
                  f"{max(megatron_cp_degrees(ids).values()):>10} {t:>11,.0f} {t / bound:>8.3f} {secs:>7.2f}")
        print(f"{'':>8} {'':>8} {'speedup':>24} {times[0] / times[1]:>6.3f}x\n")


if __name__ == "__main__":
    main()
