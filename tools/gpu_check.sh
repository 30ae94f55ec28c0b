#!/usr/bin/env bash
# GPU check of the parallel runtime (manual; CI never needs it).
#
#   tools/gpu_check.sh                 # on a machine with one CUDA device
#   DEVICE=cpu tools/gpu_check.sh      # the same script on CPU (a dry run of every step)
#
# 1. selfcheck with CUDA kernels on one device: world size 1 (SDPA, or flash-attention when
#    installed and the dtype allows), then 4 ranks sharing the device through gloo (CUDA tensors
#    of point-to-point and all-to-all ops are staged through host memory; TP all-reduces run
#    on the device), ring / Ulysses / nested / TP x CP, each against the fp32 CPU reference.
# 2. one 64K-token doc through ring (2 ranks) and nested CP (Ulysses 2 inside a ring of 2, 4 ranks),
#    tiled / flash kernels, with the worst rank's peak memory.
# 3. timings: local varlen attention implementations, then the CP engines on one packed batch.
# 4. a bf16 training step of the tiny recipe on the device (--reference: one process), its step time
#    and peak memory from metrics.jsonl. (NCCL needs one GPU per rank: on a single device the ranks
#    share it through gloo; with several GPUs run `accelerate launch` with world.backend=nccl.)
# Prints one screen to paste into docs/RESULTS.md. Exits non-zero on the first failed check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA device')"
  "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
fi
summary() { "$PY" -c "import json, sys; d = json.load(sys.stdin); l = d['layout']; \
print(f\"{l['cp_engine']:8s} world {l['world_size']} tp {l['tp']} cp {l['cp']} ({l['ulysses']}x{l['ring']}): \
loss diff {d['max_abs_diff_loss']:.2e}, grad rel diff {d['max_rel_diff_grad']:.2e}, ok={d['ok']}, {d['seconds']} s\")"; }

echo "== selfcheck on $DEVICE"
"$PY" -m parallel_runtime selfcheck --world-size 1 --device "$DEVICE" | summary
"$PY" -m parallel_runtime selfcheck --world-size 4 --cp 4 --cp-engine ring --device "$DEVICE" | summary
"$PY" -m parallel_runtime selfcheck --world-size 4 --cp 4 --cp-engine ulysses --device "$DEVICE" | summary
"$PY" -m parallel_runtime selfcheck --world-size 4 --cp 4 --cp-engine nested --ulysses 2 --device "$DEVICE" | summary
"$PY" -m parallel_runtime selfcheck --world-size 4 --tp 2 --cp 2 --cp-engine ring --device "$DEVICE" | summary

peak() { "$PY" -c "import json, sys; d = json.load(sys.stdin); l = d['layout']; \
print(f\"{l['cp_engine']:8s} world {l['world_size']} cp {l['cp']}, one doc of {d['batch']['tokens']} tokens: \
loss diff {d['max_abs_diff_loss']:.2e}, grad rel diff {d['max_rel_diff_grad']:.2e}, ok={d['ok']}, \
peak {d.get('peak_rss_mb')} MB (worst rank), {d['seconds']} s\")"; }
echo "== one 64K-token doc through ring and nested CP on $DEVICE"
"$PY" -m parallel_runtime selfcheck --world-size 2 --cp 2 --cp-engine ring --doc-tokens 65536 --heads 8 --kv-heads 4 \
  --device "$DEVICE" --timeout 1200 | peak
"$PY" -m parallel_runtime selfcheck --world-size 4 --cp 4 --cp-engine nested --ulysses 2 --doc-tokens 65536 --heads 8 \
  --kv-heads 4 --device "$DEVICE" --timeout 1200 | peak

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
