"""Shared machinery of the robustness suite (test_robustness_*.py): every registered format, mode and kernel tier as
parameters, small problems, and where each format's banks can hold a non-finite value."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats.numerics import BF16

USABLE = set(cf.usable_tiers())
E, H, I, T, TOP_K = 3, 256, 256, 4, 2  # noqa: E741 - every format's multiples (ds_fp4: 128), two blocks of fp8_block's
SESSION_SEED = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


def format_params():
    """One pytest param per registered format (a format added to the registry is covered without an edit)."""
    return [pytest.param(name, id=name) for name in cf.FORMATS]


def kernel_params():
    """(fmt, mode, tier) for every kernel tier of every mode of every registered format; a tier this CPU lacks is
    skipped with its reason."""
    out = []
    for name, spec in cf.FORMATS.items():
        for mode, tiers in spec.kernel_tiers.items():
            for t in tiers:
                marks = [] if t in USABLE else [pytest.mark.skip(reason=f"this CPU/OS lacks the {t} tier")]
                out.append(pytest.param(name, mode, t, id=f"{name}-{mode}-{t}", marks=marks))
    return out


def problem(fmt: str, seed: int = SESSION_SEED):
    """(banks, x float32 [T, H], topk_weights, topk_ids) of one small step: every token's first route to expert 0;
    token 0's second to expert 1, token 1's a duplicate (0), token 2's random, token 3's skipped (-1)."""
    rng = np.random.default_rng(seed + cf.get_format(fmt).id)
    banks = cf.get_format(fmt).random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.zeros((T, TOP_K), np.int32)
    ids[:, 1] = [1, 0, rng.integers(0, E), -1]
    w = (rng.random((T, TOP_K), dtype=np.float32) + 0.25).astype(np.float32)
    return banks, x, w, ids


def copy_banks(banks) -> dict:
    return {k: cf.aligned_copy(np.asarray(v)) for k, v in banks.items()}


def bits(y) -> np.ndarray:
    return np.asarray(y).view(np.uint16)


# ---- where a bank can hold NaN / inf ----------------------------------------------------------------------------
# Encodings a format may store floats in, with their (NaN, +inf, -inf) bit patterns.
ENCODINGS = {"float16": (2, (0x7E00, 0x7C00, 0xFC00)), "bfloat16": (2, (0x7FC0, 0x7F80, 0xFF80)),
             "float32": (4, (0x7FC00000, 0x7F800000, 0xFF800000))}
KINDS = ("nan", "+inf", "-inf")


def _put(banks, bank: str, expert: int, off: int, enc: str, kind: str) -> None:
    size, pats = ENCODINGS[enc]
    raw = np.asarray(banks[bank])[expert].reshape(-1).view(np.uint8)
    raw[off:off + size] = np.frombuffer(int(pats[KINDS.index(kind)]).to_bytes(size, "little"), np.uint8)


def _nonfinite_weights(spec, banks) -> bool:
    with np.errstate(all="ignore"):
        gu, dn = spec.dequantize(banks)
        bgu, bdn = spec.biases(banks)
    return not all(np.isfinite(a).all() for a in (gu, dn, bgu, bdn) if a is not None)


@functools.lru_cache(maxsize=None)
def nonfinite_sites(fmt: str) -> tuple:
    """(bank, byte offset in expert 1's slab, encoding) per bank that can hold a NaN: found by writing an encoding's
    NaN at the offsets of a 256-byte window from the middle of the slab on (all at once, then halving the set) and
    asking the format's float64 decode (dequantize and biases) whether a weight or bias became non-finite. Banks of
    codes without a NaN (e2m1, e4m3 whose 0x7F is 480, e8m0 clamped at 254) have none. A new format's float fields
    are found without an edit here."""
    spec = cf.get_format(fmt)
    banks = problem(fmt)[0]

    def hits(bank, offs, enc):
        b = copy_banks(banks)
        for off in offs:
            _put(b, bank, 1, off, enc, "nan")
        return _nonfinite_weights(spec, b)

    sites = []
    for bank in spec.bank_names:
        slab = np.asarray(banks[bank])[1].nbytes
        for enc, (size, _) in ENCODINGS.items():
            start = slab // 2 // size * size
            # 256 bytes: a whole block of every block format (q6_k's fp16 d is its block's last 2 of 210 bytes)
            offs = list(range(start, min(slab, start + 256) - size + 1, size))
            if not offs or not hits(bank, offs, enc):
                continue
            while len(offs) > 1:
                half = offs[:len(offs) // 2]
                offs = half if hits(bank, half, enc) else offs[len(offs) // 2:]
            sites.append((bank, offs[0], enc))
            break
    return tuple(sites)


def poisoned_banks(fmt: str, site, kind: str) -> dict:
    banks = copy_banks(problem(fmt)[0])
    _put(banks, site[0], 1, site[1], site[2], kind)
    return banks


def x_bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16)
