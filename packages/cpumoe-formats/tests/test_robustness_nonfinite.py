"""NaN and inf follow the float64 reference, in every registered format, mode and kernel tier (docs/formats.md
"Contracts"): a NaN or inf in one token's x, in a router weight, in the intermediate g (an activation that
overflows), and in every bank that can hold one (scales, globals, biases, bf16 weights: robustness_helpers finds
them) makes the output entries NaN / +inf / -inf exactly where the reference's are; an inf in a bank makes the same
entries non-finite (a kernel that applies a block's scale to the block's sum may give +-inf where the reference's
0 * inf gives NaN). An inf router weight gives each entry the sign of its expert's output there, so where that output
is within the kernels' error of zero (|o| <= SIGN_TOL * max|o| of the row) only non-finiteness is required: there its
sign is rounding, not a contract (seed 4184182610 gave nvfp4's scalar tier -inf against the reference's +inf at
one such entry). Every other entry is bit for bit the kernel's result without the bad value.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from robustness_helpers import (
    KINDS,
    SESSION_SEED,
    kernel_params,
    nonfinite_sites,
    poisoned_banks,
    problem,
)

import cpumoe_formats as cf
from cpumoe_formats.numerics import round_bf16

_VAL = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
SIGN_TOL = 1e-2  # twice the loosest whole-step tolerance of a format's conformance tests (5e-3: nvfp4, ds_fp4)
W_TOKEN = 2  # the token whose first router weight the topk_weights cases poison


def cases(fmt: str) -> list:
    """(label, banks, x, w, ids, strict, bad tokens): strict = the NaN / +inf / -inf classes must match the
    reference's (else only finiteness); the rows of the other tokens must equal the clean run bit for bit."""
    banks, x, w, ids = problem(fmt)
    out = []
    for kind in KINDS:
        xb = x.copy()
        xb[1, 37] = _VAL[kind]
        out.append((f"x {kind}", banks, xb, w, ids, True, {1}))
    for kind in ("nan", "+inf"):
        wb = w.copy()
        wb[W_TOKEN, 0] = _VAL[kind]
        out.append((f"topk_weights {kind}", banks, x, wb, ids, True, {W_TOKEN}))
    xb = x.copy()
    xb[2] *= np.float32(2.0**100)  # gate and up ~2^100: act(gate, up) overflows g to +-inf (and bf16 keeps it)
    out.append(("g overflow", banks, xb, w, ids, True, {2}))
    bad = {int(t) for t in np.flatnonzero((ids == 1).any(axis=1))}  # the sites are in expert 1
    for site in nonfinite_sites(fmt):
        for kind in KINDS:
            out.append((f"bank {site[0]} {kind} ({site[2]})", poisoned_banks(fmt, site, kind), x, w, ids,
                        kind == "nan", bad))
    return out


@functools.lru_cache(maxsize=None)
def expected(fmt: str, mode: str) -> list:
    """The reference of every case (once per format and mode, shared by its tiers), rounded to bf16 as the output."""
    with np.errstate(all="ignore"):
        return [round_bf16(cf.reference.moe(fmt, b, x, w, ids, mode=mode)) for _, b, x, w, ids, _, _ in cases(fmt)]


@functools.lru_cache(maxsize=None)
def sign_free(fmt: str, mode: str) -> np.ndarray:
    """[T, H] bool: the entries of token W_TOKEN where its first route's expert output o is within the kernels' error
    of zero (|o| <= SIGN_TOL * max|o|), so an inf weight on that route gives an inf whose sign is rounding."""
    banks, x, w, ids = problem(fmt)
    one = np.zeros_like(w)
    one[W_TOKEN, 0] = 1.0
    o = cf.reference.moe(fmt, banks, x, one, ids, mode=mode)[W_TOKEN]
    free = np.zeros((len(x), o.shape[-1]), bool)
    free[W_TOKEN] = np.abs(o) <= SIGN_TOL * np.abs(o).max()
    return free


