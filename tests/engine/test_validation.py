"""Bad input gets a clear error naming the bad value, before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

from graphburst import CapacityError, KVCache, KVLayer, SpecDecoder, StreamBufs, kv_len_ptr_table_range, stub_pair
from graphburst.backend import Backend, get_backend
from graphburst.models.stubs import stub_cache
from graphburst.cli import main


@pytest.mark.parametrize("kw, match", [
    (dict(batch=0, k=1, m_rounds=1), "batch must be >= 1, got 0"),
    (dict(batch=1, k=-1, m_rounds=1), "k must be >= 0, got -1"),
    (dict(batch=1, k=1, m_rounds=0), "m_rounds must be >= 1, got 0"),
    (dict(batch=1, k=65, m_rounds=1), "k must be <= 64, got 65"),
])
def test_sizes_below_one(kw, match):
    with pytest.raises(ValueError, match=match):
        StreamBufs(backend="numpy", **kw)


def test_fresh_buffers_are_idle_with_no_stop_token():
    bufs = StreamBufs(3, 2, 2, backend="numpy")
    assert bufs.budget.tolist() == [0, 0, 0] and bufs.eos.tolist() == [-1, -1, -1]


def test_non_int_size_is_type_error():
    with pytest.raises(TypeError, match="k must be an int, got float 2.0"):
        StreamBufs(1, 2.0, 1, backend="numpy")


def test_vocab_below_two_and_bad_probabilities():
    with pytest.raises(ValueError, match="vocab must be >= 2, got 1"):
        stub_pair(1, 1, 1, 1, 8, backend="numpy")
    with pytest.raises(ValueError, match=r"accept_prob must be in \[0, 1\], got 1.5"):
        stub_pair(1, 5, 1, 1, 8, accept_prob=1.5, backend="numpy")
    with pytest.raises(ValueError, match="at least one KV layer"):
        stub_pair(1, 5, [False, False], 1, 8, backend="numpy")


@pytest.fixture
def dec():
    target, draft = stub_pair(2, 50, [True, False], [True], 32, backend="numpy")
    return SpecDecoder(target, draft, k=3, m_rounds=2)


def test_prompt_tokens_outside_vocab(dec):
    with pytest.raises(ValueError, match=r"prompts\[1\]\[2\] = 50 is outside the vocabulary \[0, 50\)"):
        dec.prefill([[1], [1, 2, 50]])
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\] = -3"):
        dec.prefill([[-3], [1]])


def test_empty_prompt_and_wrong_count(dec):
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a non-empty"):
        dec.prefill([[], [1]])
    with pytest.raises(ValueError, match="one entry per slot"):
        dec.prefill([[1]])


def test_prompt_longer_than_cache_writes_nothing(dec):
    dec.prefill([[1, 2], [3]])
    before = dec.target.cache.lengths(None).copy(), dec.bufs.pend.copy()
    with pytest.raises(CapacityError, match=r"prompts\[1\] of length 40 .* cache holds 32"):
        dec.prefill([[4], [5] * 40])
    np.testing.assert_array_equal(dec.target.cache.lengths(None), before[0])
    np.testing.assert_array_equal(dec.bufs.pend, before[1])


def test_bad_eos_and_limit(dec):
    with pytest.raises(ValueError, match=r"eos\[0\] must be <= 49, got 99"):
        dec.prefill([[1], [2]], eos=99)
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be >= 1, got 0"):
        dec.prefill([[1], [2]], max_new_tokens=[3, 0])


def test_layer_range_outside_cache():
    cache = stub_cache([True, False, True], 2, 8, "numpy")
    with pytest.raises(ValueError, match=r"layer range range\(1, 4\) is outside the caches' 3 layers"):
        kv_len_ptr_table_range(cache, range(1, 4))
    with pytest.raises(TypeError, match="step 1"):
        kv_len_ptr_table_range(cache, range(0, 3, 2))


def test_caller_arrays_wrong_dtype_shape_or_type():
    be = Backend("numpy")
    with pytest.raises(TypeError, match=r"layers\[0\].length must have dtype int32, got int64"):
        KVCache([KVLayer(np.zeros((2, 8), np.int32), np.zeros(2, np.int64))], 2, 8, be)
    with pytest.raises(ValueError, match=r"layers\[0\].length must have shape \(2,\), got \(3,\)"):
        KVCache([KVLayer(np.zeros((2, 8), np.int32), np.zeros(3, np.int32))], 2, 8, be)
    with pytest.raises(TypeError, match=r"layers\[1\] must be a KVLayer or None, got list"):
        KVCache([None, [1]], 2, 8, be)
    cache = stub_cache([True], 2, 8, be)
    with pytest.raises(TypeError, match="pos_ctr must be a numpy.ndarray"):
        kv_len_ptr_table_range(cache, range(1), pos_ctr=[0, 0])


def test_unknown_backend_and_mode(dec):
    with pytest.raises(ValueError, match="backend must be one of"):
        get_backend("tpu")
    dec.prefill([[1], [2]])
    with pytest.raises(ValueError, match="mode must be one of"):
        dec.enqueue_burst(mode="sometimes")
    with pytest.raises(ValueError, match=r"mode must be one of \['per_round_sync', 'pre_issued'\], got 'graph'"):
        dec.enqueue_burst(mode="graph")  # a BurstMode, but not an eager one


def test_one_burst_mode_vocabulary():
    from graphburst import BurstMode
    from graphburst.serving.loop import ServeLoop

    assert BurstMode.parse("per_round_sync") is BurstMode.PER_ROUND_SYNC
    with pytest.raises(ValueError, match="got 'eager_sync'"):  # one spelling per mode
        BurstMode.parse("eager_sync")
    assert BurstMode.parse("gapless") is BurstMode.GAPLESS and f"{BurstMode.GAPLESS}" == "gapless"
    assert [m.eager for m in BurstMode] == [False, False, True, True]
    target, draft = stub_pair(2, 50, 1, 1, 64, backend="numpy")
    for engine in (BurstMode.PER_ROUND_SYNC, "per_round_sync"):
        loop = ServeLoop(target, draft, k=2, m_rounds=2, engine=engine)
        assert loop.engine is BurstMode.PER_ROUND_SYNC and loop.graph is None
        del loop
    with pytest.raises(ValueError, match=r"engine must be one of \['graph', 'per_round_sync'\], got 'gapless'"):
        ServeLoop(target, draft, k=2, m_rounds=2, engine="gapless")


def test_mismatched_pair():
    t, _ = stub_pair(2, 50, 1, 1, 16, backend="numpy")
    _, d = stub_pair(3, 50, 1, 1, 16, backend="numpy")
    with pytest.raises(ValueError, match="target batch 2 != draft batch 3"):
        SpecDecoder(t, d, k=1, m_rounds=1)


@pytest.mark.parametrize("mode", ["pre_issued", "per_round_sync", "graph"])
def test_cli_demo_runs_on_numpy(capsys, mode):
    assert main(["demo", "--backend", "numpy", "--bursts", "2", "--mode", mode]) == 0
    out = capsys.readouterr().out
    assert "numpy reference backend" in out and "yes" in out and "NO" not in out


@pytest.mark.gpu
def test_cupy_array_from_another_device_is_rejected():
    pytest.importorskip("cupy")
    from graphburst.backend import cuda_available

    if not cuda_available():
        pytest.skip("needs cupy and a CUDA device")
    import cupy

    other = Backend("cupy", device_id=cupy.cuda.Device().id + 1)  # a device the array is not on
    with pytest.raises(ValueError, match=r"layers\[0\].length is on CUDA device \d+, but the backend uses device"):
        KVCache([KVLayer(cupy.zeros((2, 8), np.int32), cupy.zeros(2, np.int32))], 2, 8, other)


def test_reused_slot_gets_default_draft_settings():
    t, d = stub_pair(2, 50, 1, 1, 16, accept_prob=0.25, seed=9, backend="numpy")
    d.set_slot(1, accept_prob=1.0, seed=3)
    assert d.agree24.tolist() == [1 << 22, 1 << 24] and d.seed.tolist() == [9, 3]
    d.set_slots({1: (None, None)})
    assert d.agree24.tolist() == [1 << 22, 1 << 22] and d.seed.tolist() == [9, 9]
