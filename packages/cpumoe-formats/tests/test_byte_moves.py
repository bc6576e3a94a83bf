"""byte_moves (formats/_moves.py): a CPU layout whose repack only moves its source's bytes is built by one gather per
bank. For every CPU layout: the gather equals the layout module's own repack bit for bit on fresh random banks, at
ragged shapes and with padded scale banks; its inverse equals the module's unpack; the layouts that compute or pad
have none (and to_layout then runs the module's repack)."""
import sys

import numpy as np
import pytest

import cpumoe_formats as cf

# (layout, H, I): small shapes the layout takes, ragged where it allows (fp8_block_x16: multiples of 16, not 128)
MOVES = [("bf16_x16", 96, 48), ("fp8_block_x16", 272, 144), ("nvfp4_x16", 96, 48), ("q4_0_x16", 96, 64),
         ("q8_0_x16", 96, 64), ("q4_k_x16", 256, 256), ("q5_k_x16", 256, 512), ("q6_k_x16", 512, 256)]
NOT_MOVES = [("mxfp4_x16", 96, 64), ("mxfp4_panel", 96, 64), ("ds_fp4_x16", 256, 128)]


def _module(name):
    return sys.modules[type(cf.get_format(name)).__module__]


def _same(a, b) -> bool:
    """Equal bytes; where b's last dim is wider (a padded scale bank, which the module's repack copies as it is and
    the gather cuts to the schema's width), a's columns against b's first ones."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape[:-1] == b.shape[:-1] and a.shape[-1] < b.shape[-1]:
        b = np.ascontiguousarray(b[..., :a.shape[-1]])
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_every_cpu_layout_is_listed():
    assert sorted(n for n, _, _ in MOVES + NOT_MOVES) == sorted(cf.formats.CPU_LAYOUTS)


@pytest.mark.parametrize("layout,H,I", MOVES)
def test_gather_equals_the_repack(layout, H, I, rng):  # noqa: E741
    m = cf.byte_moves(layout, H, I)
    assert m is not None and m.layout == layout
    src = cf.get_format(m.source)
    banks = src.random_banks(5, H, I, rng)
    want = _module(layout).repack(banks)
    got = m.apply(banks)
    assert set(got) == set(want)
    for k in want:
        assert _same(got[k], want[k]), k
        assert got[k].ctypes.data % 64 == 0
    via = src.to_layout(banks, layout, threads=2)  # to_layout gathers straight into the final arrays
    assert all(_same(via[k], want[k]) for k in want)
    sliced = m.apply(banks, threads=3)  # 5 experts in slices of 1, 2, 2
    assert all(_same(sliced[k], want[k]) for k in want)
    for role in cf.ROLES:  # one role's banks, as a two-format layer converts them
        mine = {n: banks[n] for n in src.role_banks(role)}
        got_role = src.to_layout_role(role, mine, layout, threads=2)
        assert set(got_role) == set(cf.get_format(layout).role_banks(role))
        assert all(_same(got_role[k], want[k]) for k in got_role)
    assert all(_same(cf.get_format(layout).from_source(banks)[k], want[k]) for k in want)
    cf.validate_banks(layout, got)
    # the inverse (the GPU's unpack, moe_engine gpu/moved.py) gives the source banks back
    inv = m.inverse()
    flat = np.concatenate([np.asarray(got[n]).view(np.uint8).reshape(5, -1) for n, _, _ in m.dst], axis=1)
    for n, shape, dt in m.src:
        back = np.ascontiguousarray(flat[:, inv[n]]).view(dt).reshape((5, *shape))
        assert _same(back, banks[n]), n


def test_padded_source_banks(rng):
    """fp8_block's scale banks may be wider than the schema: the gather reads the schema's columns."""
    H, I = 272, 144  # noqa: E741
    banks = cf.get_format("fp8_block").random_banks(3, H, I, rng)
    padded = dict(banks)
    for k in ("gate_up_scale", "down_scale"):
        a = banks[k]
        wide = np.full(a.shape[:-1] + (a.shape[-1] + 3,), np.nan, a.dtype)  # random_banks' padding, and more
        wide[..., :a.shape[-1]] = a
        padded[k] = wide
    got = cf.byte_moves("fp8_block_x16", H, I).apply(padded)
    want = _module("fp8_block_x16").repack(banks)
    assert all(_same(got[k], want[k]) for k in want)


@pytest.mark.parametrize("layout,H,I", NOT_MOVES)
def test_layouts_that_compute_have_none(layout, H, I, rng):  # noqa: E741
    assert cf.byte_moves(layout, H, I) is None


def test_dims_the_layout_refuses():
    assert cf.byte_moves("q4_k_x16", 96, 64) is None  # q4_k takes multiples of 256
    assert cf.byte_moves("bf16", 96, 64) is None  # not a CPU layout
