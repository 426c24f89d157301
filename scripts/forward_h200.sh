#!/usr/bin/env bash
# The decode kernels on the H200 (issue 20): GPU tests, then the forward profiles against the bytes floor.
#   bash scripts/forward_h200.sh OUT [quick]
# quick: fewer profile configs (one lease call). Each step is bounded so one hang costs only itself.
set -u
OUT=${1:?OUT dir}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
T=${FORWARD_TEST_S:-120}
timeout "$T" python3 -m pytest -m gpu -q -x --tb=short -p no:cacheprovider tests/test_decode_kernels_gpu.py \
    tests/test_llama_hf.py 2>&1 | tail -25
pf() { timeout "${FORWARD_PROFILE_S:-150}" python3 scripts/profile_forward.py --no-profile --trials 15 "$@" 2>&1 \
    | grep -v '^{' ; }
pf --shape 1b --batch 1 --capacity 1024 4096 16384 --valid 512 --kernels auto off --json "$OUT/pf_1b_b1.json"
pf --shape 1b --batch 64 --capacity 1024 4096 16384 --valid 512 --kernels auto --json "$OUT/pf_1b_b64.json"
pf --shape 8b --batch 1 --capacity 1024 --valid 512 --kernels auto off --json "$OUT/pf_8b_b1.json"
timeout 60 python3 scripts/profile_forward.py --shape 1b --batch 1 --capacity 1024 --valid 512 --trials 10 \
    --json "$OUT/pf_1b_kernels.json" 2>&1 | python3 -c "import sys,json
for l in sys.stdin:
    if l.startswith('{'):
        r=json.loads(l); print(r['T'], r['kernels'], 'nongemm/layer', r.get('nongemm_per_layer_us'), 'k/layer', r.get('per_layer')); [print('   ', t) for t in r.get('top', [])]"
[ "${2:-}" = quick ] || timeout "${FORWARD_COMPILE_S:-120}" python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider \
    tests/test_compile_probe.py 2>&1 | tail -5
