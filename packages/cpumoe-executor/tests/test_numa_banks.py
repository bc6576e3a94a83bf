"""numa_banks: a layer cut by I for numa='split', every format. Each slice must be valid banks of the format with
I = i1 - i0 holding exactly the slice's weights (float64 dequantize: gate rows i0..i1, up rows I+i0..I+i1, down
columns i0..i1; biases: gate/up's slice, down's on slice 0 only), and join must give the layer's weights back."""
import numpy as np
import pytest
from conftest import FORMATS

import cpumoe_formats as cf
from cpumoe_executor import numa, numa_banks

# Test shapes whose I can be cut in two and three (fp8_block's 128-row blocks: I a multiple of 128; the executor's
# SHAPES keep ragged ones for the single pool).
SHAPES = {"fp8_block": (259, 384), "fp8_block_x16": (272, 384), "bf16": (96, 40)}


def shape(fmt):
    spec = cf.get_format(fmt)
    return SHAPES.get(fmt, (max(96, spec.k_multiple), max(96, 3 * spec.k_multiple)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_slice_holds_its_rows_and_join_gives_the_layer_back(fmt, rng):
    spec = cf.get_format(fmt)
    H, I = shape(fmt)  # noqa: E741
    banks = spec.random_banks(4, H, I, rng)
    unit = numa_banks.cut_unit(spec, I)
    if spec.round_route_term:
        assert isinstance(unit, str) and "rounds each route's whole down term" in unit
        with pytest.raises(ValueError, match="rounds each route's whole down term"):
            numa_banks.cut(spec, banks, (0, I // 2, I))
        return
    assert isinstance(unit, int) and I % spec.k_multiple == 0
    gu, dn = spec.dequantize(banks)
    gb, db = spec.biases(banks)
    for n in (2, 3):
        if -(-I // unit) < n:
            continue
        bounds = numa.cut_bounds(I, unit, [1] * n)
        parts = numa_banks.cut(spec, banks, bounds)
        assert len(parts) == n
        for (i0, i1), p in zip(zip(bounds, bounds[1:]), parts):
            _, (e, h, i) = spec.validate(p)
            assert (e, h, i) == (4, H, i1 - i0)
            pg, pd = spec.dequantize(p)
            np.testing.assert_array_equal(pg[:, :i], gu[:, i0:i1])
            np.testing.assert_array_equal(pg[:, i:], gu[:, I + i0:I + i1])
            np.testing.assert_array_equal(pd, dn[:, :, i0:i1])
            pgb, pdb = spec.biases(p)
            if gb is not None:
                np.testing.assert_array_equal(pgb, np.concatenate([gb[:, i0:i1], gb[:, I + i0:I + i1]], axis=1))
                np.testing.assert_array_equal(pdb, db if i0 == 0 else np.zeros_like(db))
            for a in spec.validate(p)[0]:
                assert a.ctypes.data % 64 == 0  # new aligned arrays, never views of the layer
        back = numa_banks.join(spec, parts)
        _, dims = spec.validate(back)
        assert dims == (4, H, I)
        jg, jd = spec.dequantize(back)
        np.testing.assert_array_equal(jg, gu)
        np.testing.assert_array_equal(jd, dn)


def test_fp8_block_needs_whole_128_row_blocks():
    spec = cf.get_format("fp8_block")
    assert numa_banks.cut_unit(spec, 256) == 128
    assert "shares blocks of 128 rows between gate and up where I=131" in numa_banks.cut_unit(spec, 131)


def test_units_follow_the_layout_rules():
    unit = {f: numa_banks.cut_unit(cf.get_format(f), 768) for f in FORMATS}
    want = {"bf16": 1, "bf16_x16": 16, "q4_0": 32, "q4_0_x16": 32, "nvfp4": 16, "nvfp4_x16": 16, "mxfp4": 32,
            "mxfp4_panel": 32, "mxfp4_x16": 32, "fp8_block": 128, "fp8_block_x16": 128, "q8_0": 32, "q8_0_x16": 32,
            "q4_k": 256, "q4_k_x16": 256, "q5_k": 256, "q5_k_x16": 256, "q6_k": 256,
            "q6_k_x16": 256}
    assert {f: u for f, u in unit.items() if isinstance(u, int)} == {f: u for f, u in want.items() if f in unit}
