"""Checks shared by the _x16 layouts' tests (q4_0_x16, nvfp4_x16, ds_fp4_x16, fp8_block_x16, bf16_x16): work items
over ragged row ranges with poisoned outputs and sentinels, the fp32 down accumulators of a work item per tier, and
the pair layouts' fp32-FMA tiers (x16_fma.h) against scalar on constructed flush-to-zero cases."""
import numpy as np
import pytest
from conftest import USABLE, routes, run_forced
from fp4_helpers import prep, to_bf16_bits, views

import cpumoe_formats as cf

POISON = 0x7FC1  # a bf16 NaN no kernel writes


def split_record(buf, K, qb):  # noqa: N803
    """An int8 layout's prepared record (x16.h BlockToks): per qb-element block its qb int8 codes, a float32
    scale and an int32 correction. Returns (q [K] int8, s [K/qb] float32, corr [K/qb] int32)."""
    nb = K // qb
    rec = np.asarray(buf[:(qb + 8) * nb]).reshape(nb, qb + 8)
    q = rec[:, :qb].copy().view(np.int8).reshape(K)
    return q, rec[:, qb:qb + 4].copy().view(np.float32).ravel(), rec[:, qb + 4:].copy().view(np.int32).ravel()


def down_accumulators(fmt, banks, tiers, gs, H, mode=None):  # noqa: N803
    """The fp32 accumulators [T, H] of one down work item over all rows, per tier (routes of expert 1, weights
    0.5 + j; mode: the format's default if None): bf16 outputs would hide a reordered fp32 sum. Asserts most
    elements are non-zero."""
    E, _, I = cf.validate_banks(fmt, banks)  # noqa: E741
    out = []
    for t in tiers:
        k = cf.Kernel(fmt, E, H, I, isa=t, mode=mode)
        bufs = [prep(k, g) for g in gs]
        acc = cf.aligned_empty((len(gs), H), np.float32)
        acc[...] = 0
        k._k.down(views(fmt, banks), 0, H, [(j, 1, 0.5 + j, bufs[j].ctypes.data) for j in range(len(gs))],
                  acc.ctypes.data, H)
        assert np.count_nonzero(acc) > acc.size // 2
        out.append(acc)
    return out


def check_ragged_work_items(k, fmt, banks, n, rng, gate_ranges, down_ranges, check_full_down, w_in=None):
    """gate_up over row ranges [i0, i1) (expert 2) and down over [h0, h1) (expert 1) that cut groups: each call
    writes exactly its rows (everything else keeps its poison or sentinel), with the bits of a whole-range call.
    check_full_down(acc [n, H], g bits [n, I], weights [n]) checks the whole-range down terms against float64."""
    _, H, I = cf.validate_banks(fmt, banks)  # noqa: E741
    V = views(fmt, banks)
    xs = [prep(k, x) for x in to_bf16_bits(rng.standard_normal((n, H)))]
    w_in = list(rng.uniform(0.5, 1.5, n)) if w_in is None else w_in

    def gate_up(i0, i1):
        g = cf.aligned_empty((n, I + 8), np.uint16)
        g[...] = POISON
        k._k.gate_up(V, 2, i0, i1, [a.ctypes.data for a in xs], w_in, [g[j].ctypes.data for j in range(n)])
        assert (g[:, I:] == POISON).all(), "gate_up wrote past its rows"
        return g[:, :I]

    whole = gate_up(0, I)
    assert not (whole == POISON).any()
    for i0, i1 in gate_ranges:
        g = gate_up(i0, i1)
        np.testing.assert_array_equal(g[:, i0:i1], whole[:, i0:i1])
        assert (g[:, :i0] == POISON).all() and (g[:, i1:] == POISON).all(), (i0, i1)

    gs = to_bf16_bits(rng.standard_normal((n, I)))
    acts = [prep(k, g) for g in gs]
    wts = rng.uniform(0.1, 1.0, n)
    rts = [(j, 1, float(wts[j]), acts[j].ctypes.data) for j in range(n)]

    def down(h0, h1):
        acc = cf.aligned_empty((n, h1 - h0 + 8), np.float32)
        acc[...] = 12345.0  # sentinel past each token's rows [h0, h1): a write outside them changes it
        acc[:, :h1 - h0] = 0
        k._k.down(V, h0, h1, rts, acc.ctypes.data, acc.shape[1])
        assert (acc[:, h1 - h0:] == 12345.0).all(), "down wrote outside its rows"
        return acc[:, :h1 - h0]

    full = down(0, H)
    check_full_down(full, gs, wts)
    for h0, h1 in down_ranges:
        np.testing.assert_array_equal(down(h0, h1), full[:, h0:h1])


