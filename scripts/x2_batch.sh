#!/usr/bin/env bash
# One nvidia-h200-x2 lease, in three calls of under 10 minutes each (the device tool's limit):
#   bash scripts/x2_batch.sh tests OUT   the single-GPU suite split over GPUs 0 and 1 (each half
#                                        in its own process), then the GEMV sweep (GPU 0) and the
#                                        B=1 forward profile, GEMV against cuBLAS (GPU 1)
#   bash scripts/x2_batch.sh bench OUT   bench real with the compile engine + the 8b load sweep
#                                        (GPU 0); the serving benchmarks (GPU 1)
#   bash scripts/x2_batch.sh multi OUT   the two-GPU tests, then TP=2 against TP=1 (QUICK)
#   bash scripts/x2_batch.sh final OUT   the single-GPU suite split test by test over both GPUs (a hung
#                                        test dumps its stack), the two-GPU tests, then the serving
#                                        benchmarks; OUT.tar.gz holds everything (the device tool
#                                        brings back only a few files)
# Every step runs under `timeout`; logs and JSON go to OUT, one line per step to OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:?usage: x2_batch.sh tests|bench|multi OUT}
OUT=${2:?usage: x2_batch.sh tests|bench|multi OUT}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off on these machines (device README, KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"

step() {  # step GPU NAME LIMIT_S CMD...: CMD on one GPU under timeout, logged to OUT/NAME.log
  local gpu=$1 name=$2 limit=$3; shift 3
  local t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name (GPU $gpu): rc=$rc in $(( $(date +%s) - t0 )) s; $(tail -n 1 "$OUT/$name.log")" >> "$SUMMARY"
}

split_suite() {  # the -m gpu node ids, split in two by file, the heaviest files apart
  $PY -m pytest -m gpu --collect-only -q -p no:cacheprovider 2>/dev/null | grep '::' > "$OUT/ids.txt"
  $PY - "$OUT" <<'EOF'
import collections, sys
out = sys.argv[1]
by_file = collections.Counter(line.split("::")[0] for line in open(f"{out}/ids.txt"))
heavy = {"tests/test_decode_kernels_gpu.py": 0, "tests/test_sampling_gpu.py": 1, "tests/test_llama_hf.py": 1,
         "tests/test_models_hf.py": 0}
halves, load = ([], []), [0, 0]
for f, n in sorted(by_file.items(), key=lambda kv: -kv[1]):
    i = heavy.get(f, 0 if load[0] <= load[1] else 1)
    halves[i].append(f)
    load[i] += n * (4 if f in heavy else 1)
for i, files in enumerate(halves):
    open(f"{out}/half{i}.txt", "w").write(" ".join(files))
EOF
}

alternate_ids() {  # the -m gpu node ids dealt alternately to two halves (one test's cost is local)
  $PY -m pytest -m gpu --collect-only -q -p no:cacheprovider 2>/dev/null | grep '::' > "$OUT/ids.txt"
  awk 'NR % 2 == 1' "$OUT/ids.txt" > "$OUT/ids0.txt"
  awk 'NR % 2 == 0' "$OUT/ids.txt" > "$OUT/ids1.txt"
}

load_8k() {  # load_8k LIMIT_S DURATION_S: four 8192-token prompts at once, whole prefill, then chunks of 512 (GPU 1)
  local chunk flag
  for chunk in none 512; do
    flag=(); [[ $chunk != none ]] && flag=(--prefill-chunk "$chunk")
    step 1 "load_8k_$chunk" "$1" $PY -m graphburst bench serve --backend cupy --model 1b --http --rates 8 \
        --duration "$2" --burst 4 --burst-prompt 8192 --capacity 8800 "${flag[@]}" --json "$OUT/load_8k_$chunk.json"
  done
}

case $PHASE in
final)
  alternate_ids
  for g in 0 1; do
    # pytest.main with the ids as a list: a parametrized id may hold spaces
    step $g "gpu_suite$g" 480 $PY -c 'import sys, pytest; sys.exit(pytest.main(["-m", "gpu", "-q", "-p",
        "no:cacheprovider", "-o", "faulthandler_timeout=120", "--durations=8",
        *open(sys.argv[1]).read().splitlines()]))' "$OUT/ids$g.txt" &
  done
  wait
  [[ ${SUITE_ONLY:-0} == 1 ]] && { tar czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")"; cat "$SUMMARY"; exit 0; }
  step 0,1 gpu_tests_2gpu 130 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_parallel_gpu.py \
      tests/test_lockstep.py
  ( step 0 load_8b 140 $PY -m graphburst bench serve --backend cupy --model qwen3-8b --http --rates 4,16 \
        --duration 6 --burst 32 --json "$OUT/load_qwen3_8b.json" ) &
  ( step 1 serve_stubs 30 $PY -m graphburst bench serve --backend cupy --json "$OUT/serve_stubs.json"
    load_8k 45 6
    step 1 load_1b_ngram 50 $PY -m graphburst bench serve --backend cupy --model 1b --draft ngram --http \
        --rates 32,128 --duration 6 --burst 64 --json "$OUT/load_1b_ngram.json" ) &
  wait
  tar czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")" ;;
