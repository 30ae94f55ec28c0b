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
# 2. timings: local varlen attention implementations, then the CP engines on one packed batch.
# Exits non-zero on the first failed check.
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

echo "== local attention kernels on $DEVICE (forward+backward, median)"
"$PY" tools/bench_cp.py kernels --device "$DEVICE" --repeats 5 2>/dev/null
echo "== CP engines on $DEVICE, 4 ranks, 8192 tokens"
"$PY" tools/bench_cp.py engines --world-size 4 --tokens 8192 --repeats 3 --device "$DEVICE" 2>/dev/null
echo "gpu_check: all checks passed"
