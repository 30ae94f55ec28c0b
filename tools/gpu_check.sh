#!/usr/bin/env bash
# GPU check of the parallel runtime (manual; CI never needs it): what CPU tests cannot show.
#
#   tools/gpu_check.sh                 # on a machine with CUDA devices (one is enough; two add the NCCL step)
#   DEVICE=cpu tools/gpu_check.sh      # the same script on CPU (a dry run of every step that can run there)
#
# 1. the device, and flash-attention installed (the CUDA attention kernel: without it the runtime falls
#    back to per-doc SDPA; a dense [T, T] mask is never used).
# 2. selfcheck --dtype bfloat16 on ring, Ulysses and nested CP against the fp32 one-process reference
#    (4 ranks sharing the device through gloo; on CUDA every ring block runs flash-attention's varlen
#    kernels, the path no CPU run takes), then fp32 layouts and one 64K-token doc (peak memory).
# 3. the estimate's accuracy: `python -m parallel_runtime.diagnostics.memcheck` runs one microbatch of the
#    GPU recipe's model for real and on fake tensors; the estimate must be within 10% of
#    torch.cuda.max_memory_allocated.
# 4. a 2-rank NCCL step of a pp=2 pipeline with several microbatches, with and without train.overlap (the
#    orders the estimate's replay checks), when two GPUs exist; NCCL refuses two ranks on one GPU, so on
#    one GPU it says so and skips.
# 5. timings of the attention kernels and CP engines, and a bf16 training step of the tiny recipe.
# Prints one screen to paste into docs/RESULTS.md. Exits non-zero on the first failed check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEVICE=${DEVICE:-cuda}
GPUS=0
if [ "$DEVICE" = cuda ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA device')"
  "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__, \
'| devices', torch.cuda.device_count())"
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  echo "== flash-attention"
  "$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" || {
    echo "gpu_check: flash-attn is not installed (pip install flash-attn --no-build-isolation); the runtime" \
         "would fall back to per-doc SDPA"; exit 1; }
fi
summary() { "$PY" -c "import json, sys; d = json.load(sys.stdin); l = d['layout']; \
h = d.get('half', {}); extra = f\", one-process {h['dtype']} {h['one_process_rel_diff_grad']:.2e}\" if h else ''; \
print(f\"{l['cp_engine']:8s} {l.get('dtype', 'float32'):8s} world {l['world_size']} tp {l['tp']} cp {l['cp']} \
({l['ulysses']}x{l['ring']}): loss diff {d['max_abs_diff_loss']:.2e}, grad rel diff {d['max_rel_diff_grad']:.2e}\
{extra}, tol {d['tolerance']:.1e}, ok={d['ok']}, {d['seconds']} s\"); sys.exit(0 if d['ok'] else 1)"; }

echo "== selfcheck bf16 on $DEVICE (against the fp32 reference)"
"$PY" -m parallel_runtime selfcheck --world-size 4 --cp 4 --cp-engine ring --dtype bfloat16 --device "$DEVICE" | summary
"$PY" -m parallel_runtime selfcheck --world-size 4 --cp 4 --cp-engine ulysses --dtype bfloat16 --device "$DEVICE" \
  | summary
"$PY" -m parallel_runtime selfcheck --world-size 4 --cp 4 --cp-engine nested --ulysses 2 --dtype bfloat16 \
  --device "$DEVICE" | summary
echo "== selfcheck fp32 on $DEVICE"
"$PY" -m parallel_runtime selfcheck --world-size 1 --device "$DEVICE" | summary
"$PY" -m parallel_runtime selfcheck --world-size 4 --tp 2 --cp 2 --cp-engine ring --device "$DEVICE" | summary

peak() { "$PY" -c "import json, sys; d = json.load(sys.stdin); l = d['layout']; \
print(f\"{l['cp_engine']:8s} world {l['world_size']} cp {l['cp']}, one doc of {d['batch']['tokens']} tokens: \
loss diff {d['max_abs_diff_loss']:.2e}, grad rel diff {d['max_rel_diff_grad']:.2e}, ok={d['ok']}, \
peak {d.get('peak_rss_mb')} MB (worst rank), {d['seconds']} s\"); sys.exit(0 if d['ok'] else 1)"; }
echo "== one 64K-token doc through nested CP on $DEVICE (bf16)"
"$PY" -m parallel_runtime selfcheck --world-size 4 --cp 4 --cp-engine nested --ulysses 2 --doc-tokens 65536 \
  --heads 8 --kv-heads 4 --dtype bfloat16 --device "$DEVICE" --timeout 1200 | peak

echo "== the estimate's memory for one microbatch vs the device's count"
TOKENS=${TOKENS:-8192}
RECIPE=recipes/gpu-h100x8-dcp.yaml
[ "$DEVICE" = cuda ] || { RECIPE=recipes/cpu-hetero.yaml; TOKENS=1024; }
"$PY" -m parallel_runtime.diagnostics.memcheck --recipe "$RECIPE" --tokens "$TOKENS" --device "$DEVICE" \
  --set train.attention=auto | "$PY" -c "import json, sys; d = json.load(sys.stdin); \
print(f\"{d['recipe']}, {d['tokens']} tokens, flash {d['flash']}: predicted {d['predicted']['peak_bytes'] / 2**30:.2f} \
GiB, measured {d['measured']['peak_bytes'] / 2**30:.2f} GiB ({d['measured']['counter']}), ratio {d['ratio']:.3f}, \
ok={d['ok']}\"); sys.exit(0 if d['ok'] else 1)"

echo "== a 2-rank NCCL step of a pp=2 pipeline"
if [ "$DEVICE" = cuda ] && [ "$GPUS" -ge 2 ]; then
  SHARDS=$(mktemp -d)
  "$PY" -c "from balanced_loader.build.corpus import stdlib_shards; stdlib_shards('$SHARDS', limit=300)"
  for OVERLAP in true false; do
    OUT=$(mktemp -d)
    timeout 600 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m parallel_runtime \
      --recipe recipes/cpu-hetero.yaml --out "$OUT" --steps 3 --set data.source="$SHARDS" \
      --set world.size=2 --set world.device=cuda --set world.backend=nccl --set world.timeout_s=120 \
      --set "policy.extra.pools=[{tp: 1, pp: 2, lanes: 1}]" --set "cost.lane_caps={1x2: 512}" \
      --set data.max_seq_len=512 --set data.global_batch_tokens=4096 --set train.dtype=bfloat16 \
      --set train.attention=auto --set train.overlap=$OVERLAP --set train.calibrate=false --set train.trace=false \
      --set train.checkpoint_every=0 > "$OUT/log" 2>&1 || { cat "$OUT/log"; echo "gpu_check: the NCCL pp=2 step" \
      "failed (overlap $OVERLAP)"; exit 1; }
    "$PY" -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]; \
