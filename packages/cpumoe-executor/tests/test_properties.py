"""Property test: random shapes, dtypes, strides, ids and batch sizes thrown at
the Python API. Each call gives the right answer (bit-identical to the
single-threaded kernels) or a clear ValueError/TypeError, never a crash."""
import numpy as np
from conftest import bits, ran_banks, workers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpumoe_executor as ce
import cpumoe_formats as cf

H, I, E = 64, 32, 5  # noqa: E741
_rng = np.random.default_rng(1234)
BANKS = [cf.get_format("bf16").random_banks(E, H, I, _rng) for _ in range(2)]
EX = ce.CpuMoeExecutor("bf16", BANKS, top_k=3, max_tokens=6)
RUN = ran_banks(EX, BANKS)  # the banks of the format that runs (bf16_x16 where bf16 repacks)

X_DTYPES = [np.float32, np.float64, np.float16, cf.numerics.BF16, np.int32, np.uint8]
ID_DTYPES = [np.int32, np.int64, np.int16, np.uint8, np.float32]
W_DTYPES = [np.float32, np.float64, np.float16, cf.numerics.BF16, np.int32]


@st.composite
def calls(draw):
    T = draw(st.integers(0, 8))
    K = draw(st.sampled_from([3, 3, 3, 2, 4]))
    hx = draw(st.sampled_from([H, H, H, H - 1, H + 8]))
    layer = draw(st.sampled_from([0, 1, 1, 2, -1]))
    ids = draw(st.lists(st.integers(-3, E + 2), min_size=T * K, max_size=T * K))
    return dict(T=T, K=K, hx=hx, layer=layer, ids=ids, x_dtype=draw(st.sampled_from(X_DTYPES)),
                id_dtype=draw(st.sampled_from(ID_DTYPES)), w_dtype=draw(st.sampled_from(W_DTYPES)),
                strided=draw(st.booleans()), seed=draw(st.integers(0, 2**31)))


def expected_error(c):
    if not 0 <= c["layer"] < 2:
        return ValueError
    if np.dtype(c["x_dtype"]).kind in "iu":
        return TypeError if c["hx"] == H else ValueError
    if c["hx"] != H:
        return ValueError
    if not 1 <= c["T"] <= 6:
        return ValueError
    if np.dtype(c["id_dtype"]).kind == "f":
        return TypeError
    if np.dtype(c["w_dtype"]).kind in "iu":
        return TypeError
    if c["K"] != 3:
        return ValueError
    ids = np.array(c["ids"], np.int64)
    if np.dtype(c["id_dtype"]) == np.uint8:
        ids = ids.astype(np.uint8).astype(np.int64)  # wraps: 253..255 are out of range ids
    if ((ids < -1) | (ids >= E)).any():
        return ValueError
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_random_calls_are_right_or_refused(c):
    rng = np.random.default_rng(c["seed"])
    T, K = c["T"], c["K"]
    xf = rng.standard_normal((T, c["hx"] * (2 if c["strided"] else 1)))
    x = xf.astype(c["x_dtype"])
    if c["strided"]:
        x = x[:, ::2]  # a non-contiguous view
        assert not x.flags.c_contiguous or x.size <= 1
    ids = np.array(c["ids"], np.int64).reshape(T, K).astype(c["id_dtype"])
    w = rng.random((T, K)).astype(c["w_dtype"])
    err = expected_error(c)
    try:
        y = EX.decode(c["layer"], x, w, ids)
    except (ValueError, TypeError) as e:
        assert err is not None and isinstance(e, err), f"unexpected {type(e).__name__}: {e}"
        assert str(e), "exception without a message"
        return
    assert err is None, f"expected {err.__name__}, got a result"
    want = cf.moe_forward(EX.spec.name, RUN[c["layer"]], x, w, ids)
    np.testing.assert_array_equal(bits(y), bits(want))


EX3 = ce.CpuMoeExecutor("bf16", BANKS, top_k=3, max_tokens=6, **workers(3))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 6), ids=st.lists(st.integers(-1, E - 1), min_size=18, max_size=18),
       team=st.sampled_from([0, 1 << 40, 4096]), seed=st.integers(0, 2**31))
def test_valid_routings_are_bit_identical(T, ids, team, seed):
    """Only valid ids (any mix of -1, duplicates, tokens with every route -1), 3 threads, teams of 3, 1 or in
    between: the per-route down slots and their reductions give the single-threaded kernels' bits; every row of
    a poisoned output is written."""
    from cpumoe_executor import _native
    _native.set_team_unit(EX3.handle, team)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids_a = np.array(ids[:T * 3], np.int32).reshape(T, 3)
    w = rng.random((T, 3)).astype(np.float32)
    out = np.full((T, H), 0x7FC1, np.uint16).view(cf.numerics.BF16)
    y = EX3.decode(1, x, w, ids_a, out=out)
    np.testing.assert_array_equal(bits(y), bits(cf.moe_forward(EX3.spec.name, ran_banks(EX3, BANKS)[1], x, w, ids_a)))
