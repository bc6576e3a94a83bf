"""Bad input gets a clear Python exception naming the argument and what was
expected, for every format: never a crash or a silent wrong result."""
import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats import _native
from cpumoe_formats.numerics import BF16

FORMATS = [n for n, s in cf.FORMATS.items() if s.banks]


def small(fmt, rng, E=3):
    spec = cf.get_format(fmt)
    m = max(spec.k_multiple, 32)
    H, I = 2 * m, m  # noqa: E741
    return spec, spec.random_banks(E, H, I, rng), (E, H, I)


def step_inputs(rng, H, T=2, K=2, E=3):
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.integers(0, E, (T, K)).astype(np.int32)
    w = np.ones((T, K), np.float32)
    return x, w, ids


def test_unknown_format():
    with pytest.raises(ValueError, match="format='int3'.*expected one of"):
        cf.get_format("int3")
    with pytest.raises(TypeError, match="format must be"):
        cf.get_format(3)


def test_alias_resolves():
    assert cf.get_format("mxfp4_triton").name == "mxfp4"


@pytest.mark.parametrize("fmt", FORMATS)
def test_activation_and_mode_errors(fmt, rng):
    spec, banks, (E, H, I) = small(fmt, rng)
    with pytest.raises(ValueError, match="activation='relu'"):
        cf.Kernel(fmt, E, H, I, activation="relu")
    with pytest.raises(ValueError, match="limit=5.0 only applies"):
        cf.Kernel(fmt, E, H, I, activation="silu", limit=5.0)
    with pytest.raises(ValueError, match="limit=-1"):
        cf.Kernel(fmt, E, H, I, activation="swigluoai", limit=-1)
    with pytest.raises(ValueError, match="mode='w2a2'"):
        cf.Kernel(fmt, E, H, I, mode="w2a2")
    if not spec.input_weight:
        with pytest.raises(ValueError, match="apply_router_weight_on_input"):
            cf.Kernel(fmt, E, H, I, apply_router_weight_on_input=True)
        x, w, ids = step_inputs(rng, H)
        with pytest.raises(ValueError, match="apply_router_weight_on_input"):
            cf.reference.moe(fmt, banks, x, w, ids, apply_router_weight_on_input=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dims_not_multiple(fmt):
    spec = cf.get_format(fmt)
    if spec.k_multiple == 1:  # ragged format: odd sizes are accepted
        cf.Kernel(fmt, 2, 67, 33)
        return
    with pytest.raises(ValueError, match=f"multiples of {spec.k_multiple}"):
        cf.Kernel(fmt, 2, spec.k_multiple * 2 + spec.k_multiple // 2, spec.k_multiple)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bank_schema_errors(fmt, rng):
    spec, banks, (E, H, I) = small(fmt, rng)
    cf.validate_banks(fmt, banks, E, H, I)
    first = spec.bank_names[0]
    with pytest.raises(TypeError, match="mapping"):
        cf.validate_banks(fmt, list(banks.values()))
    with pytest.raises(ValueError, match=f"missing \\['{first}'\\]"):
        cf.validate_banks(fmt, {k: v for k, v in banks.items() if k != first})
    with pytest.raises(ValueError, match="unexpected \\['bogus'\\]"):
        cf.validate_banks(fmt, {**banks, "bogus": banks[first]})
    with pytest.raises(ValueError, match="expected E=7"):
        cf.validate_banks(fmt, banks, E=7)
    for name in spec.bank_names:
        a = banks[name]
        bad = a.astype(np.float64)
        with pytest.raises(TypeError, match=f"bank '{name}': dtype float64, expected"):
            cf.validate_banks(fmt, {**banks, name: bad})
    # a bank with one expert too few: shape named with the expected one
    name = spec.bank_names[-1]
    with pytest.raises(ValueError, match=f"bank '{name}'.*expected shape"):
        cf.validate_banks(fmt, {**banks, name: banks[name][:-1]})
    # non-contiguous innermost dimension
    for name in spec.bank_names:
        a = banks[name]
        wide = np.empty(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        strided = wide[..., ::2]
        strided[...] = a
        with pytest.raises(ValueError, match=f"bank '{name}': innermost stride"):
            cf.validate_banks(fmt, {**banks, name: strided})


@pytest.mark.parametrize("fmt", FORMATS)
def test_misaligned_bank(fmt, rng):
    spec, banks, (E, H, _) = small(fmt, rng)
    multi = [b for b in spec.banks if b.align > 1]
    if not multi:  # byte-addressed banks: an odd address is fine and computes the same
        x, w, ids = step_inputs(rng, H, E=E)
        want = cf.moe_forward(fmt, banks, x, w, ids)
        odd = {}
        for name, a in banks.items():
            raw = np.empty(a.nbytes + 64, np.uint8)
            off = (-raw.ctypes.data) % 64 + 1
            odd[name] = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
            odd[name][...] = a
        np.testing.assert_array_equal(cf.moe_forward(fmt, odd, x, w, ids).view(np.uint16), want.view(np.uint16))
        return
    for b in multi:
        a = banks[b.name]
        raw = np.empty(a.nbytes + 64, np.uint8)
        off = (-raw.ctypes.data) % 64 + 1  # 1 byte past a 64-byte boundary
        mis = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
        mis[...] = a
        with pytest.raises(ValueError, match=f"bank '{b.name}': data pointer .* not {b.align}-byte aligned"):
            cf.validate_banks(fmt, {**banks, b.name: mis})


@pytest.mark.parametrize("fmt", FORMATS)
def test_step_input_errors(fmt, rng):
    spec, banks, (E, H, I) = small(fmt, rng)
    x, w, ids = step_inputs(rng, H, E=E)
    cf.moe_forward(fmt, banks, x, w, ids)
    with pytest.raises(ValueError, match=r"x: shape \(2, 5\).*expected shape \[num_tokens, "):
        cf.moe_forward(fmt, banks, x[:, :5], w, ids)
    with pytest.raises(TypeError, match="x: dtype int32"):
        cf.moe_forward(fmt, banks, x.astype(np.int32), w, ids)
    with pytest.raises(TypeError, match="topk_ids: dtype float32"):
        cf.moe_forward(fmt, banks, x, w, ids.astype(np.float32))
    with pytest.raises(ValueError, match=r"topk_weights: shape \(2, 1\)"):
        cf.moe_forward(fmt, banks, x, w[:, :1], ids)
    with pytest.raises(ValueError, match=r"topk_ids: shape \(1, 2\)"):
        cf.moe_forward(fmt, banks, x, w, ids[:1])
    for bad in (E, E + 5, -2):
        ids2 = ids.copy()
        ids2[1, 1] = bad
        with pytest.raises(ValueError, match=rf"topk_ids\[1, 1\] = {bad} is not in \[-1, {E}\)"):
            cf.moe_forward(fmt, banks, x, w, ids2)
        with pytest.raises(ValueError, match=r"topk_ids\[1, 1\]"):
            cf.reference.moe(fmt, banks, x, w, ids2)
    with pytest.raises(ValueError, match="top_k=65"):
        cf.moe_forward(fmt, banks, x, np.ones((2, 65), np.float32), np.zeros((2, 65), np.int32))
    with pytest.raises(ValueError, match="out: .*expected C-contiguous bfloat16"):
        cf.moe_forward(fmt, banks, x, w, ids, out=np.empty((2, H), np.float32))
    with pytest.raises(ValueError, match="out: .*expected C-contiguous bfloat16"):
        cf.moe_forward(fmt, banks, x, w, ids, out=np.empty((2, H + 1), BF16))
    with pytest.raises(TypeError, match="x must be a numpy array"):
        cf.moe_forward(fmt, banks, x.tolist(), w, ids)


def test_native_checks_invariants_too():
    # The C++ entry re-checks what the kernels rely on, whatever Python passed.
    with pytest.raises(ValueError, match="format id 99"):
        _native.Kernel(99, 0, 0, False, 2, 64, 64, 1.0, float("inf"))
    with pytest.raises(ValueError, match="activation id 9"):
        _native.Kernel(0, 9, 0, False, 2, 64, 64, 1.0, float("inf"))
    with pytest.raises(ValueError, match="must be positive"):
        _native.Kernel(0, 0, 0, False, 0, 64, 64, 1.0, float("inf"))
    with pytest.raises(ValueError, match="limit must be > 0"):
        _native.Kernel(0, 3, 0, False, 2, 64, 64, 1.0, 0.0)
    with pytest.raises(ValueError, match="does not support mode w4a8"):
        _native.Kernel(0, 0, 1, False, 2, 64, 64, 1.0, float("inf"))
    k = _native.Kernel(0, 0, 0, False, 2, 64, 64, 1.0, float("inf"))
    with pytest.raises(ValueError, match="need 0 <= i0 < i1 <= I"):
        k.gate_up([], 0, 0, 65, [0], [1.0], [0])
    with pytest.raises(ValueError, match="expert id out of range"):
        k.gate_up([], 2, 0, 1, [0], [1.0], [0])
    ids = np.array([[0, 5]], np.int32)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 1\] = 5 is not in \[-1, 2\)"):
        k.moe_step([(0, 0, 0), (0, 0, 0)], 1, 2, 0, ids.ctypes.data, 0, 0)
