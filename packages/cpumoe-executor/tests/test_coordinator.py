"""The doorbell protocol without a GPU: a plain CPU thread plays the GPU's part
(done = 0, ready = task, wait done >= 1, every wait bounded)."""
import threading
import time

import numpy as np
import pytest
from conftest import bits, make_banks, reference, routing

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native

TIMEOUT = 10.0


def task(layer, T):
    return layer << 32 | T


@pytest.fixture
def setup(rng):
    banks, (E, H, I) = make_banks("bf16", rng, layers=3)
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=3, max_tokens=8)
    ex.start_coordinator()
    yield ex, banks, (E, H, I)
    ex.stop_coordinator()


def ring(ex, t):
    iob = ex.io_block()
    assert _native.play_gpu(iob["ready"], iob["done"], t, TIMEOUT), "doorbell not answered (hang)"


def publish(ex, rng, T, E, H, K, skip_all=False):
    a = ex.io_arrays()
    x = rng.standard_normal((T, H)).astype(np.float32).astype(cf.numerics.BF16)
    w, ids = routing(rng, T, K, E)
    if skip_all:
        ids[...] = -1
    a["x"][:T], a["ids"][:T], a["w"][:T] = x, ids, w
    a["y"][:T].view(np.uint16)[...] = 0x7FC1  # poison
    return x, w, ids


def test_io_block_layout(setup):
    ex, _, (E, H, I) = setup
    iob = ex.io_block()
    assert iob["version"] == ce.PROTOCOL_VERSION == 1
    assert iob["base"] % 4096 == 0
    for name in ("x", "ids", "w", "y"):
        assert iob[name] % 64 == 0
    assert _native.load_u64(iob["base"]) == _native.IOB_MAGIC
    assert (iob["ready"], iob["done"], iob["error"]) == (iob["base"] + 128, iob["base"] + 192, iob["base"] + 256)


def test_ring_serves_the_task(setup, rng):
    ex, banks, (E, H, I) = setup
    for layer, T in ((0, 1), (2, 3), (1, 8)):
        x, w, ids = publish(ex, rng, T, E, H, 3)
        ring(ex, task(layer, T))
        want = reference(ex, banks, layer, x, w, ids)
        np.testing.assert_array_equal(bits(ex.io_arrays()["y"][:T]), bits(want))
    h = ex.health()
    assert h["served"] == 3 and h["ready"] == 0 and h["done"] == 1 and h["error"] == 0
    ex.raise_if_unhealthy()


def test_skip_zeroes_y_without_waking_the_pool(setup, rng):
    ex, _, (E, H, I) = setup
    publish(ex, rng, 4, E, H, 3, skip_all=True)
    runs = ex._x.pool_runs
    ring(ex, task(1, 4))
    assert not bits(ex.io_arrays()["y"][:4]).any()
    assert ex._x.pool_runs == runs and ex.health()["served"] == 1


def test_bad_ids_set_the_error_word(setup, rng):
    ex, _, (E, H, I) = setup
    publish(ex, rng, 2, E, H, 3)
    ex.io_arrays()["ids"][1, 2] = E + 3
    ring(ex, task(0, 2))  # done is still written: the stream is released
    h = ex.health()
    assert h["error"] == 1 and f"topk_ids[1, 2] = {E + 3}" in h["error_message"]
    with pytest.raises(RuntimeError, match="error code 1"):
        ex.raise_if_unhealthy()
    ring(ex, task(7, 2))  # a bad layer: the first error sticks until cleared
    assert ex.health()["error"] == 1
    ex.clear_error()
    ring(ex, task(7, 2))
    assert ex.health()["error"] == 2 and "layer 7" in ex.health()["error_message"]
    ex.clear_error()
    ring(ex, task(0, 9))  # num_tokens > max_tokens
    assert ex.health()["error"] == 3
    ex.clear_error()


def test_ten_thousand_rings_with_fresh_inputs(rng):
    banks, (E, H, I) = make_banks("bf16", rng, layers=2, E=4)
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=4)
    ex.start_coordinator()
    try:
        kern = [cf.Kernel("bf16", E, H, I).bind(b) for b in banks]
        a = ex.io_arrays()
        want = cf.aligned_empty((4, H), cf.numerics.BF16)
        n = 10_000
        for i in range(n):
            T, layer = 1 + i % 4, i % 2
            x, w, ids = publish(ex, rng, T, E, H, 2, skip_all=(i % 97 == 0))
            ring(ex, task(layer, T))
            kern[layer](x, w, ids, want[:T])
            assert (bits(a["y"][:T]) == bits(want[:T])).all(), f"ring {i} lost or stale"
        assert ex.health()["served"] == n and ex.health()["error"] == 0
    finally:
        ex.stop_coordinator()


def test_shutdown_releases_a_waiter(rng):
    banks, _ = make_banks("bf16", rng)
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=2)
    ex.start_coordinator()
    iob = ex.io_block()
    _native.store_u64(iob["done"], 0)  # a waiter whose task will never be served
    arg = ex.hostfn_arg(0, 1)
    t = threading.Thread(target=_native.call_hostfn, args=(arg, False))
    t.start()
    time.sleep(0.05)
    assert t.is_alive()
    ex.stop_coordinator()
    t.join(TIMEOUT)
    assert not t.is_alive() and _native.load_u64(iob["done"]) >= 1


def test_host_function_entry_points(rng):
    banks, (E, H, I) = make_banks("bf16", rng)
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=3, max_tokens=4)
    arg = ex.hostfn_arg(1, 2)
    assert arg == ex.hostfn_arg(1, 2), "one stable argument per (layer, num_tokens)"
    with pytest.raises(ValueError, match="num_tokens=5"):
        ex.hostfn_arg(0, 5)
    for coordinated in (False, True):
        if coordinated:
            ex.start_coordinator()
        x, w, ids = publish(ex, rng, 2, E, H, 3)
        _native.call_hostfn(arg, True)
        _native.call_hostfn(arg, False)
        want = reference(ex, banks, 1, x, w, ids)
        np.testing.assert_array_equal(bits(ex.io_arrays()["y"][:2]), bits(want))
    ex.stop_coordinator()


def test_idle_coordinator_does_not_burn_a_core(setup, rng):
    ex, _, (E, H, I) = setup
    publish(ex, rng, 1, E, H, 3)
    ring(ex, task(0, 1))
    time.sleep(0.1)  # past the 50 ms spin window
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(0.5)
    busy = (time.process_time() - c0) / (time.perf_counter() - t0)
    assert busy < 0.3, f"idle executor used {busy:.0%} of a core"
    ring(ex, task(0, 1))  # and it still answers after dozing


def test_health_reports_progress(setup, rng):
    ex, _, (E, H, I) = setup
    assert ex.health()["coordinator_running"] and ex.health()["busy_s"] == 0.0
    publish(ex, rng, 1, E, H, 3)
    s0 = ex.health()["service_s"]
    t0 = time.perf_counter()
    for _ in range(5):
        ring(ex, task(0, 1))
    wall = time.perf_counter() - t0
    h = ex.health()
    assert h["served"] == 5
    # each doorbell's service time is counted, and it is part of the ringer's wall time
    assert 0 < h["service_s"] - s0 <= wall, (h["service_s"] - s0, wall)