def _raw(a):
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def check_moved(fmt, source, banks, H, I):  # noqa: E741
    """A CPU layout from `source` banks: validates, has the source's bytes per expert, unpacks to the same bits.
    Returns the layout's banks."""
    layout = cf.get_format(fmt)
    r = getattr(cf, f"repack_{fmt}", layout.repack_from)(banks)  # the package's own repack_<fmt> where it has one
    assert cf.validate_banks(fmt, r) == (banks["down"].shape[0], H, I)
    assert layout.bytes_per_expert(H, I) == source.bytes_per_expert(H, I)  # the same bytes, moved
    for n, a in getattr(cf, f"unpack_{fmt}", layout._module().unpack)(r).items():
        np.testing.assert_array_equal(_raw(a), _raw(banks[n]))
    return r


def check_pair_round_trip(fmt, source, banks, H, I):  # noqa: E741
    """A pair-group layout (fp8_block_x16, bf16_x16) from `source` banks: check_moved, and it holds row 16 g + rr's
    K pair p at elements 32 p + 2 rr (expert 1, down)."""
    r = check_moved(fmt, source, banks, H, I)
    src, dst = _raw(banks["down"]), _raw(r["down"])
    for g, rr, p in [(0, 0, 0), (min(1, H // 16 - 1), 15, I // 2 - 1), (H // 16 - 1, 7, 3)]:
        o = 32 * p + 2 * rr
        np.testing.assert_array_equal(dst[1, g, o:o + 2], src[1, 16 * g + rr, 2 * p:2 * p + 2])
    return r


def check_pair_layout_errors(fmt, source, rng):
    """The schema and shape errors a pair-group layout raises: wrong group count, rows not whole pairs of 16
    values, odd gate_up groups, the source's row-major banks under the layout's name, H not a multiple of 16 (the
    source takes any), a mode it lacks."""
    small = cf.get_format(fmt).random_banks(2, 96, 64, rng)
    with pytest.raises(ValueError, match="down.*expected shape"):
        cf.validate_banks(fmt, dict(small, down=small["down"][:, :4]))
    with pytest.raises(ValueError, match="multiples of 16"):
        cf.validate_banks(fmt, dict(small, down=small["down"][:, :, :100]))
    with pytest.raises(ValueError, match="gate_up"):
        cf.validate_banks(fmt, dict(small, gate_up=small["gate_up"][:, :-1]))
    with pytest.raises(ValueError):
        cf.validate_banks(fmt, source.random_banks(2, 96, 64, rng))
    with pytest.raises(ValueError, match="multiples of 16"):
        cf.get_format(fmt).repack_from(source.random_banks(1, 100, 64, rng))
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(fmt, 2, 96, 64, mode="w4a8")
    with pytest.raises(ValueError, match="multiples of 16"):
        cf.Kernel(fmt, 2, 88, 64)


def down_bits(fmt, banks, tier, gs, H):  # noqa: N803
    """The fp32 down accumulators [n, H] of one work item over all rows as uint32 bits: routes j of expert 0, the
    bf16 bits gs[j], weight 1, accumulators from -0.0, so each is the dot itself with its sign of zero and its
    subnormals (-0.0 + d = d)."""
    E, _, I = cf.validate_banks(fmt, banks)  # noqa: E741
    k = cf.Kernel(fmt, E, H, I, isa=tier)
    bufs = [prep(k, g) for g in gs]
    acc = cf.aligned_empty((len(gs), H), np.float32)
    acc[...] = -0.0
    k._k.down(views(fmt, banks), 0, H, [(j, 0, 1.0, bufs[j].ctypes.data) for j in range(len(gs))], acc.ctypes.data, H)
    return acc.view(np.uint32).copy()


def fma_tiers(fmt):
    """The pair layout's fp32-FMA tiers (x16_fma.h) that this CPU runs. Not avx512bf16: vdpbf16ps reads subnormal
    weights as zero (DAZ on both sources), which scalar's dp_step does not (test_bf16_x16.test_vdpbf16ps_daz)."""
    return [t for t in ("avx2", "avx512f") if t in cf.get_format(fmt).kernel_tiers["native"] and t in USABLE]


def check_like_scalar(fmt, banks, g, H, rng, expect=None):  # noqa: N803
    """Every fp32-FMA tier gives scalar's down bits for 1 route of g (the lone-route path, two groups a call), and
    3 and 9 routes alternating g with a random vector (the token-block paths). expect {row: value}: scalar's dot
    of g at those rows (the cases' intended values)."""
    other = to_bf16_bits(rng.standard_normal(g.size))
    tiers = fma_tiers(fmt)
    if not tiers:
        pytest.skip(f"this CPU runs none of {fmt}'s fp32-FMA tiers")
    for n in (1, 3, 9):
        gs = [g if j % 2 == 0 else other for j in range(n)]
        ref = down_bits(fmt, banks, "scalar", gs, H)
        for r, v in (expect or {}).items():
            assert ref[0, r] == np.float32(v).view(np.uint32), (r, ref[0, r].view(np.float32), v)
        for t in tiers:
            np.testing.assert_array_equal(down_bits(fmt, banks, t, gs, H), ref, err_msg=f"{t}, {n} routes")


def check_tiers_bit_identical(fmt, rng, tier, T, mode="w4a8", shape=(4, 768, 512)):  # noqa: N803
    """A layer's output and one work item's fp32 down accumulators (bf16 outputs would hide a reordered fp32 sum) of
    the forced tier, bit for bit the scalar tier's."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    E, H, I = shape  # noqa: E741
    b = cf.get_format(fmt).random_banks(E, H, I, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = routes(rng, T, 3, E)
    ys, yt = (run_forced(fmt, b, x, w, ids, mode, t) for t in ("scalar", tier))
    np.testing.assert_array_equal(yt.view(np.uint64), ys.view(np.uint64))
    gs = to_bf16_bits(rng.standard_normal((T, I)) * rng.uniform(0.01, 10.0, (T, 1)))
    a0, a1 = down_accumulators(fmt, b, ("scalar", tier), gs, H, mode=mode)
    np.testing.assert_array_equal(a1.view(np.uint32), a0.view(np.uint32))


def kquant_records(fmt, rng, mode, tier, nbytes):
    """A K = 1024 activation's w4a8 records from fmt's kernel at tier (nbytes a 256-block, checked against the
    kernel's act_bytes), with the codes and d_a they must hold (numerics.int8_blocks): 4 blocks of scales 1e-6 ..
    1e6, an all-zero block (d = 0) and a NaN block (d = NaN, codes 0) among them. Returns rec [4, nbytes], q_ref,
    d_ref."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 1024
    k = cf.Kernel(fmt, 1, K, K, mode=mode, isa=tier)
    assert k._k.act_bytes(K) == nbytes * (K // 256)
    v = rng.standard_normal(K) * np.repeat(10.0 ** rng.uniform(-6, 6, K // 256), 256)
    v[256:512] = 0
    v[700] = np.nan
    bits = to_bf16_bits(v)
    rec = np.asarray(prep(k, bits)[:nbytes * (K // 256)]).reshape(-1, nbytes)
    q_ref, d_ref = cf.numerics.int8_blocks((bits.astype(np.uint32) << 16).view(np.float32), 256)
    return rec, q_ref, d_ref


def check_kquant_record(fmt, rng, mode, tier):
    """q4_k_x16's / q5_k_x16's w4a8 record, per 256-block 288 bytes: the codes and d_a bit for bit, then the int16
    sum of each 32 codes, then zeros (kquant_records' blocks)."""
    rec, q_ref, d_ref = kquant_records(fmt, rng, mode, tier, 288)
    np.testing.assert_array_equal(rec[:, :256].view(np.int8), q_ref)
    np.testing.assert_array_equal(rec[:, 256:260].copy().view(np.uint32).ravel(), d_ref.view(np.uint32))
    np.testing.assert_array_equal(rec[:, 260:276].copy().view(np.int16),
                                  q_ref.reshape(-1, 8, 32).astype(np.int32).sum(-1))
    assert (rec[:, 276:] == 0).all()


def check_kquant_x16_schema(layout, source, fmt_id, rng):
    """q5_k_x16's / q6_k_x16's schema (modes w4a8 and native, alias SOURCE_cpu) and the errors of its banks, its
    repack and its kernels; layout / source: the formats' modules."""
    fmt, src, gb = layout.SPEC.name, source.SPEC.name, layout.GB
    b = layout.SPEC.random_banks(3, 2048, 768, rng)
    assert cf.validate_banks(fmt, b) == (3, 2048, 768)
    assert layout.SPEC.id == fmt_id and cf.get_format(f"{src}_cpu") is layout.SPEC
    assert layout.SPEC.modes == ("w4a8", "native")
    assert fmt in cf.formats.CPU_LAYOUTS and fmt not in cf.formats.WEIGHT_FORMATS
    small = layout.SPEC.random_banks(2, 256, 512, rng)
    with pytest.raises(ValueError, match="down.*expected shape"):
        cf.validate_banks(fmt, dict(small, down=small["down"][:, :, :gb]))
    with pytest.raises(ValueError, match=str(gb)):
        cf.validate_banks(fmt, dict(small, down=small["down"][:, :, :100]))
    with pytest.raises(ValueError, match="gate_up"):
        cf.validate_banks(fmt, dict(small, gate_up=small["gate_up"][:, :-1]))
    with pytest.raises(TypeError, match="down.*uint8"):
        cf.validate_banks(fmt, dict(small, down=small["down"].view(np.int8)))
    with pytest.raises(ValueError):  # the source's row-major banks under this name
        cf.validate_banks(fmt, source.SPEC.random_banks(2, 256, 512, rng))
    with pytest.raises(ValueError, match=f"{src}: H and I must be positive multiples of 256"):  # repack validates
        getattr(cf, f"repack_{fmt}")(dict(source.SPEC.random_banks(2, 256, 512, rng), down=small["down"]))
    with pytest.raises(ValueError, match="mode"):
        cf.Kernel(fmt, 2, 256, 256, mode="w8a8")
    with pytest.raises(ValueError, match="multiples of 256"):
        cf.Kernel(fmt, 2, 128, 256)
    g = layout.to_groups(source.SPEC.random_banks(1, 256, 256, rng)["down"])
    np.testing.assert_array_equal(layout.to_groups(layout.from_groups(g)), g)
