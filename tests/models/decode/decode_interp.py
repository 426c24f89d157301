"""Runs the decode kernels' checks under Triton's CPU interpreter (``tests/models/decode/test_decode_kernels.py`` starts it).

``TRITON_INTERPRET=1`` must be set before ``triton.jit`` decorates the kernels, so this
runs in its own process: ``python tests/models/decode/decode_interp.py GROUP`` with GROUP one of
``attention``, ``idle``, ``int64``, ``gemv``, ``fused``, ``model``. Exit status 0 and ``ok N`` on success.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode_cases
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # graphburst

import torch  # noqa: E402

import decode_cases as dc  # noqa: E402


def main(group: str) -> int:
    torch.set_num_threads(1)
    from graphburst.models.decode import attention, fused

    assert attention.INTERPRETED, "TRITON_INTERPRET was not seen by the kernels"
    n = 0
    if group == "attention":
        for i, case in enumerate(dc.CI_ATTENTION):
            dc.check_attention(attention.decode_attention, case, "cpu", seed=i)
            n += 1
    elif group == "idle":
        for i, case in enumerate(dc.CI_IDLE):
            dc.check_attention_idle(attention.decode_attention, case, "cpu", seed=i)
            n += 1
    elif group == "int64":
        dc.check_int64_offsets(attention.decode_attention, fused.rope_kv_write, "cpu")
        n = 1
    elif group == "gemv":
        from graphburst.models.decode import gemv

        for i, case in enumerate(dc.CI_GEMV):
            dc.check_gemv(gemv.gemv, case, "cpu", seed=i)
        n = len(dc.CI_GEMV)
    elif group == "fused":
        for i, case in enumerate(dc.CI_NORM):
            dc.check_add_rmsnorm(fused.add_rmsnorm, case, "cpu", seed=i)
        for i, case in enumerate(dc.CI_ROPE):
            dc.check_rope_kv_write(fused.rope_kv_write, case, "cpu", seed=i)
        for i, case in enumerate(dc.CI_SILU):
            dc.check_silu_mul(fused.silu_mul, case, "cpu", seed=i)
        n = len(dc.CI_NORM) + len(dc.CI_ROPE) + len(dc.CI_SILU)
    elif group == "model":
        dc.check_model("triton", "cpu", torch.float32)
        # Qwen3's q/k norms and the bias switches reach the Triton path too (ts: a verify only, to stay quick)
        dc.check_model("triton", "cpu", torch.float32, ts=(5,), qk_norm=True, qkv_bias=True)
        n = 2
    else:
        raise SystemExit(f"unknown group {group!r}")
    print(f"ok {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
