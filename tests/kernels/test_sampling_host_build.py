"""The sampling kernels' float primitives, compiled from kernels.cu for the host, against the
numpy twins in sampling_prims.py, bit for bit.

The device functions (Philox, ``gb_exp_neg``, ``gb_neg_log1m``, ``gb_expo``, the order
and race keys) are cut out of kernels.cu as they stand and built with g++ behind a small
shim of the CUDA intrinsics (each ``__f*_rn`` one IEEE float op, no FMA contraction).
Inputs are normal floats, where the device's flush to zero changes nothing, so this pins
the arithmetic without a GPU; tests/kernels/test_sampling_gpu.py pins the rest on the device.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from graphburst.kernels import sampling_prims as sp
from graphburst.kernels.source import kernel_source

CU = kernel_source()  # kernels.cu with its sections inlined
FUNCTIONS = ("gb_philox4x32_10", "gb_exp_neg", "gb_neg_log1m", "gb_expo", "gb_order_key", "gb_key_logit",
             "gb_race_key")

SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
typedef unsigned int u32;
typedef unsigned long long u64;
#define __device__
#define __forceinline__ inline
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline u32 __umulhi(u32 a, u32 b) { return (u32)(((u64)a * b) >> 32); }
static inline float __uint_as_float(u32 x) { float f; std::memcpy(&f, &x, 4); return f; }
static inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
static inline u32 __float_as_uint(float f) { u32 x; std::memcpy(&x, &f, 4); return x; }
static inline float __uint2float_rn(u32 x) { return (float)x; }
"""

MAIN = r"""
static u32 hex32() { unsigned long long x; std::scanf("%llx", &x); return (u32)x; }
static float f32() { return __uint_as_float(hex32()); }

int main() {
    char mode[16];
    while (std::scanf("%15s", mode) == 1) {
        if (!std::strcmp(mode, "expo")) {
            std::printf("%08x\n", __float_as_uint(gb_expo(hex32())));
        } else if (!std::strcmp(mode, "exp")) {
            std::printf("%08x\n", __float_as_uint(gb_exp_neg(f32())));
        } else if (!std::strcmp(mode, "log")) {
            std::printf("%08x\n", __float_as_uint(gb_neg_log1m(f32())));
        } else if (!std::strcmp(mode, "key")) {
            float x = f32();
            u64 k = gb_order_key(x, (int)hex32());
            std::printf("%016llx %08x\n", k, __float_as_uint(gb_key_logit(k)));
        } else if (!std::strcmp(mode, "race")) {
            float r = f32();
            std::printf("%016llx\n", gb_race_key(r, (int)hex32()));
        } else if (!std::strcmp(mode, "philox")) {
            u32 w[4];
            for (int j = 0; j < 4; ++j) w[j] = hex32();
            u32 k0 = hex32(), k1 = hex32();
            gb_philox4x32_10(w, k0, k1);
            std::printf("%08x %08x %08x %08x\n", w[0], w[1], w[2], w[3]);
        }
    }
    return 0;
}
"""


def device_function(name: str) -> str:
    """The source of one ``__device__`` function of kernels.cu, signature to closing brace."""
    m = re.search(rf"^__device__ __forceinline__ \w+ {name}\(.*?^}}\n", CU, re.S | re.M)
    assert m, name
    return m.group(0)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("needs a C++ compiler (g++ or clang++)")
    d = tmp_path_factory.mktemp("host")
    src = d / "prims.cpp"
    src.write_text(SHIM + "".join(device_function(n) for n in FUNCTIONS) + MAIN)
    exe = d / "prims"
    subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-o", str(exe), str(src)], check=True)

    def run(lines):
        out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
        return out.stdout.split("\n")[:-1]

    return run


def f32_bits(x):
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def test_expo_and_log_match_the_twin(host, rng):
    words = np.concatenate([rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32),
                            np.array([0, 1, 2, 0xFFFFFFFF, 0xFFFFFF7F, 0xFFFFFF80, 0x3FFFFFFF, 0x40000000,
                                      0x40000001, 0x80000000, 0xC0000000, 0x00FFFFFF, 0x01000000], np.uint32)])
    got = np.array([int(x, 16) for x in host([f"expo {w:x}" for w in words])], np.uint32)
    np.testing.assert_array_equal(got, f32_bits(sp.expo(words)))
    v = np.concatenate([rng.random(20_000).astype(np.float32), np.float32([2.0**-32, 0.25, np.nextafter(0.25, 0),
                                                                           0.5, 0.75, 1 - 2.0**-24])])
    v = v[v > 0]
    got = np.array([int(x, 16) for x in host([f"log {b:x}" for b in f32_bits(v)])], np.uint32)
    np.testing.assert_array_equal(got, f32_bits(sp.neg_log1m(v)))


def test_exp_neg_matches_the_twin(host, rng):
    x = np.concatenate([-rng.random(20_000).astype(np.float32) * 90, np.float32([0, -0.5, -86.5, -87.3])])
    got = np.array([int(s, 16) for s in host([f"exp {b:x}" for b in f32_bits(x)])], np.uint32)
    np.testing.assert_array_equal(got, f32_bits(sp.exp_neg(x)))


def test_keys_and_philox_match_the_twin(host, rng):
    x = np.concatenate([rng.normal(size=2000).astype(np.float32) * 10, np.float32([0, -0.0, np.inf, -np.inf, 1e-40])])
    idx = rng.integers(0, 2**20, len(x))
    lines = host([f"key {b:x} {i:x}" for b, i in zip(f32_bits(x), idx)])
    keys = np.array([int(ln.split()[0], 16) for ln in lines], np.uint64)
    logit = np.array([int(ln.split()[1], 16) for ln in lines], np.uint32)
    want = np.array([sp.order_key(np.float32([v]))[0] & ~np.uint64(0xFFFFFFFF) for v in x], np.uint64)
    want |= (~idx.astype(np.uint32)).astype(np.uint64)
    ftz_free = np.abs(x) != np.float32(1e-40)  # the host does not flush: a subnormal logit is the device's own case
    np.testing.assert_array_equal(keys[ftz_free], want[ftz_free])
    np.testing.assert_array_equal(logit[ftz_free], f32_bits(sp.key_logit(keys[ftz_free])))
    r = rng.random(2000).astype(np.float32) * 1e3
    got = np.array([int(s, 16) for s in host([f"race {b:x} {i:x}" for b, i in zip(f32_bits(r), idx)])], np.uint64)
    np.testing.assert_array_equal(got, sp.race_key(r, idx[:2000], np.ones(2000, bool)))
    ctr = rng.integers(0, 2**32, (500, 4), dtype=np.uint64).astype(np.uint32)
    key = rng.integers(0, 2**32, (500, 2), dtype=np.uint64).astype(np.uint32)
    lines = host(["philox " + " ".join(f"{w:x}" for w in (*c, *k)) for c, k in zip(ctr, key)])
    got = np.array([[int(w, 16) for w in ln.split()] for ln in lines], np.uint32)
    np.testing.assert_array_equal(got, sp.philox4x32_10(ctr, key))
