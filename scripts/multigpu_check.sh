#!/usr/bin/env bash
# The nvidia-h200-x2 run of issue 13, in one call: GPU tests, demos, the 8B benchmark.
#   bash scripts/multigpu_check.sh OUT_DIR [BUDGET_S]
#   QUICK=1 bash scripts/multigpu_check.sh OUT_DIR 200   # TP=2 vs TP=1 only: tp1 and tp2s, the report (~2 min)
# Every step runs under `timeout`, capped by what is left of BUDGET_S (default 450 s), so a
# hung NCCL rank costs at most its step. Logs and JSON go to OUT_DIR; a summary at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: multigpu_check.sh OUT_DIR [BUDGET_S]}
BUDGET=${2:-450}
SHAPE=${SHAPE:-8b}  # SHAPE=tiny: a dry run of the whole script (on CPU: gloo, numpy backend)
QUICK=${QUICK:-}  # 1: no GPU tests or demos, layouts tp1 and tp2s (the sharded draft, issue 13's figure)
if [[ -n $QUICK ]]; then DEFAULT_LAYOUTS="tp1 tp2s"; else DEFAULT_LAYOUTS="tp1 tp2s tp2 pp2"; fi
LAYOUTS=${LAYOUTS:-$DEFAULT_LAYOUTS}  # tp1 first: it writes the fp32 tokens the others must match
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
PY=${PYTHON:-python}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

step() {  # step NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, time left); log to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 15 )); then echo "$name: SKIPPED (budget spent)" | tee -a "$SUMMARY"; return; fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$SUMMARY"
}

nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
TR="$PY -m torch.distributed.run --standalone --nproc_per_node 2"

if [[ -z $QUICK ]]; then
# 1. GPU tests: TP=2 / PP=2 == TP=1 over 50 bursts, rank check, a raising rank, a rank dying mid-graph
#    (bounded drain wait); each test launches torchrun.
step pytest_gpu 200 $PY -m pytest -q -m gpu tests/test_parallel_gpu.py -p no:cacheprovider
# 1b. Tensor-parallel serving: HTTP over torchrun --tp 2 (rank 0 serves, lockstep), stopped by SIGTERM
#     on rank 0 and on torchrun; tokens equal the one-GPU greedy reference.
step pytest_lockstep_gpu 150 $PY -m pytest -q -m gpu tests/test_lockstep.py -p no:cacheprovider
# 2. The demos, the way a user launches them.
step demo_tp2 60 $TR -m graphburst demo --model tiny-random --tp 2
step demo_pp2 60 $TR -m graphburst demo --model tiny-random --pp 2
fi


# 3. The benchmark, 8B shape: tp1 first (it writes the fp32 tokens the others must match).
for layout in $LAYOUTS; do
  if [[ $layout == tp1 ]]; then launcher="$PY"; else launcher="$TR"; fi
  step "bench_$layout" 100 $launcher -m graphburst.parallel.bench run --layout $layout --out "$OUT" --shape $SHAPE
done
step bench_report 30 $PY -m graphburst.parallel.bench report --out "$OUT" --shape $SHAPE

[[ -z $QUICK ]] && tail -n 3 "$OUT/pytest_gpu.log" "$OUT/pytest_lockstep_gpu.log" >> "$SUMMARY" 2>/dev/null
grep -h "per-round latency at B=1" "$OUT/bench_report.log" >> "$SUMMARY" 2>/dev/null
echo "total $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
cat "$OUT/bench_report.log" 2>/dev/null