tests)
  split_suite
  ( step 0 gpu_tests0 420 $PY -m pytest -m gpu -q -p no:cacheprovider $(cat "$OUT/half0.txt")
    step 0 gemv_1b 130 $PY scripts/gemv_bench.py --shapes 1b --m 1 5 16 --sweep-m 1 5 --json "$OUT/gemv_1b.json" ) &
  ( step 1 gpu_tests1 420 $PY -m pytest -m gpu -q -p no:cacheprovider $(cat "$OUT/half1.txt")
    step 1 profile_b1 130 $PY scripts/profile_forward.py --trials 15 --profile-calls 5 --top 12 --shape 1b 8b \
        --batch 1 --capacity 1024 --valid 512 --t 1 5 --kernels auto cublas --json "$OUT/pf_b1_kernels.json" ) &
  wait
  grep '^summary:' "$OUT/profile_b1.log" >> "$SUMMARY" ;;
bench)
  ( step 0 new_gpu_tests 150 $PY -m pytest -m gpu -v -p no:cacheprovider -o faulthandler_timeout=60 \
        --durations=15 tests/test_admission.py tests/test_chunked_prefill.py tests/test_chunked_prefill_torch.py \
        tests/test_capacity.py tests/test_compile_probe.py
    for m in 1b; do
      step 0 "real_$m" 170 $PY -m graphburst bench real --models "$m" --batches 1,16 \
          --engines vllm,graphburst,compile --accepts 0.8 --no-m-sweep --no-plot --compile-timeout 75 \
          --json "$OUT/real_$m.json"
      $PY scripts/real_summary.py "$OUT/real_$m.json" >> "$SUMMARY" 2>&1
    done
    step 0 load_8b 190 $PY -m graphburst bench serve --backend cupy --model qwen3-8b --http --rates 4,8,16 \
        --duration 8 --burst 32 --json "$OUT/load_qwen3_8b.json" --plot "$OUT/load_qwen3_8b.png" ) &
  ( step 1 serve_stubs 80 $PY -m graphburst bench serve --backend cupy --json "$OUT/serve_stubs.json"
    step 1 load_1b 130 $PY -m graphburst bench serve --backend cupy --model 1b --http --rates 16,64,128 \
        --duration 8 --burst 64 --json "$OUT/load_1b.json" --plot "$OUT/load_1b.png"
    load_8k 100 8
    step 1 load_1b_ngram 100 $PY -m graphburst bench serve --backend cupy --model 1b --draft ngram --http \
        --rates 32,128 --duration 8 --burst 64 --json "$OUT/load_1b_ngram.json" ) &
  wait ;;
multi)
  step 0,1 gpu_tests_2gpu 200 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_parallel_gpu.py \
      tests/test_lockstep.py
  QUICK=1 timeout -k 5 280 bash scripts/multigpu_check.sh "$OUT/mg" 260 > "$OUT/multigpu.log" 2>&1
  echo "multigpu_check: rc=$?; $(tail -n 1 "$OUT/mg/summary.txt" 2>/dev/null)" >> "$SUMMARY" ;;
*)
  echo "x2_batch.sh: unknown phase $PHASE (tests, bench or multi)" >&2; exit 2 ;;
esac
cat "$SUMMARY"
