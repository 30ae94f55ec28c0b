#!/usr/bin/env bash
# hostile inputs to `python -m parallel_runtime estimate` (issue 36's tool), one line each expected, never a traceback
# usage: OUT=/tmp/pe PYTHON=.venv/bin/python tools/probe_estimate.sh   (from the repository root; about 2.5 min)
E="timeout 300 ${PYTHON:-python} -m parallel_runtime estimate"
R=recipes/gpu-h100x8-dcp.yaml
run() { name="$1"; shift; out=$("$@" 2>&1); rc=$?; tb=$(echo "$out" | grep -c "Traceback"); last=$(echo "$out" | tail -n 1 | cut -c1-160); echo "$name | rc=$rc | traceback=$tb | $last"; }
run "steps 0" $E --recipe $R --steps 0 --no-replay --out ${OUT:-/tmp/probe_estimate}/a
run "steps -3" $E --recipe $R --steps -3 --no-replay --out ${OUT:-/tmp/probe_estimate}/b
run "device-gib -1" $E --recipe $R --steps 1 --device-gib -1 --no-replay --out ${OUT:-/tmp/probe_estimate}/c
run "device-gib nan" $E --recipe $R --steps 1 --device-gib nan --no-replay --out ${OUT:-/tmp/probe_estimate}/d
run "device-gib 0.001" $E --recipe $R --steps 1 --device-gib 0.001 --no-replay --out ${OUT:-/tmp/probe_estimate}/e
run "missing recipe" $E --recipe /no/such.yaml --steps 1 --out ${OUT:-/tmp/probe_estimate}/f
run "recipe is a folder" $E --recipe recipes --steps 1 --out ${OUT:-/tmp/probe_estimate}/g
run "out is the recipe" $E --recipe $R --steps 1 --no-replay --out $R
run "out /dev/full" $E --recipe $R --steps 1 --no-replay --out /dev/full
run "bad --set key" $E --recipe $R --steps 1 --no-replay --set no.such=1 --out ${OUT:-/tmp/probe_estimate}/h
run "world.size=3" $E --recipe $R --steps 1 --no-replay --set world.size=3 --out ${OUT:-/tmp/probe_estimate}/i
run "replay-layers -1" $E --recipe $R --steps 1 --replay-layers -1 --out ${OUT:-/tmp/probe_estimate}/j
run "jobs 0" $E --recipe $R --steps 1 --jobs 0 --out ${OUT:-/tmp/probe_estimate}/k
run "cpu recipe" $E --recipe recipes/cpu-hetero.yaml --steps 1 --no-replay --out ${OUT:-/tmp/probe_estimate}/l
