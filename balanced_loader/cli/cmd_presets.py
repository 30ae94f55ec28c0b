"""``balanced-loader presets``: list cost, model and hardware presets."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--show", metavar="PRESET", help="print one cost preset as a cost file (YAML)")


def run(args: argparse.Namespace) -> int:
    from balanced_loader import presets

    if args.show:
        print(presets.cost_preset(args.show).to_yaml(), end="")
        return 0
    print("cost presets (--cost NAME):")
    for name in sorted(presets.COST_PRESETS):
        c = presets.cost_preset(name)
        shapes = ", ".join(f"tp{s.tp}pp{s.pp}:{s.max_tokens_per_lane}" for s in c.shapes())
        print(f"  {name:28s} lane caps {shapes}")
    print("analytic presets: analytic:<model>@<hardware>")
    print("  models:   " + ", ".join(f"{k} (h{m.hidden} L{m.layers})" for k, m in sorted(presets.MODELS.items())))
    print("  hardware: " + ", ".join(f"{k} ({h.peak_tflops:g} TFLOP/s, {h.memory_gib:g} GiB)"
                                     for k, h in sorted(presets.HARDWARE.items())))
    return 0
