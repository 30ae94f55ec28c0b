"""``balanced-loader candidates``: Hydraulis candidate strategies from a dataset's length histogram.

Writes a YAML file (``format: balanced-loader/candidates``) for the ``hydraulis`` policy
(``PlanConfig.candidates``). Docs longer than ``--max-seq-len`` count as pieces of ``--max-seq-len``
tokens (the loader's ``split``); ``--global-batch-tokens`` scales the histogram to one global
batch, which is what the DP's per-pipeline times mean (recommended).
"""

from __future__ import annotations

import argparse

from balanced_loader.cli.options import DEGREE, RANKS, TOKENS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", required=True, metavar="FILE", help="length file (.txt, .txt.gz or .npy)")
    p.add_argument("--world-size", type=RANKS, required=True, metavar="R", help="number of GPUs")
    g = p.add_argument_group("cost model (one of)")
    g.add_argument("--cost-file", metavar="COST.yaml", help="contract-2 cost file with 'strategies'")
    g.add_argument("--cost", metavar="PRESET", help="cost preset name (see 'balanced-loader presets')")
    p.add_argument("--out", required=True, metavar="CANDIDATES.yaml", help="where to write the candidates")
    p.add_argument("--max-seq-len", "--max-len", dest="max_len", type=TOKENS, metavar="S",
                   help="longest length covered; longer docs count as pieces of S (default: the largest "
                        "max_tokens_per_lane of the usable shapes)")
    p.add_argument("--global-batch-tokens", type=TOKENS, metavar="N",
                   help="scale the histogram to N tokens, one global batch (default: the file as is)")
    p.add_argument("--delta-s", type=TOKENS, default=None, metavar="TOKENS",
                   help="length grid step (default 128, raised so the grid has at most 256 bins)")
    p.add_argument("--delta-n", type=DEGREE, default=1, metavar="GPUS", help="GPU grid step (default 1)")
    p.add_argument("--fixed-cost", choices=("packed", "doc"), default="packed",
                   help="microbatch_ms per packed microbatch share (default) or per doc (the paper's code)")


def histogram(lengths, max_len: int, batch_tokens: int | None):
    """``(values, weights)`` of the split lengths, scaled to ``batch_tokens`` when given."""
    import numpy as np

    ln = np.asarray(lengths, dtype=np.int64)
    ln = ln[ln > 0]
    if ln.size == 0:
        raise ValueError("the length file has no non-empty docs")
    full, rest = ln // max_len, ln % max_len
    values, counts = np.unique(np.concatenate([rest[rest > 0], np.full(int(full.sum()), max_len)]),
                               return_counts=True)
    weights = counts.astype(np.float64)
    if batch_tokens is not None:
        if batch_tokens < 1:
            raise ValueError(f"--global-batch-tokens must be >= 1, got {batch_tokens}")
        weights *= batch_tokens / float((values * counts).sum())
    return values, weights


def run(args: argparse.Namespace) -> int:
    from balanced_loader.data.lengths import read_lengths
    from balanced_loader.outputs.files import write_text
    from balanced_loader.planning.solvers import candidates as cands
    from balanced_loader.presets import load_cost

    cost = load_cost(args.cost_file, args.cost, world_size=args.world_size)
    shapes = cands.usable_shapes(cost, args.world_size)
    max_len = args.max_len if args.max_len is not None else max(s.max_tokens_per_lane for s in shapes)
    if max_len < 1:
        raise ValueError(f"--max-seq-len must be >= 1, got {max_len}")
    values, weights = histogram(read_lengths(args.lengths), max_len, args.global_batch_tokens)
    per_bin = -(-int(values.max()) // 256)  # tokens per bin for a 256-bin grid
    delta_s = args.delta_s or max(128, -(-per_bin // 128) * 128)
    out = cands.generate(values, weights, cost, args.world_size, delta_s=delta_s, delta_n=args.delta_n,
                         fixed_cost=args.fixed_cost)
    text = cands.dumps(out, world_size=args.world_size, max_len=max_len, delta_s=delta_s, delta_n=args.delta_n,
                       fixed_cost=args.fixed_cost, cost_name=cost.name)
    write_text(args.out, text)
    print(f"{len(out)} candidates for {args.world_size} GPUs (lengths <= {max_len}, delta_s {delta_s}) -> {args.out}")
    for i, c in enumerate(out):
        print(f"  {i:2d}  {c.label():48s} covers {c.covers:>7d}  dp {c.dp_ms:10.1f} ms")
    return 0
