#!/usr/bin/env bash
# The H200 benchmark run behind docs/benchmarks.md: every step bounded, results in $1.
# Usage (repo root, on a GPU machine): bash scripts/h200_bench.sh OUT_DIR [SECONDS_BUDGET]
set -u
out=${1:?usage: h200_bench.sh OUT_DIR [SECONDS]}
budget=${2:-540}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
start=$(date +%s)
step() {  # step NAME SECONDS CMD...: run CMD under a timeout capped by what is left of the budget
    local name=$1 limit=$2; shift 2
    local left=$(( budget - ($(date +%s) - start) ))
    (( left < 20 )) && { echo "$name: skipped (budget spent)" | tee -a "$out/summary.txt"; return; }
    (( limit > left )) && limit=$left
    local t0=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.txt"
}
date -u +"%Y-%m-%d %H:%M UTC" > "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >> "$out/summary.txt"
step latency_quick 90 python3 -m graphburst.cli bench latency --quick --json "$out/latency_quick.json"
step sampling_stub 60 python3 -m graphburst.cli bench latency --sampling --json "$out/sampling_stub.json"
step sampling_1b 90 python3 -m graphburst.cli bench latency --sampling --sampling-model 1b --reps 3 --chunk 10 \
    --json "$out/sampling_1b.json"
step serve 150 python3 -m graphburst.cli bench serve --http --json "$out/serve.json"
step real 300 python3 -m graphburst.cli bench real --json "$out/real.json" --plot "$out/real_models_h200.png"
