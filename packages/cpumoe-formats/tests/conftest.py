"""Shared test machinery: fresh random data, tier forcing, poisoned outputs,
stated tolerances."""
from __future__ import annotations

import os

import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats import _native
from cpumoe_formats.numerics import BF16

USABLE = set(cf.usable_tiers())
IS_AMD = bool(_native.cpu_is_amd())
POISON = np.uint16(0x7FC1)  # a NaN pattern no kernel writes


def tier_cases(fmt: str, modes=None):
    """pytest params (mode, tier) for every kernel the format has; skipped only
    when this CPU lacks the tier."""
    spec = cf.get_format(fmt)
    out = []
    for mode, tiers in spec.kernel_tiers.items():
        if modes is not None and mode not in modes:
            continue
        for t in tiers:
            marks = [] if t in USABLE else [pytest.mark.skip(reason=f"this CPU/OS lacks the {t} tier")]
            out.append(pytest.param(mode, t, id=f"{mode}-{t}", marks=marks))
    return out


def expected_name(fmt: str, mode: str, forced: str, auto: bool = False) -> str:
    """Kernel name forcing `forced` must give: the format's highest own tier <= forced that this CPU runs
    (auto: the cap came from CPUMOE_ISA unset/auto, so the format's opt-in tiers are left out, and its AMD-only
    auto tiers on other CPUs)."""
    spec = cf.get_format(fmt)
    order = cf.TIERS
    skip = (set(spec.opt_in_tiers) | (set() if IS_AMD else set(spec.amd_auto_tiers))) if auto else set()
    best = max((t for t in spec.kernel_tiers[mode] if t in USABLE and order.index(t) <= order.index(forced)
                and t not in skip), key=order.index)
    return best + ("+w4a8" if mode == "w4a8" else "")


@pytest.fixture
def rng(request):
    """Fresh random data every run (seed printed on failure for reproduction)."""
    seed = int.from_bytes(os.urandom(4), "little") if "CPUMOE_TEST_SEED" not in os.environ \
        else int(os.environ["CPUMOE_TEST_SEED"])
    request.node.user_properties.append(("seed", seed))
    print(f"CPUMOE_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def poisoned(T: int, H: int) -> np.ndarray:
    out = cf.aligned_empty((T, H), BF16)
    out.view(np.uint16)[...] = POISON
    return out


def run_forced(fmt, banks, x, w, ids, mode, tier, **kw) -> np.ndarray:
    """moe_forward at a forced tier into a poisoned output; asserts the tier ran
    and every output element was written. Returns float64 y."""
    spec = cf.get_format(fmt)
    E, H, I = cf.validate_banks(fmt, banks)
    k = cf.Kernel(fmt, E, H, I, mode=mode, isa=tier, **kw)
    assert k.name == expected_name(spec.name, mode, tier) == tier + ("+w4a8" if mode == "w4a8" else "")
    out = poisoned(x.shape[0], H)
    y = k.forward(banks, x, w, ids, out=out)
    assert y is out
    raw = out.view(np.uint16)
    assert not (raw == POISON).any(), "kernel left output elements unwritten"
    return out.astype(np.float64)


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    """max |y - ref| / max |ref| (the field's usual metric); NaN never passes."""
    assert np.isfinite(y).all(), "non-finite output"
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def routes(rng, T: int, top_k: int, E: int, *, dup: bool = True, skip: bool = True):
    """Random routing with duplicated experts within a token and -1 routes."""
    ids = rng.integers(0, E, size=(T, top_k)).astype(np.int32)
    if dup and top_k > 1:
        ids[0, 1] = ids[0, 0]
    if skip and T > 1:
        ids[-1, rng.integers(0, top_k)] = -1
    w = rng.random((T, top_k), dtype=np.float32) + 0.05
    return w, ids


def int8_blocks_slow(v):
    """The 32-block w4a8 activation quantization element by element with numpy float32 scalars
    (independent of numerics.int8_blocks): d = amax/127, id = 1/d (0 if not finite), q = clamp(rint(x*id), +-127);
    a block holding a NaN or an inf: d = NaN, q = 0."""
    x = np.asarray(v, np.float32).reshape(-1, 32)
    qs, ds = np.zeros(x.shape, np.int8), np.zeros(x.shape[0], np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        for b in range(x.shape[0]):
            if not all(np.isfinite(x[b, t]) for t in range(32)):
                ds[b] = np.float32(np.nan)
                continue
            amax = np.float32(0)
            for t in range(32):
                amax = max(amax, abs(x[b, t]))
            d = np.float32(amax / np.float32(127))
            inv = np.float32(np.float32(1) / d)
            if not np.isfinite(inv):
                inv = np.float32(0)
            ds[b] = d
            for t in range(32):
                qs[b, t] = int(min(127, max(-127, np.rint(np.float32(x[b, t] * inv)))))
    return qs, ds
