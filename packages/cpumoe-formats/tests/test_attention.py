"""Decode attention (attention.py, C ABI 1.11) against the float64 reference, every tier forced in turn (isa= and
CPUMOE_ISA), on fresh random data: ragged head sizes and cache lengths, grouped-query heads, masks, strided
caches (a static cache's filled part), NaN and inf, and bad input.

Tolerance: the scores are fp32 dots of bf16 values (D <= 160 products: < D * 2^-24 of sum |q k| off), the softmax
and its weighted sum of L <= 300 rows in fp32 (< L * 2^-24 relative): against float64 < 1e-5 of max |v| for N(0, 1)
data. The bf16 output adds its rounding, half a bf16 step: |o - ref| <= 2^-8 |ref| + 1e-5 max |v|.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import USABLE

import cpumoe_formats as cf
from cpumoe_formats.attention import KERNEL_TIERS, expected_tier
from cpumoe_formats.numerics import BF16

TIER_PARAMS = [pytest.param(t, id=t, marks=[] if t in USABLE else [pytest.mark.skip(reason=f"no {t} here")])
               for t in cf.TIERS]
# (n, Hq, Hkv, D, L): ragged D (not a multiple of 16, below one vector), one position, Qwen3-30B-A3B's heads
# (32 q / 4 kv of 128) at a short and a longer cache, multi-head (group 1), odd groups
SHAPES = [(1, 4, 4, 1, 1), (1, 6, 2, 7, 5), (2, 9, 3, 17, 33), (1, 32, 4, 128, 34), (3, 32, 4, 128, 300),
          (4, 8, 1, 80, 129), (1, 2, 2, 160, 64)]


def _data(rng, n, Hq, Hkv, D, L):
    q = rng.standard_normal((n, Hq, D)).astype(BF16)
    k = rng.standard_normal((Hkv, L, D)).astype(BF16)
    v = rng.standard_normal((Hkv, L, D)).astype(BF16)
    return q, k, v


def _close(o, ref, v):
    o = o.astype(np.float64)
    bound = 2.0**-8 * np.abs(ref) + 1e-5 * np.abs(v.astype(np.float64)).max()
    err = np.abs(o - ref)
    where = np.unravel_index((err - bound).argmax(), err.shape)
    assert (err <= bound).all(), f"worst excess {(err - bound).max():.3e} at {where}"


@pytest.mark.parametrize("tier", TIER_PARAMS)
def test_forced_tier_reports_what_runs(tier, monkeypatch):
    assert cf.DecodeAttention(isa=tier).name == expected_tier(tier)
    monkeypatch.setenv("CPUMOE_ISA", tier)
    assert cf.DecodeAttention().name == expected_tier(tier)


@pytest.mark.parametrize("tier", TIER_PARAMS)
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_vs_reference(rng, tier, shape):
    att = cf.DecodeAttention(isa=tier)
    n, Hq, Hkv, D, L = shape
    q, k, v = _data(rng, n, Hq, Hkv, D, L)
    scale = float(rng.uniform(0.05, 0.5))
    _close(att.forward(q, k, v, scale=scale), cf.reference.attention(q, k, v, scale=scale), v)
    mask = rng.random((n, L)) < 0.6
    mask[:, rng.integers(0, L)] = True  # at least one position each
    _close(att.forward(q, k, v, mask, scale), cf.reference.attention(q, k, v, mask, scale), v)


def test_every_tier_same_bits(rng):
    """The doc's claim: a fixed reduction tree, so every usable kernel tier gives the same bits."""
    q, k, v = _data(rng, 3, 32, 4, 128, 77)
    mask = rng.random((3, 77)) < 0.7
    outs = {t: cf.DecodeAttention(isa=t).forward(q, k, v, mask).view(np.uint16) for t in KERNEL_TIERS if t in USABLE}
    first = next(iter(outs.values()))
    for t, o in outs.items():
        np.testing.assert_array_equal(o, first, err_msg=t)


