"""The down row block reduction (csrc/route_sum.cpp), each SIMD width forced in turn: a token's route terms summed
left to right in fp32 and rounded to bf16, bit for bit against numpy, on ragged row ranges, with special values,
and nothing written outside the range."""
import logging

import ml_dtypes
import numpy as np
import pytest
from conftest import make_banks
from hypothesis import given, settings
from hypothesis import strategies as st

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native

ISAS = ["avx512f", "avx2", "sse2"]
POISON = 0xDEAD


def usable(isa: str) -> bool:
    t = np.ones((1, 16), np.float32)
    y = np.zeros(16, np.uint16)
    try:
        _native.route_sum([t.ctypes.data], 0, 16, y.ctypes.data, isa)
    except ValueError:
        return False
    return True


def want_bits(t: np.ndarray, h0: int, h1: int) -> np.ndarray:
    """fp32 adds in route order, then cpumoe_f32_to_bf16 (RNE; NaN -> quiet NaN with its sign). Which NaN an add of
    two NaNs (or inf - inf's default NaN) returns depends on the operand order the hardware sees, which numpy does
    not promise: check() compares NaN lanes as "a quiet bf16 NaN" only."""
    v = t[0, h0:h1].copy()
    with np.errstate(all="ignore"):
        for q in range(1, len(t)):
            v = (v + t[q, h0:h1]).astype(np.float32)
    u = v.view(np.uint32).astype(np.uint64)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (u >> 16) | 0x40, rne).astype(np.uint16)
    # independent check of the non-NaN lanes: ml_dtypes' float32 -> bf16 rounding
    ok = ~nan
    np.testing.assert_array_equal(out[ok], v[ok].astype(ml_dtypes.bfloat16).view(np.uint16))
    return out


def check(got: np.ndarray, want: np.ndarray, msg: str = "") -> None:
    nan = (want & 0x7FFF) > 0x7F80
    np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=msg)
    assert ((got[nan] & 0x7FC0) == 0x7FC0).all(), f"{msg}: NaN lanes not quiet bf16 NaNs"


def run(t: np.ndarray, h0: int, h1: int, isa: str) -> np.ndarray:
    y = np.full(t.shape[1] + 8, POISON, np.uint16)  # poison, and 8 past the row
    _native.route_sum([t[q].ctypes.data for q in range(len(t))], h0, h1, y.ctypes.data, isa)
    assert (y[:h0] == POISON).all() and (y[h1:] == POISON).all(), "written outside [h0, h1)"
    return y[h0:h1]


def specials(rng, n: int, H: int) -> np.ndarray:
    t = (rng.standard_normal((n, H)) * rng.choice([1e-3, 1.0, 1e3], (n, H))).astype(np.float32)
    edge = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.0e38, -3.0e38, 1e-45, -1e-40,
                     1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8)], np.float32)  # bf16 ties both ways
    m = rng.random((n, H)) < 0.1
    t[m] = rng.choice(edge, m.sum())
    # a quiet NaN with a payload and a signalling NaN: the sign is kept, the result quiet
    t[0, :2] = np.array([0x7FC12345, 0xFF812345], np.uint32).view(np.float32)[:H]
    return t


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1, 2, 4, 8, 9, 64])
def test_route_sum_bits(isa, n, rng):
    if not usable(isa):
        pytest.skip(f"{isa}: not on this CPU")
    H = 272
    t = specials(rng, n, H)
    for h0, h1 in [(0, H), (16, 144), (3, 3), (5, 6), (7, 250), (0, 15), (17, 271)]:
        check(run(t, h0, h1, isa), want_bits(t, h0, h1), f"{isa} n={n} [{h0},{h1})")


def test_route_sum_default_and_errors(rng):
    assert _native.route_sum_isa() in ISAS and usable(_native.route_sum_isa())
    t = specials(rng, 3, 64)
    check(run(t, 0, 64, ""), want_bits(t, 0, 64))
    y = np.zeros(64, np.uint16)
    with pytest.raises(ValueError, match="isa 'avx9'"):
        _native.route_sum([t[0].ctypes.data], 0, 64, y.ctypes.data, "avx9")
    with pytest.raises(ValueError, match="terms: 1 to 64 rows, got 0"):
        _native.route_sum([], 0, 64, y.ctypes.data, "")
    with pytest.raises(ValueError, match="terms: 1 to 64 rows, got 65"):
        _native.route_sum([t[0].ctypes.data] * 65, 0, 64, y.ctypes.data, "")
    with pytest.raises(ValueError, match="h0 <= h1"):
        _native.route_sum([t[0].ctypes.data], 8, 4, y.ctypes.data, "")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 16), H=st.integers(1, 100), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_route_sum_property(n, H, data, seed):
    h0 = data.draw(st.integers(0, H))
    h1 = data.draw(st.integers(h0, H))
    t = specials(np.random.default_rng(seed), n, H)
    for isa in ISAS:
        if usable(isa):
            check(run(t, h0, h1, isa), want_bits(t, h0, h1), isa)


def test_top_k_limit_is_the_formats_one():
    """The reduction keeps a token's term pointers on the stack, sized by the executor's limit: the same as the one the
    Python API checks (cpumoe_formats.inputs.MAX_TOP_K), and the native constructor refuses what lies past it."""
    from cpumoe_formats.inputs import MAX_TOP_K

    assert _native.MAX_TOP_K == MAX_TOP_K == 64
    cores = [ce.resolve_cores()[0][0]]
    for bad in (0, MAX_TOP_K + 1):
        with pytest.raises(ValueError, match=f"top_k {bad} outside \\[1, 64\\]"):
            _native.Executor(0, 0, 0, False, 4, 64, 32, 1.0, float("inf"), -1, 1, bad, 1, cores, False, 0, "x")


def test_ready_log_names_route_sum(caplog, rng):
    banks, _ = make_banks("bf16", rng, layers=1)
    with caplog.at_level(logging.INFO, logger="cpumoe_executor"):
        ce.CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=2, threads=1)
    assert f"route_sum={_native.route_sum_isa()}" in caplog.text
    # the kernels' cap is the reduction's: one detection (cpumoe-formats' tier) and one cap decide every width
    capped = ce.CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=2, threads=1, isa="scalar")
    assert capped._x.route_sum_isa == "sse2"
    if "avx2" in cf.usable_tiers():
        assert ce.CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=2, threads=1, isa="avx2")._x.route_sum_isa == "avx2"
