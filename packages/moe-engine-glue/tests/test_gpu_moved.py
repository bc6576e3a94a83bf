"""gpu/moved.py: the GPU loads experts from banks in a CPU layout (q4_0_x16, fp8_block_x16, ...), so a hybrid runner
keeps one host copy. Every layout that moves a GPU format's bytes gives, loaded through the device-side gather, the
same device tensors bit for bit as its source banks loaded directly, for one expert and for a range; a layout that
computes (mxfp4_x16) is refused. Runs on CPU tensors (layouts.to_device works on any torch device)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import cpumoe_formats as cf
from moe_engine.gpu import layouts, moved

# (layout, source, H, I): the shapes are ragged where the layout allows (fp8_block_x16 takes multiples of 16,
# not of its 128 block: a partial scale block), the K-quants' 256
CASES = [("bf16_x16", "bf16", 96, 48), ("fp8_block_x16", "fp8_block", 272, 144),
         ("nvfp4_x16", "nvfp4", 96, 48), ("q4_0_x16", "q4_0", 96, 64), ("q8_0_x16", "q8_0", 96, 64),
         ("q4_k_x16", "q4_k", 256, 256), ("q6_k_x16", "q6_k", 256, 512)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype != torch.float32 else t.view(torch.int32)


@pytest.mark.parametrize("layout,src,H,I", CASES)
def test_moved_load_equals_the_source(layout, src, H, I, rng):  # noqa: E741
    assert moved.source(layout, H, I) == src and moved.source(src, H, I) == src
    sb = cf.get_format(src).random_banks(7, H, I, rng)
    lb = cf.get_format(layout).repack_from(sb)
    mv = {r: moved.MovedRole(layout, r, H, I, "cpu") for r in layouts.ROLES}
    for e in (0, 6, slice(2, 5), slice(0, 7)):
        want = layouts.to_device(src, sb, e, H, I, "cpu")
        got = layouts.to_device(src, lb, e, H, I, "cpu", moved=mv)
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, (k, e)
            assert torch.equal(_bits(got[k]), _bits(want[k])), (layout, k, e)


def test_a_layout_that_computes_is_not_moved(rng):
    """mxfp4_x16 rebuilds mxfp4's scales and mxfp4_panel pads its panels: neither is a permutation of mxfp4's
    bytes, so the GPU cannot load from them (None); ds_fp4 has no GPU kernel."""
    assert moved.source("mxfp4_x16", 96, 64) is None
    assert moved.source("mxfp4_panel", 96, 64) is None
    assert moved.source("ds_fp4_x16", 256, 128) is None  # ds_fp4 has no GPU kernel
    with pytest.raises(ValueError, match="is not another format's bytes moved"):
        moved.MovedRole("mxfp4_x16", "gate_up", 96, 64, "cpu")


def test_padded_scale_banks(rng):
    """fp8_block's scale banks may be wider than the schema (padded_last); the moved load takes the schema's
    columns, as the direct load does."""
    H, I = 272, 144  # noqa: E741
    sb = cf.get_format("fp8_block").random_banks(3, H, I, rng)
    lb = cf.get_format("fp8_block_x16").repack_from(sb)
    for k in ("gate_up_scale", "down_scale"):
        a = lb[k]
        wide = np.zeros(a.shape[:-1] + (a.shape[-1] + 5,), a.dtype)
        wide[..., :a.shape[-1]] = a
        wide[..., a.shape[-1]:] = np.float32(np.nan)  # never read
        lb[k] = wide[..., :]
    mv = {r: moved.MovedRole("fp8_block_x16", r, H, I, "cpu") for r in layouts.ROLES}
    want = layouts.to_device("fp8_block", sb, 1, H, I, "cpu")
    got = layouts.to_device("fp8_block", lb, 1, H, I, "cpu", moved=mv)
    assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)


def test_pair_layers(rng):
    """A Q4_K_M layer run as (q4_k_x16, q6_k_x16): each matrix moves on its own."""
    H, I = 256, 256  # noqa: E741
    gu = cf.get_format("q4_k").random_banks(4, H, I, rng)
    dn = cf.get_format("q6_k").random_banks(4, H, I, rng)
    sb = {"gate_up": gu["gate_up"], "down": dn["down"]}
    lb = {"gate_up": cf.get_format("q4_k_x16").repack_from(gu)["gate_up"],
          "down": cf.get_format("q6_k_x16").repack_from(dn)["down"]}
    mv = {"gate_up": moved.MovedRole("q4_k_x16", "gate_up", H, I, "cpu"),
          "down": moved.MovedRole("q6_k_x16", "down", H, I, "cpu")}
    want = layouts.to_device(("q4_k", "q6_k"), sb, slice(1, 3), H, I, "cpu")
    got = layouts.to_device(("q4_k", "q6_k"), lb, slice(1, 3), H, I, "cpu", moved=mv)
    assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)