print(f\"overlap $OVERLAP: {len(rows)} steps, microbatches per rank {rows[-1]['microbatches']}, \
loss {rows[-1]['loss']:.4f}, step {rows[-1]['step_ms'] / 1e3:.2f} s\")" "$OUT/metrics.jsonl"
  done
else
  echo "skipped: $GPUS CUDA device(s) here; NCCL refuses two ranks on one GPU, so the 2-rank NCCL pp=2 step" \
       "needs two (the estimate's replay checks the order on CPU: tests/parallel_runtime/diagnostics/test_estimate.py)"
fi

echo "== local attention kernels on $DEVICE (forward+backward, median)"
"$PY" tools/bench_cp.py kernels --device "$DEVICE" --repeats 5 2>/dev/null
echo "== CP engines on $DEVICE, 4 ranks, 8192 tokens"
"$PY" tools/bench_cp.py engines --world-size 4 --tokens 8192 --repeats 3 --device "$DEVICE" 2>/dev/null
echo "== bf16 training step on $DEVICE (tiny recipe, one process)"
OUT=$(mktemp -d)
"$PY" -m parallel_runtime --recipe recipes/cpu-hetero.yaml --reference --steps 3 --out "$OUT" \
  --set world.device="$DEVICE" --set train.dtype=bfloat16 > /dev/null
"$PY" -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]; \
[print(f\"step {r['step']}: loss {r['loss']:.4f}, step {r['step_ms'] / 1e3:.2f} s, \
peak {max(r['memory']['peak_bytes']) / 1e6:.0f} MB\") for r in rows]" "$OUT/metrics.jsonl"
echo "gpu_check: all checks passed"