@pytest.mark.parametrize("fmt,mode,tier", kernel_params())
def test_nonfinite_follows_reference(fmt, mode, tier):
    print(f"CPUMOE_TEST_SEED={SESSION_SEED}")
    banks, x, w, ids = problem(fmt)
    with cf.Kernel(fmt, *cf.validate_banks(fmt, banks), mode=mode, isa=tier) as k:
        assert k.name == tier + ("+w4a8" if mode == "w4a8" else "")
        clean = k.forward(banks, x, w, ids).view(np.uint16)
        failures = []
        for (label, b, xb, wb, ib, strict, bad), ref in zip(cases(fmt), expected(fmt, mode)):
            y = k.forward(b, xb, wb, ib)
            yf = y.astype(np.float64)
            if np.isfinite(ref).all():
                failures.append(f"{label}: the reference is finite (the case did not poison anything)")
                continue
            if strict:
                same = (np.isnan(yf) == np.isnan(ref)) & (np.isposinf(yf) == np.isposinf(ref)) & (
                    np.isneginf(yf) == np.isneginf(ref))
            else:
                same = np.isfinite(yf) == np.isfinite(ref)
            if label.startswith("topk_weights"):
                same |= sign_free(fmt, mode) & ~np.isfinite(yf)
            if not same.all():
                t, h = np.argwhere(~same)[0]
                failures.append(f"{label}: {np.count_nonzero(~same)} entries' class differs from the reference, "
                                f"first y[{t}, {h}] = {yf[t, h]} against {ref[t, h]}")
            rows = [t for t in range(len(yf)) if t not in bad]
            if not np.array_equal(y.view(np.uint16)[rows], clean[rows]):
                failures.append(f"{label}: rows {rows} of the tokens without the bad value changed")
            fin = np.isfinite(yf) & np.isfinite(ref)
            if label.startswith("bank") and not np.array_equal(y.view(np.uint16)[fin], clean[fin]):
                failures.append(f"{label}: finite entries differ from the clean run")
        assert not failures, f"{fmt} {mode} at {tier}:\n  " + "\n  ".join(failures)


@pytest.mark.parametrize("fmt", list(cf.FORMATS))
def test_every_float_bank_has_a_site(fmt):
    """The site search finds every bank stored as floats (bf16 / fp16 / fp32 dtype), so the test above poisons it."""
    spec = cf.get_format(fmt)
    floats = {b.name for b in spec.banks if np.dtype(b.dtypes[0]).kind == "f" or np.dtype(b.dtypes[0]).name in (
        "bfloat16",)}
    assert floats <= {s[0] for s in nonfinite_sites(fmt)}, (floats, nonfinite_sites(fmt))


@pytest.mark.parametrize("fmt", list(cf.FORMATS))
@pytest.mark.parametrize("kind", KINDS)
def test_act_in_keeps_nonfinite(fmt, kind):
    """The reference's activation helpers (act_in of every mode: numerics.int8_blocks, nvfp4's and ds_fp4's
    quantizers) never turn a NaN or inf into a finite value: a quantizing mode's block holding one is NaN, and
    every finite entry equals the clean vector's."""
    spec = cf.get_format(fmt)
    v = np.random.default_rng(SESSION_SEED).standard_normal(256).astype(np.float32)
    v = v.astype(cf.numerics.BF16).astype(np.float64)
    bad = v.copy()
    bad[133] = _VAL[kind]
    for mode in spec.modes:
        with np.errstate(all="ignore"):
            got, want = spec.act_in(bad, mode), spec.act_in(v, mode)
        assert not np.isfinite(got[133]), (mode, got[133])
        fin = np.isfinite(got)
        np.testing.assert_array_equal(got[fin], want[fin], err_msg=mode)


def test_sites_cover_known_float_fields():
    """The site search on the formats whose float fields are known: q4_0's fp16 d inside its uint8 blocks,
    nvfp4's fp16 globals, mxfp4's bf16 biases, fp8_block's bf16 scales, bf16's weights; ds_fp4 has none."""
    names = {f: {s[0] for s in nonfinite_sites(f)} for f in ("q4_0", "nvfp4", "mxfp4", "fp8_block", "bf16", "ds_fp4")}
    assert names["q4_0"] == {"gate_up", "down"}
    assert names["nvfp4"] == {"gate_up_global", "down_global"}
    assert names["mxfp4"] == {"gate_up_bias", "down_bias"}
    assert {"gate_up_scale", "down_scale"} <= names["fp8_block"]
    assert names["bf16"] == {"gate_up", "down"}
    assert names["ds_fp4"] == set()

