"""Tiers documented as bit-identical, compared bit for bit.

nvfp4 w4a8: avxvnni and avx512vnni compute avx2's integers and fp32 operations in avx2's order (the pair kernel
permutes its lanes back); ds_fp4 w4a8: avx512vnni forms avx512f's lane sums with vpdpbusd. The comparison is on
the fp32 down accumulators of a work item, which show a reassociated or reordered fp32 product that bf16 outputs
would mostly hide, and on the gate_up g. One route per expert (the multi-row single-token path) and 3 or 9 (the
multi-token paths, with a partial token block), ragged K (the scalar block tails).
"""

import numpy as np
import pytest
from conftest import USABLE
from fp4_helpers import kernel, run_down, run_gate_up, to_bf16_bits

import cpumoe_formats as cf

PAIRS = [("nvfp4", "avxvnni", "avx2"), ("nvfp4", "avx512vnni", "avx2"), ("ds_fp4", "avx512vnni", "avx512f")]
SHAPES = {"nvfp4": (2, 720, 368), "ds_fp4": (2, 640, 384)}  # (E, H, I): K % 128 tails for nvfp4, odd chunk counts


@pytest.mark.parametrize("fmt,tier,ref", PAIRS, ids=[f"{f}-{t}-vs-{r}" for f, t, r in PAIRS])
@pytest.mark.parametrize("n", [1, 3, 9])
def test_work_items_bit_identical(rng, fmt, tier, ref, n):
    if tier not in USABLE or ref not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier if tier not in USABLE else ref} tier")
    E, H, I = SHAPES[fmt]  # noqa: E741
    banks = cf.get_format(fmt).random_banks(E, H, I, rng)
    ka, kb = kernel(fmt, E, H, I, "w4a8", tier), kernel(fmt, E, H, I, "w4a8", ref)
    xs = to_bf16_bits(rng.standard_normal((n, H)))
    ga, gb = run_gate_up(ka, fmt, banks, 1, xs), run_gate_up(kb, fmt, banks, 1, xs)
    np.testing.assert_array_equal(ga, gb, err_msg=f"gate_up g of {tier} differs from {ref}")
    gs = to_bf16_bits(rng.standard_normal((n, I)) * rng.uniform(0.01, 10.0, (n, 1)))
    w = rng.uniform(0.1, 1.0, n)
    acc_a, acc_b = run_down(ka, fmt, banks, 1, gs, w), run_down(kb, fmt, banks, 1, gs, w)
    assert np.count_nonzero(acc_a) > acc_a.size // 2  # a real result, not an untouched buffer
    np.testing.assert_array_equal(acc_a, acc_b, err_msg=f"down accumulators of {tier} differ from {ref}")


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_x16"])
@pytest.mark.parametrize("tier", ["avx2", "avxvnni", "avx512vnni"])
def test_nvfp4_prep_nonfinite_matches_scalar(rng, fmt, tier):
    """nvfp4's w4a8 activation prep (fp4_common.h quant16: two 8-lane vectors at avx2 / avxvnni, one 16-lane vector
    from avx512bw) gives the scalar tier's bytes, in nvfp4's record and in nvfp4_x16's, for blocks holding inf, -inf
    and NaN (s = NaN, codes 0), all-zero blocks,
    halfway codes (amax 127: s = 1, so 2.5 -> 2, 3.5 -> 4, -0.5 -> -0: round half to even), bf16 subnormals (1 / s
    overflows to inf: codes +-127 and 0 * inf -> 0), and ordinary ones, in nvfp4's 128-groups and its 16-block tail."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    K = 400 if fmt == "nvfp4" else 512
    v = rng.standard_normal(K).astype(np.float32)
    v[3], v[20], v[37], v[300], v[390] = np.inf, -np.inf, np.nan, np.nan, np.inf
    v[64:80] = 0
    v[80:96] = [127.0, 2.5, 3.5, -0.5, 0.5, -1.5, 126.5, -126.5, 1.5, -2.5, 4.5, -3.5, 0.0, -0.0, 5.5, 6.5]
    v[96:112] = rng.choice([-1.0, 1.0], 16) * rng.uniform(1, 2, 16) * np.float32(2.0**-133)  # bf16 subnormals
    v[96] = 0.0
    bits = to_bf16_bits(v)
    assert (bits[96:112] & 0x7F80 == 0).all() and (bits[97:112] & 0x7F != 0).all()  # subnormal, not flushed
    ka, ks = kernel(fmt, 1, K, K, "w4a8", tier), kernel(fmt, 1, K, K, "w4a8", "scalar")
    n = ka._k.act_bytes(K)
    assert n == ks._k.act_bytes(K)

    def prepped(k):  # the same poison in both, so the layout's padding bytes (never written) compare equal
        buf = cf.aligned_empty((n,), np.uint8)
        buf[...] = 0xAB
        k._k.prep_act(bits.ctypes.data, K, buf.ctypes.data)
        return buf

    got, want = prepped(ka), prepped(ks)
    assert np.count_nonzero(want != 0xAB) > K // 2  # written
    np.testing.assert_array_equal(got, want)
