"""FormatSpec.to_layout in expert slices on threads (_arrays.split_experts): the same bytes as one slice."""
import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats._arrays import split_experts

CHAINS = [("mxfp4", "mxfp4_panel"), ("mxfp4", "mxfp4_x16"), ("mxfp4_panel", "mxfp4_x16"), ("nvfp4", "nvfp4_x16"),
          ("q4_0", "q4_0_x16"), ("ds_fp4", "ds_fp4_x16"), ("fp8_block", "fp8_block_x16"), ("bf16", "bf16_x16")]


@pytest.mark.parametrize("src,dst", CHAINS)
def test_threads_give_the_same_bytes(src, dst):
    spec = cf.get_format(src)
    H, I = (256, 128) if src != "ds_fp4" else (256, 256)  # noqa: E741 - ds_fp4: multiples of 128
    b = spec.random_banks(5, H, I, np.random.default_rng(3))
    one = spec.to_layout(b, dst, threads=1)
    many = spec.to_layout(b, dst, threads=3)  # 5 experts in slices of 1, 2, 2
    assert set(one) == set(many) == set(cf.get_format(dst).bank_names)
    for k in one:
        assert many[k].dtype == one[k].dtype and many[k].shape == one[k].shape
        assert np.array_equal(np.asarray(many[k]).view(np.uint8), np.asarray(one[k]).view(np.uint8)), k
        assert many[k].ctypes.data % 64 == 0
    cf.validate_banks(dst, many)


def test_split_experts_slices_and_fallbacks():
    seen = []

    def fn(b):
        seen.append(b["a"].shape[0])
        return {"y": b["a"] * 2, "z": b["b"][:, :1].copy()}

    a, b = np.arange(14.0).reshape(7, 2), np.ones((7, 3))
    out = split_experts(fn, {"a": a, "b": b}, threads=3)
    assert sorted(seen) == [2, 2, 3] and np.array_equal(out["y"], a * 2) and out["z"].shape == (7, 1)
    seen.clear()
    split_experts(fn, {"a": a, "b": np.ones((6, 3))}, threads=3)  # no common first axis: fn on the whole banks
    assert seen == [7]
    seen.clear()
    split_experts(fn, {"a": a[:1], "b": b[:1]}, threads=8)  # one expert: one call
    assert seen == [1]


def test_to_layout_runs_in_slices(monkeypatch):
    """to_layout hands a chain that is no byte move (mxfp4 -> mxfp4_panel pads) to split_experts: 3 threads, 5
    experts -> 3 calls of the per-slice chain; a byte move (nvfp4 -> nvfp4_x16) is gathered without it."""
    spec = cf.get_format("mxfp4")
    b = spec.random_banks(5, 64, 64, np.random.default_rng(4))
    calls = []
    one = type(spec)._to_layout_one
    monkeypatch.setattr(type(spec), "_to_layout_one", lambda s, banks, name: calls.append(
        banks["gate_up_blocks"].shape[0]) or one(s, banks, name))
    spec.to_layout(b, "mxfp4_panel", threads=3)
    assert sorted(calls) == [1, 2, 2]
    assert spec.to_layout(b, "mxfp4") is b  # its own name: the banks as given, no copy
    spec = cf.get_format("nvfp4")
    b = spec.random_banks(5, 64, 32, np.random.default_rng(4))
    calls.clear()
    monkeypatch.setattr(type(spec), "_to_layout_one", lambda s, banks, name: calls.append(1) or one(s, banks, name))
    spec.to_layout(b, "nvfp4_x16", threads=3)
    assert calls == []
    assert spec.to_layout(b, "nvfp4") is b
