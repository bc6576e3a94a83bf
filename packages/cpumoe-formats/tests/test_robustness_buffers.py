"""Buffers (docs/formats.md "Contracts"): every entry point that takes `out` (Kernel.forward, moe_forward, a bound
step) refuses, before the native call, an out that is read-only (a view of bytes, of a PROT_READ mapping), of
another dtype or shape, not C-contiguous or misaligned, with a ValueError naming `out` and what is expected; inputs
that are misaligned or strided are copied (forward, moe_forward) or refused by name (the bound step)."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
from robustness_helpers import H, T, bits, format_params, problem, x_bf16

import cpumoe_formats as cf
from cpumoe_formats._arrays import check_array
from cpumoe_formats.numerics import BF16


def _misaligned(shape, dtype):
    raw = np.zeros(int(np.prod(shape)) * np.dtype(dtype).itemsize + 64, np.uint8)
    off = (-raw.ctypes.data) % 64 + 1
    return raw[off:off + raw.size - 64].view(dtype).reshape(shape)


BAD_OUTS = {
    "bytes": lambda: np.frombuffer(bytes(T * H * 2), BF16).reshape(T, H),
    "prot_read": lambda: np.frombuffer(mmap.mmap(-1, T * H * 2, prot=mmap.PROT_READ), BF16).reshape(T, H),
    "float32": lambda: np.zeros((T, H), np.float32),
    "uint16": lambda: np.zeros((T, H), np.uint16),
    "shape": lambda: np.zeros((T, H + 16), BF16),
    "strided": lambda: np.zeros((T, 2 * H), BF16)[:, ::2],
    "misaligned": lambda: _misaligned((T, H), BF16),
}
WHY = {"bytes": "read-only", "prot_read": "read-only", "float32": "dtype float32", "uint16": "dtype uint16",
       "shape": f"shape \\({T}, {H + 16}\\)", "strided": "not C-contiguous", "misaligned": "not 2-byte aligned"}


def _call(entry, fmt, banks, x, w, ids, out):
    if entry == "forward":
        with cf.Kernel(fmt, *cf.validate_banks(fmt, banks)) as k:
            return k.forward(banks, x, w, ids, out=out)
    if entry == "moe_forward":
        return cf.moe_forward(fmt, banks, x, w, ids, out=out)
    with cf.Kernel(fmt, *cf.validate_banks(fmt, banks)) as k:
        return k.bind(banks)(x_bf16(x), w, ids, out)


@pytest.mark.parametrize("fmt", format_params())
@pytest.mark.parametrize("entry", ["forward", "moe_forward", "step"])
@pytest.mark.parametrize("bad", list(BAD_OUTS))
def test_bad_out_is_refused_before_the_native_call(fmt, entry, bad):
    """ValueError naming out, what is wrong and what was expected; the read-only memory is unchanged (the bytes
    object was written through; a PROT_READ mapping segfaulted)."""
    banks, x, w, ids = problem(fmt)
    out = BAD_OUTS[bad]()
    before = bytes(np.ascontiguousarray(out).view(np.uint8)) if bad in ("bytes", "prot_read") else None
    with pytest.raises(ValueError, match=rf"out.*{WHY[bad]}.*expected C-contiguous bfloat16 of shape \({T}, {H}\), "
                                         rf"writable, data 2-byte aligned"):
        _call(entry, fmt, banks, x, w, ids, out)
    if before is not None:
        assert bytes(np.ascontiguousarray(out).view(np.uint8)) == before


@pytest.mark.parametrize("fmt", format_params())
def test_good_out_and_copied_inputs(fmt):
    """A writable, aligned out is written in place; misaligned and strided x, topk_weights and topk_ids give the
    aligned inputs' bits through forward and moe_forward (copied), and the bound step refuses them by name."""
    banks, x, w, ids = problem(fmt)
    want = bits(cf.moe_forward(fmt, banks, x, w, ids)).copy()
    out = cf.aligned_empty((T, H), BF16)
    assert cf.moe_forward(fmt, banks, x, w, ids, out=out) is out and np.array_equal(bits(out), want)
    xm, wm, im = _misaligned(x.shape, BF16), _misaligned(w.shape, np.float32), _misaligned(ids.shape, np.int32)
    xm[...], wm[...], im[...] = x_bf16(x), w, ids
    xs = np.zeros((T, 2 * H), BF16)[:, ::2]
    xs[...] = x_bf16(x)
    for xx in (xm, xs):
        assert np.array_equal(bits(cf.moe_forward(fmt, banks, xx, wm, im)), want)
    with cf.Kernel(fmt, *cf.validate_banks(fmt, banks)) as k:
        assert np.array_equal(bits(k.forward(banks, xm, wm, im)), want)
        step = k.bind(banks)
        for args, name in (((xm, w, ids), "x"), ((xs, w, ids), "x"), ((x_bf16(x), wm, ids), "topk_weights"),
                           ((x_bf16(x), w, im), "topk_ids")):
            with pytest.raises(ValueError, match=rf"{name} \(bound step\)"):
                step(*args, out)


def test_check_array_messages():
    a = np.zeros((2, 3), np.float32)
    assert check_array(a, "a", dtype=np.float32, shape=(2, 3), writable=True) is a
    with pytest.raises(ValueError, match=r"^b: shape \(2, 3\) dtype float32; expected C-contiguous int32 of shape "
                                         r"\(2, 3\), data 4-byte aligned$"):
        check_array(a, "b", dtype=np.int32, shape=(2, 3))
    a.flags.writeable = False
    with pytest.raises(ValueError, match=r"^c: shape \(2, 3\) dtype float32, read-only; expected C-contiguous float32, "
                                         r"writable, data 4-byte aligned$"):
        check_array(a, "c", dtype=np.float32, writable=True)
    with pytest.raises(ValueError, match=r"not 64-byte aligned"):
        check_array(_misaligned((4,), np.uint8), "d", align=64)
