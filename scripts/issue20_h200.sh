#!/usr/bin/env bash
# Issue 20's remaining H200 measurements in one short lease (est. 4.5-6 minutes; docs/benchmarks.md,
# "Forward follows the bytes"):
#   1. the per-kernel profile of the fused B=1 forward (1b and 8b, T=1 and 5): GEMM / attention /
#      fused / other µs, the gap, non-GEMM µs per layer (target <= 10);
#   2. `bench real` with the torch.compile engine (the gpt-fast anchor), 1b then small, B=1 and 16.
#   bash scripts/issue20_h200.sh OUT [BUDGET_S]
# Each step runs under `timeout`, capped by what is left of BUDGET_S (default 360 s); JSON and logs
# go to OUT, one line per config to OUT/summary.txt (printed at the end).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: issue20_h200.sh OUT [BUDGET_S]}
BUDGET=${2:-360}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
# The compile probe's child and the bench share inductor's on-disk caches: the parent's compile of
# the shapes the child just compiled is mostly a cache hit.
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
PY=${PYTHON:-python3}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

step() {  # step NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, time left); log to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then echo "$name: SKIPPED (budget spent)" | tee -a "$SUMMARY"; return; fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$SUMMARY"
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1

# 1. Per-kernel profile (each config's fused forward is checked against SDPA first). One process
#    for both shapes (one Triton JIT warm-up); the 8b T=1 row costs seconds. Est. 45-70 s.
step profile 100 $PY scripts/profile_forward.py --trials 15 --profile-calls 5 --top 12 --shape 1b 8b --batch 1 \
    --capacity 1024 --valid 512 --t 1 5 --kernels auto --json "$OUT/pf_b1_kernels.json"
grep '^summary:' "$OUT/profile.log" >> "$SUMMARY"

# 2. bench real with the compile engine, one model per process (a timeout or crash costs only that
#    model). vllm-style gives the model-only floor; one acceptance level (0.8: the earlier tables'
#    middle row), no HF, no M sweep, no plot. A compile probe
#    slower than --compile-timeout reports the engine `not run` and the rest is still timed.
#    Est. 120-160 s for 1b, 100-140 s for small (mostly inductor compiling, in the probe and again).
real() {  # real MODEL LIMIT_S
  rm -f "$OUT/real_$1.json"  # a stale file must not pass for this run's
  step "real_$1" "$2" $PY -m graphburst bench real --models "$1" --batches 1,16 --engines vllm,graphburst,compile \
      --accepts 0.8 --no-m-sweep --no-plot --compile-timeout 75 --json "$OUT/real_$1.json"
  $PY scripts/real_summary.py "$OUT/real_$1.json" >> "$SUMMARY"
}
real 1b 170
real small 170

echo "total $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
cat "$SUMMARY"
