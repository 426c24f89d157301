#!/usr/bin/env bash
# The decode kernels on the H200 (issue 20): forward profiles against the bytes floor (each checks the
# fused forward against SDPA first), the GPU tests, the compile engine.
#   bash scripts/forward_h200.sh OUT [quick]
# quick: the headline configs and the fast tests only (one short lease call). Each step is bounded.
set -u
OUT=${1:?OUT dir}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
Q=${2:-}
pf() { local s=$1; shift; timeout "$s" python3 scripts/profile_forward.py --trials 15 "$@" 2>&1 | tee -a "$OUT/records.jsonl" | grep -v '^{' ; }
pf 60 --shape 1b --batch 1 --capacity 1024 16384 --valid 512 --kernels auto off --json "$OUT/pf_1b_b1.json"
pf 30 --no-profile --shape 1b --batch 64 --capacity 1024 4096 16384 --valid 512 --t 5 --kernels auto \
    --json "$OUT/pf_1b_b64.json"
pf 30 --no-profile --shape 8b --batch 1 --capacity 1024 --valid 512 --t 5 1 --kernels auto off --json "$OUT/pf_8b_b1.json"
timeout 60 python3 -m pytest -m gpu -q --tb=line -p no:cacheprovider \
    tests/test_decode_kernels_gpu.py::test_fused_kernels tests/test_decode_kernels_gpu.py::test_fused_forward_in_a_graph \
    "tests/test_decode_kernels_gpu.py::test_fused_forward_matches_sdpa" tests/test_decode_kernels_gpu.py::test_attention_every_case \
    2>&1 | tail -8
[ "$Q" = quick ] && exit 0
pf 300 --shape 1b --batch 1 64 --capacity 1024 4096 16384 --valid 512 --kernels auto off --json "$OUT/pf_1b_sweep.json"
timeout 300 python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider tests/test_llama_hf.py tests/test_compile_probe.py \
    tests/test_torch_adapter.py tests/test_serve_models.py 2>&1 | tail -8