def test_static_cache_reads_only_the_filled_part(rng):
    """A [Hkv, 4096, D] cache of which 40 positions are filled (the rest garbage: NaN) and masked off equals the
    attention over those 40 alone, bit for bit; the cache may be a strided view (one batch row of [B, Hkv, L, D])."""
    q, k, v = _data(rng, 1, 32, 4, 128, 40)
    big_k = np.full((2, 4, 4096, 128), np.nan, BF16)
    big_v = np.full((2, 4, 4096, 128), np.nan, BF16)
    big_k[1, :, :40], big_v[1, :, :40] = k, v
    mask = np.zeros((1, 4096), bool)
    mask[0, :40] = True
    att = cf.DecodeAttention()
    want = att.forward(q, k, v)
    got = att.forward(q, big_k[1], big_v[1], mask)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_tokens_and_heads_independent(rng):
    """A token's result does not depend on the other tokens of the call; q may be any strided view (the
    [1, Hq, n, D] layout transformers hands over, transposed)."""
    q, k, v = _data(rng, 4, 16, 2, 64, 50)
    mask = np.tril(np.ones((4, 50), bool), 46)
    att = cf.DecodeAttention()
    all_ = att.forward(q, k, v, mask)
    for t in range(4):
        np.testing.assert_array_equal(att.forward(q[t:t + 1], k, v, mask[t:t + 1]).view(np.uint16),
                                      all_[t:t + 1].view(np.uint16))
    qt = np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)  # strides (D, n * D, 1)
    np.testing.assert_array_equal(att.forward(qt, k, v, mask).view(np.uint16), all_.view(np.uint16))


@pytest.mark.parametrize("tier", [t for t in KERNEL_TIERS if t in USABLE])
def test_nonfinite_follows_reference(rng, tier):
    """NaN in one head's q: that head's row NaN, the others unchanged; inf in a key: the reference's NaN (inf - inf)
    where its scores meet it; NaN in a masked-off value: never read; a token with no position: NaN."""
    att = cf.DecodeAttention(isa=tier)
    q, k, v = _data(rng, 2, 8, 2, 32, 20)
    mask = np.ones((2, 20), bool)
    mask[1, 5] = False
    clean = att.forward(q, k, v, mask)
    qb = q.copy()
    qb[0, 3, 7] = np.nan
    o = att.forward(qb, k, v, mask).astype(np.float64)
    assert np.isnan(o[0, 3]).all()
    bad = np.zeros(o.shape, bool)
    bad[0, 3] = True
    np.testing.assert_array_equal(o[~bad], clean.astype(np.float64)[~bad])
    kb = k.copy()
    kb[1, 9, 0] = np.inf
    ref = cf.reference.attention(q, kb, v, mask)
    o = att.forward(q, kb, v, mask).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(o), np.isnan(ref))
    assert np.isnan(ref).any()
    vb = v.copy()
    vb[0, 5] = np.nan
    o = att.forward(q, k, vb, mask)
    np.testing.assert_array_equal(o[1].view(np.uint16), clean[1].view(np.uint16))  # token 1 masks position 5 off
    assert np.isnan(o[0].astype(np.float64)[:4]).all()  # token 0's heads of kv head 0 read it
    empty = mask.copy()
    empty[0] = False
    o = att.forward(q, k, v, empty).astype(np.float64)
    assert np.isnan(o[0]).all() and np.isfinite(o[1]).all()


def test_bad_input(rng):
    att = cf.DecodeAttention()
    q, k, v = _data(rng, 1, 8, 2, 32, 10)
    with pytest.raises(ValueError, match="q: .*expected bfloat16"):
        att.forward(q.astype(np.float32), k, v)
    with pytest.raises(ValueError, match="multiple"):
        att.forward(q[:, :7], k, v)
    with pytest.raises(ValueError, match=r"k: .*expected both \[Hkv, L, 32\]"):
        att.forward(q, k[:, :, :16], v)
    with pytest.raises(ValueError, match=r"mask: .*expected bool \[1, 10\]"):
        att.forward(q, k, v, np.ones((1, 9), bool))
    with pytest.raises(ValueError, match=r"mask: .*expected bool"):
        att.forward(q, k, v, np.ones((1, 10), np.uint8))
    with pytest.raises(ValueError, match="scale"):
        att.forward(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="out"):
        att.forward(q, k, v, out=np.empty((1, 8, 31), BF16))
    with pytest.raises(ValueError, match="isa="):
        cf.DecodeAttention(isa="sse9")
    att.close()
    with pytest.raises(RuntimeError, match="closed"):
        att.forward(q, k, v)
