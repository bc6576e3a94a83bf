"""Threads and lifetimes (docs/formats.md "Contracts"), for every registered format and mode: one Kernel, its bound
step and moe_forward hammered from several threads give the single-thread results bit for bit; an `out` in use by a
call in flight raises; close() / `with` free a kernel and later calls raise naming it, while a call in flight
finishes; a create/close loop is flat in memory and threads; every public object states its thread contract."""
from __future__ import annotations

import inspect
import os
import threading
import time

import numpy as np
import pytest
from robustness_helpers import SESSION_SEED, E, H, I, bits, format_params, problem, x_bf16

import cpumoe_formats as cf
from cpumoe_formats.numerics import BF16

THREADS, ROUNDS = 4, 6


def mode_params():
    return [pytest.param(f, m, id=f"{f}-{m}") for f, s in cf.FORMATS.items() for m in s.modes]


def inputs(fmt: str, n: int, seed: int):
    """n steps of 1-8 tokens with fresh x and routes (bf16 x, int32 ids, float32 weights)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(1, 9))
        ids = rng.integers(-1, E, (t, 2)).astype(np.int32)
        out.append((x_bf16(rng.standard_normal((t, H))), (rng.random((t, 2), dtype=np.float32) + 0.1), ids))
    return out


@pytest.mark.parametrize("fmt,mode", mode_params())
def test_shared_kernel_threads_match_single_thread(fmt, mode):
    """THREADS threads share one Kernel through forward(), its bound step and moe_forward at once, each with its own
    inputs: every result equals the single-thread one bit for bit (the kernel's one scratch buffer was shared and
    resized under the threads: wrong rows, or 'double free or corruption')."""
    print(f"CPUMOE_TEST_SEED={SESSION_SEED}")
    banks = problem(fmt)[0]
    k = cf.Kernel(fmt, E, H, I, mode=mode)
    step = k.bind(banks)
    work = [inputs(fmt, 8, SESSION_SEED + 100 * j) for j in range(THREADS)]
    want = [[bits(k.forward(banks, *a)).copy() for a in w] for w in work]
    start, errors = threading.Barrier(THREADS), []

    def run(j):
        try:
            start.wait()
            for r in range(ROUNDS):
                for i, (x, w, ids) in enumerate(work[j]):
                    how = (i + j + r) % 3
                    if how == 0:
                        y = k.forward(banks, x, w, ids)
                    elif how == 1:
                        y = step(x, w, ids, np.empty((len(x), H), BF16))
                    else:
                        y = cf.moe_forward(fmt, banks, x, w, ids, mode=mode)
                    if not np.array_equal(bits(y), want[j][i]):
                        errors.append(f"thread {j} round {r} input {i} (via {('forward', 'step', 'moe_forward')[how]})")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {j}: {e!r}")

    ts = [threading.Thread(target=run, args=(j,)) for j in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a thread hung"
    assert not errors, errors[:5]


def _long_call(fmt="bf16"):
    """A kernel, banks and inputs whose step takes ~10-100 ms (scalar tier, 64 tokens), to have a call in flight."""
    Hb, Ib = 512, 512
    banks = cf.get_format(fmt).random_banks(4, Hb, Ib, np.random.default_rng(SESSION_SEED))
    rng = np.random.default_rng(SESSION_SEED + 1)
    x = x_bf16(rng.standard_normal((64, Hb)))
    w = rng.random((64, 2), dtype=np.float32)
    ids = rng.integers(0, 4, (64, 2)).astype(np.int32)
    return cf.Kernel(fmt, 4, Hb, Ib, isa="scalar"), banks, x, w, ids


def _in_flight(k, banks, x, w, ids, out, stop, seen):
    def loop():
        while not stop.is_set():
            try:
                k.forward(banks, x, w, ids, out=out)
                seen.append("ok")
            except RuntimeError as e:
                seen.append(str(e))

    t = threading.Thread(target=loop)
    t.start()
    return t


def test_out_in_use_by_a_call_in_flight_raises():
    """A second call writing an `out` that a call in flight writes, or reading it as x, raises RuntimeError naming
    it (the two calls would race on the memory); a separate out works meanwhile."""
    k, banks, x, w, ids = _long_call()
    out = cf.aligned_empty((64, 512), BF16)
    stop, seen = threading.Event(), []
    t = _in_flight(k, banks, x, w, ids, out, stop, seen)
    try:
        msgs, deadline = set(), time.monotonic() + 20
        while len(msgs) < 2 and time.monotonic() < deadline:
            for kwargs in ({"out": out[:8]}, {"x": out[:8]}):
                a = {"x": x[:8], "out": None, **kwargs}
                try:
                    k.forward(banks, a["x"], w[:8], ids[:8], out=a["out"])
                except RuntimeError as e:
                    msgs.add(str(e).split(" overlaps")[0])
        own = k.forward(banks, x[:8], w[:8], ids[:8], out=np.empty((8, 512), BF16))
    finally:
        stop.set()
        t.join(60)
    assert msgs == {"out", "an input"}, msgs
    assert np.array_equal(bits(own), bits(k.forward(banks, x[:8], w[:8], ids[:8])))
    assert all(s == "ok" or "overlaps" in s for s in seen), seen[:3]


@pytest.mark.parametrize("fmt", format_params())
def test_close_and_with(fmt):
    """close() frees the kernel; forward, the bound step and a second close after it: RuntimeError naming the
    kernel, or nothing (close is idempotent); `with` closes on exit, also on an exception."""
    banks, x, w, ids = problem(fmt)
    dims = cf.validate_banks(fmt, banks)
    k = cf.Kernel(fmt, *dims)
    step = k.bind(banks)
    y = k.forward(banks, x, w, ids)
    k.close()
    assert k.closed and "closed" in repr(k) and k.name
    with pytest.raises(RuntimeError, match=rf"Kernel\('{fmt}', E={dims[0]}.* is closed"):
        k.forward(banks, x, w, ids)
    with pytest.raises(RuntimeError, match="is closed"):
        step(x_bf16(x), w, ids, np.empty_like(y))
    with pytest.raises(RuntimeError, match="is closed"):
        k._k.moe_step([], 1, 1, 0, 0, 0, 0)
    k.close()
    with pytest.raises(KeyError):
        with cf.Kernel(fmt, *dims) as k2:
            assert np.array_equal(bits(k2.forward(banks, x, w, ids)), bits(y))
            raise KeyError("leaves the with block")
    assert k2.closed


def test_close_while_a_call_is_in_flight():
    """close() on one thread while another is inside forward(): the call finishes with the right result (it holds
    the kernel), the next one raises."""
    k, banks, x, w, ids = _long_call()
    want = bits(k.forward(banks, x, w, ids)).copy()
    got, errors = [], []

    def call():
        try:
            got.append(bits(k.forward(banks, x, w, ids)).copy())
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.005)
    k.close()
    t.join(60)
    assert not errors and len(got) == 1 and np.array_equal(got[0], want)
    with pytest.raises(RuntimeError, match="is closed"):
        k.forward(banks, x, w, ids)


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_create_close_loop_is_flat():
    """2000 kernels created, used and closed: resident memory grows < 4 MB and no thread is left behind."""
    banks, x, w, ids = problem("nvfp4")
    threads = threading.active_count()

    def burst(n):
        for _ in range(n):
            with cf.Kernel("nvfp4", E, H, I, mode="w4a8") as k:
                k.forward(banks, x, w, ids)

    burst(200)  # allocator warm-up
    before = _rss_kb()
    burst(2000)
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # ASan keeps freed memory in quarantine (256 MB)
        assert _rss_kb() - before < 4096, (before, _rss_kb())
    assert threading.active_count() == threads


@pytest.mark.parametrize("fmt", format_params())
def test_bank_views_keep_their_arrays(fmt):
    """FormatSpec.bank_views hands out integer pointers: the list holds the arrays they point into."""
    spec = cf.get_format(fmt)
    arrays, _ = spec.validate(problem(fmt)[0])
    views = spec.bank_views(arrays)
    assert len(views.arrays) == len(arrays) and all(a is b for a, b in zip(views.arrays, arrays))
    assert [v[0] for v in views] == [a.ctypes.data for a in arrays]


def _public_objects():
    out = []
    for name in cf.__all__:
        obj = getattr(cf, name)
        if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
            out.append((name, obj))
    out += [("FormatSpec", cf.schema.FormatSpec), ("reference", cf.reference), ("Kernel.bind", cf.Kernel.bind),
            ("reference.moe", cf.reference.moe), ("reference.dequantize", cf.reference.dequantize)]
    return out


@pytest.mark.parametrize("name,obj", _public_objects(), ids=[n for n, _ in _public_objects()])
def test_public_objects_state_their_thread_contract(name, obj):
    assert "Threads:" in (inspect.getdoc(obj) or ""), f"{name}'s docstring has no 'Threads:' contract"
