"""CpuMoeExecutor.linear: cpumoe_formats' dense bf16 linear on the executor's threads (its pool, its OpenMP team, a
NUMA plan's first group), every tier forced in turn. The rows are split in blocks the threads claim, and a result
depends only on its row and token, so every team size, team kind and claim order gives the single-threaded
kernel's bits (cpumoe_formats.Linear at the same tier), which test_linear.py of cpumoe-formats holds against
float64. Also: torch tensors in place ([..., K]), numpy, float32 out, concurrent callers, bad input, a closed
executor."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import bits, executor_for, run_concurrently, two_real_nodes, workers

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_formats.linear import KERNEL_TIERS, expected_tier
from cpumoe_formats.numerics import BF16

TIERS = [t for t in KERNEL_TIERS if t in cf.usable_tiers()]
SHAPES = [(1, 1), (37, 259), (130, 33), (511, 64), (4096, 96)]


def _data(rng, n, M, K):
    return (rng.standard_normal((n, K)).astype(BF16), rng.standard_normal((M, K)).astype(BF16),
            rng.standard_normal(M).astype(BF16))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("team", ["pool", "openmp"])
def test_bits_equal_the_single_threaded_kernel(rng, tier, team):
    if team == "openmp":
        pytest.importorskip("torch")  # brings libgomp into the process
    kernel = cf.Linear(isa=tier)
    for threads in (1, 2, 3):
        ex, _, _ = executor_for("bf16", rng, isa=tier, team=team, **workers(threads))
        with ex:
            assert ex.linear_isa == expected_tier(tier) == kernel.name
            for M, K in SHAPES:
                for n in (1, 2, 3, 5, 8):
                    x, w, b = _data(rng, n, M, K)
                    want = kernel.forward(x, w, b)
                    assert np.array_equal(bits(ex.linear(x, w, b)), bits(want)), (threads, M, K, n)
                    out = np.zeros((n, M), np.float32)
                    assert ex.linear(x, w, out=out) is out
                    assert np.array_equal(out.view(np.uint32), kernel.forward(x, w, out_dtype="float32")
                                          .view(np.uint32))


def test_team_unit_and_small_matrices_keep_the_bits(rng):
    """A matrix below the team unit runs on the caller alone; one of a few rows on fewer blocks than threads."""
    ex, _, _ = executor_for("bf16", rng, threads=2)
    kernel = cf.Linear()
    with ex:
        for unit in (0, 1 << 30):
            ex.set_team_unit(unit)
            for M, K in ((3, 5), (16, 700), (300, 200)):
                x, w, b = _data(rng, 2, M, K)
                assert np.array_equal(bits(ex.linear(x, w, b)), bits(kernel.forward(x, w, b)))


def test_torch_tensors_are_read_in_place(rng):
    torch = pytest.importorskip("torch")
    ex, _, _ = executor_for("bf16", rng, threads=2, team="openmp")
    kernel = cf.Linear()
    with ex:
        x, w, b = _data(rng, 6, 70, 130)
        xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        wt = torch.nn.Parameter(torch.from_numpy(w.view(np.int16)).view(torch.bfloat16), requires_grad=False)
        bt = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
        y = ex.linear(xt.view(2, 3, 130), wt, bt)  # [..., K] -> [..., M]
        assert type(y) is torch.Tensor and y.shape == (2, 3, 70) and y.dtype == torch.bfloat16
        assert np.array_equal(y.reshape(6, 70).view(torch.int16).numpy().view(np.uint16), bits(kernel.forward(x, w, b)))
        # a row-strided x and a weight that is a slice of a wider matrix
        wide = torch.zeros(70, 200, dtype=torch.bfloat16)
        wide[:, 10:140] = wt
        xs = torch.zeros(6, 150, dtype=torch.bfloat16)
        xs[:, :130] = xt
        y2 = ex.linear(xs[:, :130], wide[:, 10:140], bt)
        assert torch.equal(y2.view(torch.int16), y.reshape(6, 70).view(torch.int16))
        # a non-contiguous [..., K] x goes through the general path (a copy), same bits
        xt3 = xs[:, :130].view(2, 3, 130)
        assert torch.equal(ex.linear(xt3, wt, bt).view(torch.int16), y.view(torch.int16))


def test_first_group_of_a_numa_plan_runs_it(rng, tmp_path):
    root = two_real_nodes(tmp_path)
    banks = [cf.get_format("bf16").random_banks(4, 64, 32, rng)]
    with ce.CpuMoeExecutor("bf16", banks, top_k=2, sysfs_root=root, numa="replicate", threads=2) as ex:
        x, w, b = _data(rng, 3, 90, 77)
        assert np.array_equal(bits(ex.linear(x, w, b)), bits(cf.Linear().forward(x, w, b)))


def test_concurrent_callers_each_get_their_own_result(rng):
    ex, _, _ = executor_for("bf16", rng, threads=2)
    kernel = cf.Linear()
    jobs = [_data(rng, 1 + i % 3, 200 + 7 * i, 96 + i) for i in range(6)]
    want = [kernel.forward(*j) for j in jobs]

    def check(i):
        assert np.array_equal(bits(ex.linear(*jobs[i])), bits(want[i]))

    run_concurrently(ex, check, len(jobs))


def test_bad_input_and_a_closed_executor(rng):
    ex, _, _ = executor_for("bf16", rng, threads=2)
    x, w, b = _data(rng, 2, 8, 16)
    with pytest.raises(ValueError, match=r"x: shape \(2, 15\).*expected \[n, 16\]"):
        ex.linear(x[:, :15], w)
    with pytest.raises(ValueError, match=r"x: shape \(0, 16\).*n >= 1"):
        ex.linear(x[:0], w)
    with pytest.raises(ValueError, match="x: .*float32.*expected bfloat16"):
        ex.linear(x.astype(np.float32), w)
    with pytest.raises(ValueError, match="weight: .*bfloat16 matrix"):
        ex.linear(x, w.astype(np.float32))
    with pytest.raises(ValueError, match="bias"):
        ex.linear(x, w, b[:3])
    with pytest.raises(ValueError, match="out"):
        ex.linear(x, w, out=np.zeros((2, 9), BF16))
    with pytest.raises(ValueError, match="M=0, K=16, n=1: each must be >= 1"):
        ex._x.linear(w.ctypes.data, 32, 0, 16, 1, x.ctypes.data, 32, 0, x.ctypes.data, 0, False)
    with pytest.raises(ValueError, match="a row stride is shorter than its row"):
        ex._x.linear(w.ctypes.data, 30, 8, 16, 1, x.ctypes.data, 32, 0, x.ctypes.data, 16, False)
    ex.close()
    with pytest.raises(RuntimeError, match="closed"):
        ex.linear(x, w)
