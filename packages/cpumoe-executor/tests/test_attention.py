"""CpuMoeExecutor.attention_raw: cpumoe_formats' decode attention on the executor's threads (its pool, its OpenMP
team), every tier forced in turn. The query tokens x kv heads are work items the threads claim, and a result depends
only on its token and head, so every team size and kind gives the single-threaded kernel's bits
(cpumoe_formats.DecodeAttention at the same tier), which test_attention.py of cpumoe-formats holds against float64.
Also: concurrent callers, bad sizes, a closed executor."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import bits, executor_for, run_concurrently, workers

import cpumoe_formats as cf
from cpumoe_formats.attention import KERNEL_TIERS, expected_tier
from cpumoe_formats.numerics import BF16

TIERS = [t for t in KERNEL_TIERS if t in cf.usable_tiers()]
# (n, Hq, Hkv, D, L): Qwen3-30B-A3B's heads at a short and a long cache, ragged sizes, more tokens than threads
SHAPES = [(1, 32, 4, 128, 34), (2, 32, 4, 128, 700), (3, 6, 3, 17, 9), (5, 4, 1, 64, 40)]


def _problem(rng, n, Hq, Hkv, D, L):
    q = rng.standard_normal((n, Hq, D)).astype(BF16)
    k = rng.standard_normal((Hkv, L, D)).astype(BF16)
    v = rng.standard_normal((Hkv, L, D)).astype(BF16)
    mask = rng.random((n, L)) < 0.8
    mask[:, 0] = True
    return q, k, v, mask


def _run(ex, q, k, v, mask, scale=0.1):
    n, Hq, D = q.shape
    Hkv, L, _ = k.shape
    o = np.zeros((n, Hq, D), BF16)
    ex.attention_raw(n, Hq // Hkv, D, L, Hkv, q.ctypes.data, Hq * D, D, k.ctypes.data, L * D, D, v.ctypes.data,
                     L * D, D, mask.ctypes.data, L, scale, o.ctypes.data, Hq * D, D)
    return o


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("team", ["pool", "openmp"])
def test_bits_equal_the_single_threaded_kernel(rng, tier, team):
    if team == "openmp":
        pytest.importorskip("torch")  # brings libgomp into the process
    kernel = cf.DecodeAttention(isa=tier)
    for threads in (1, 2, 3):
        ex, _, _ = executor_for("bf16", rng, isa=tier, team=team, **workers(threads))
        with ex:
            assert ex.attention_isa == expected_tier(tier) == kernel.name
            ex.set_team_unit(1)  # every thread at every size
            for shape in SHAPES:
                q, k, v, mask = _problem(rng, *shape)
                want = kernel.forward(q, k, v, mask, 0.1)
                assert np.array_equal(bits(_run(ex, q, k, v, mask)), bits(want)), (threads, shape)


def test_concurrent_callers_each_get_their_own_result(rng):
    ex, _, _ = executor_for("bf16", rng, threads=2)
    kernel = cf.DecodeAttention()
    jobs = [_problem(rng, 1 + i % 3, 8, 2, 32, 20 + 9 * i) for i in range(6)]
    want = [kernel.forward(*j, 0.1) for j in jobs]

    def check(i):
        assert np.array_equal(bits(_run(ex, *jobs[i])), bits(want[i]))

    run_concurrently(ex, check, len(jobs))


def test_bad_sizes_and_a_closed_executor(rng):
    ex, _, _ = executor_for("bf16", rng, threads=2)
    q, k, v, mask = _problem(rng, 1, 8, 2, 32, 10)
    o = np.zeros_like(q)
    with pytest.raises(ValueError, match="n=0, group=4, D=32, L=10, Hkv=2: each must be >= 1"):
        ex.attention_raw(0, 4, 32, 10, 2, q.ctypes.data, 256, 32, k.ctypes.data, 320, 32, v.ctypes.data, 320, 32, 0,
                         0, 0.1, o.ctypes.data, 256, 32)
    with pytest.raises(ValueError, match="strides must be >= 0"):
        ex.attention_raw(1, 4, 32, 10, 2, q.ctypes.data, 256, -32, k.ctypes.data, 320, 32, v.ctypes.data, 320, 32,
                         0, 0, 0.1, o.ctypes.data, 256, 32)
    with pytest.raises(ValueError, match="must not be null"):
        ex.attention_raw(1, 4, 32, 10, 2, 0, 256, 32, k.ctypes.data, 320, 32, v.ctypes.data, 320, 32, 0, 0, 0.1,
                         o.ctypes.data, 256, 32)
    ex.close()
    assert ex.attention_isa  # readable after close()
    with pytest.raises(RuntimeError, match="closed"):
        _run(ex, q, k, v, mask)
