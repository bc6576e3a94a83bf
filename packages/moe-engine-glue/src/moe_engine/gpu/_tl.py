"""Triton helpers the format kernels share: the interpreter switch, the matrix product, the activations, the
e2m1 and e4m3 decoders.

The kernels are decorated when this package is imported, so TRITON_INTERPRET=1 must be set before the first
import for them to run on CPU tensors (Triton's interpreter); `INTERPRET` records what was in force then.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The kernels' INTERP constexpr: work around two things Triton's interpreter (3.9) gets wrong. (1) tl.dot of bf16
# operands multiplies their uint16 bit patterns (create_dot calls np.matmul on the raw storage): under the
# interpreter the product runs on fp32 copies of the bf16 values (the same exact products, fp32 accumulation).
# (2) fp32 -> bf16 casts truncate (cast_impl passes no rounding mode): round_bf16 rounds to nearest even by hand.
INTERP = INTERPRET

ACT_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swigluoai": 3, "swiglu_clamp": 4}


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b in fp32 (a, b bf16 tiles)."""
    if INTERP:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit
def round_bf16(v, INTERP: tl.constexpr):
    """fp32 -> bf16, round to nearest even (the GPU's cvt.rn; by hand under the interpreter; finite values)."""
    if INTERP:
        b = v.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        r = (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        r = v.to(tl.bfloat16)
    return r


@triton.jit
def activate(gate, up, ACT: tl.constexpr, alpha, limit):
    """The activation epilogue in fp32 (cpumoe_formats.activations; ids as ACT_IDS)."""
    if ACT == 0:  # silu(gate) * up
        out = gate / (1.0 + tl.exp(-gate)) * up
    elif ACT == 1:  # exact gelu
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACT == 2:  # tanh-approximated gelu; tanh(z) = 1 - 2 / (exp(2z) + 1)
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
        out = 0.5 * gate * (1.0 + t) * up
    else:  # 3 swigluoai, 4 swiglu_clamp (limit = +inf: no clamp)
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        s = g / (1.0 + tl.exp(-alpha * g))
        if ACT == 3:
            out = s * (u + 1.0)
        else:
            out = s * u
    return out


@triton.jit
def e4m3(c, OUT: tl.constexpr):
    """uint8 e4m3fn codes -> OUT (tl.float32 or tl.bfloat16), exact; 0x7F / 0xFF decode to +-480, not NaN."""
    v = c.to(tl.float8e4nv, bitcast=True).to(OUT)
    big = tl.where(c >= 128, -480.0, 480.0).to(OUT)
    return tl.where((c & 0x7F) == 0x7F, big, v)


@triton.jit
def e2m1_pair(b):
    """uint8 bytes of two e2m1 codes (low nibble = even K element) -> (lo, hi) fp32 values times 2^-14, exact.

    Each nibble becomes the fp16 with bits (code & 7) << 9 | sign << 15: e2m1 (e, m) maps onto fp16 exponent e
    and mantissa m, the value 2^-14 times the e2m1 value (the two codes with e = 0 land on fp16 subnormals,
    which the fp16 -> fp32 conversion widens exactly). Callers fold the 2^14 into their scale."""
    bi = b.to(tl.int32)
    lo = (((bi & 7) << 9) | ((bi & 8) << 12)).to(tl.uint16)
    hi = (((bi & 0x70) << 5) | ((bi & 0x80) << 8)).to(tl.uint16)
    return lo.to(tl.float16, bitcast=True).to(tl.float32), hi.to(tl.float16, bitcast=True).to(tl.float32)
