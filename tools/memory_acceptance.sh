#!/usr/bin/env bash
# Issue 12's memory acceptance: peak resident memory of the largest of 4 CPU ranks, the 27M-parameter
# model over the tiny one (cpu-hetero.yaml, train.recompute=true, 3 steps), as a multiple of the 27M
# model's fp32 bytes (110.1 MB), with the defaults (glibc's own heap threshold, world.heap_mmap_kb=0).
# Each repeat also runs the 27M model with a fixed 1 MiB threshold (world.heap_mmap_kb=1024) and
# prints its growth and the step-time ratio (median over steps 1-2, the same repeat).   tools/memory_acceptance.sh [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=$(mktemp -d)
export OMP_NUM_THREADS=1
BIG=(--set model.hidden=512 --set model.ffn_hidden=1536 --set model.num_layers=8 --set model.num_heads=8
     --set model.num_kv_heads=8)
L=("$PY" -m accelerate.commands.launch --multi_gpu --num_processes 4 -m parallel_runtime
   --recipe recipes/cpu-hetero.yaml --steps 3 --set train.recompute=true)
for rep in $(seq "${1:-2}"); do
  "${L[@]}" --out "$OUT/tiny$rep" > "$OUT/tiny$rep.log" 2>&1
  "${L[@]}" "${BIG[@]}" --out "$OUT/big$rep" > "$OUT/big$rep.log" 2>&1
  "${L[@]}" "${BIG[@]}" --set world.heap_mmap_kb=1024 --out "$OUT/fixed$rep" > "$OUT/fixed$rep.log" 2>&1
  "$PY" - "$OUT/tiny$rep/metrics.jsonl" "$OUT/big$rep/metrics.jsonl" "$OUT/fixed$rep/metrics.jsonl" "$rep" <<'PY'
import json, statistics, sys
def rows(p):
    return [json.loads(l) for l in open(p) if l.strip()]
def peak(p):
    return max(max(r["memory"]["peak_bytes"]) for r in rows(p))
def step_ms(p):
    return statistics.median(r["step_ms"] for r in rows(p)[1:])
t, b, g = peak(sys.argv[1]), peak(sys.argv[2]), peak(sys.argv[3])
print(f"repeat {sys.argv[4]}: tiny {t / 1e6:.1f} MB, 27M {b / 1e6:.1f} MB, growth {(b - t) / 1e6:.1f} MB "
      f"= {(b - t) / 110.135e6:.2f}x the model's fp32 bytes (defaults); with heap_mmap_kb=1024: {(g - t) / 110.135e6:.2f}x; "
      f"step time 1 MiB / default {step_ms(sys.argv[3]) / step_ms(sys.argv[2]):.3f}")
PY
done
