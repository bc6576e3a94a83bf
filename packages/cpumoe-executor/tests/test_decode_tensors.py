"""CpuMoeExecutor.decode on CPU torch tensors as a router leaves them (x bf16, weights float32 or bf16, ids int32 or
int64): the native step reads them in place, with no torch op but y's allocation, bit-equal to the numpy path and to
the format's reference; int64 ids are range-checked before they are narrowed; anything else (strides, dtypes, an
out array) takes the general path with the same result."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import FORMATS, bits, executor_for, reference, step_inputs

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

FMTS = [f for f in ("bf16", "q4_0", "nvfp4") if f in FORMATS]


class Ops(TorchDispatchMode):
    """The aten ops run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def router_tensors(rng, ex, T, w_dtype, ids_dtype):
    """(x bf16, w, ids) torch tensors as transformers' routers return them, and their numpy equivalents (x bf16,
    w float32 holding w's values, ids int32) for the general path and the reference."""
    x, w, ids = step_inputs(rng, ex, T)
    xt = torch.from_numpy(x).to(torch.bfloat16)
    wt = torch.from_numpy(w).to(w_dtype)
    it = torch.from_numpy(ids).to(ids_dtype)
    xn = xt.view(torch.int16).numpy().view(np.uint16).view(bits_dtype())
    return (xt, wt, it), (xn, wt.float().numpy(), ids)


def bits_dtype():
    import cpumoe_formats as cf

    return cf.numerics.BF16


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ids_dtype", ["int64", "int32"])
def test_router_tensors_match_the_numpy_path_and_reference(fmt, w_dtype, ids_dtype, rng):
    ex, banks, _ = executor_for(fmt, rng)
    with ex:
        for T in (1, 3, 8):
            for layer in range(ex.num_layers):
                (xt, wt, it), (xn, wn, idn) = router_tensors(rng, ex, T, getattr(torch, w_dtype),
                                                             getattr(torch, ids_dtype))
                y = ex.decode(layer, xt, wt, it)
                assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and tuple(y.shape) == (T, ex.H)
                got = y.view(torch.int16).numpy().view(np.uint16)
                np.testing.assert_array_equal(got, bits(ex.decode(layer, xn, wn, idn)), err_msg=f"T={T}")
                np.testing.assert_array_equal(got, bits(reference(ex, banks, layer, xn, wn, idn)),
                                              err_msg=f"T={T} vs reference")


@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16"])
def test_router_tensors_run_no_torch_op_but_the_output(w_dtype, rng):
    """Each op costs tens of microseconds between a model's layers (cold caches): only y's allocation runs."""
    ex, _, _ = executor_for("bf16", rng)
    with ex:
        (xt, wt, it), _ = router_tensors(rng, ex, 1, getattr(torch, w_dtype), torch.int64)
        with Ops() as m:
            ex.decode(1, xt, wt, it)
        assert m.ops == ["aten.empty_like.default"]


def test_int64_ids_are_checked_before_they_are_narrowed(rng):
    ex, _, (E, _, _) = executor_for("bf16", rng)
    with ex:
        (xt, wt, it), _ = router_tensors(rng, ex, 2, torch.bfloat16, torch.int64)
        for bad in ((1 << 32) + 1, -(1 << 32), E, -2):  # the first two narrow to 1 and 0: valid ids as int32
            ids = it.clone()
            ids[1, 2] = bad
            with pytest.raises(ValueError, match=rf"topk_ids\[1, 2\] = {bad} is not in \[-1, {E}\)"):
                ex.decode(0, xt, wt, ids)
        # the native entry itself, on numpy int64 ids
        x, w, ids = step_inputs(rng, ex, 2)
        xb = x.astype(bits_dtype())
        ids64 = ids.astype(np.int64)
        ids64[0, 1] = 1 << 40
        y = np.empty((2, ex.H), bits_dtype())
        with pytest.raises(ValueError, match=rf"topk_ids\[0, 1\] = {1 << 40} is not in"):
            ex._x.decode(0, 2, xb.ctypes.data, ids64.ctypes.data, w.ctypes.data, y.ctypes.data, 8, False)
        with pytest.raises(ValueError, match="ids_bytes=2: expected 4"):
            ex._x.decode(0, 2, xb.ctypes.data, ids64.ctypes.data, w.ctypes.data, y.ctypes.data, 2, False)
        # a bad layer or batch is named as before, whatever the routing's dtypes
        with pytest.raises(ValueError, match=r"layer 5 is not in \[0, 2\)"):
            ex._x.decode(5, 2, xb.ctypes.data, ids64.ctypes.data, w.ctypes.data, y.ctypes.data, 8, True)
        with pytest.raises(ValueError, match=r"num_tokens 9 is not in \[1, max_tokens=8\]"):
            ex._x.decode(0, 9, xb.ctypes.data, ids64.ctypes.data, w.ctypes.data, y.ctypes.data, 8, True)


def test_other_tensors_take_the_general_path(rng):
    """Strided, float32 x, float16 weights, int16 ids, an out array, a batch over max_tokens: converted or refused
    as before, by name."""
    ex, banks, (E, H, _) = executor_for("bf16", rng)
    with ex:
        (xt, wt, it), (xn, wn, idn) = router_tensors(rng, ex, 3, torch.float32, torch.int64)
        want = bits(ex.decode(0, xn, wn, idn))
        strided_ids = it.t().contiguous().t()
        strided_x = torch.cat([xt, xt], 1)[:, :H]
        cases = {"strided ids": (xt, wt, strided_ids), "strided x": (strided_x, wt, it),
                 "float32 x": (xt.float(), wt, it), "float16 w": (xt, wt.half(), it),
                 "int16 ids": (xt, wt, it.to(torch.int16))}
        for name, (x, w, ids) in cases.items():
            with Ops() as m:
                y = ex.decode(0, x, w, ids)
            assert m.ops != ["aten.empty_like.default"], name
            ref = want if name != "float16 w" else bits(ex.decode(0, xn, wt.half().float().numpy(), idn))
            np.testing.assert_array_equal(y.view(torch.int16).numpy().view(np.uint16), ref, err_msg=name)
        out = np.empty((3, H), bits_dtype())
        assert ex.decode(0, xt, wt, it, out=out).data_ptr() == out.ctypes.data  # y written into out
        np.testing.assert_array_equal(bits(out), want)
        big = torch.zeros(9, H, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"batch size 9 .*max_tokens=8"):
            ex.decode(0, big, torch.ones(9, 4), torch.zeros(9, 4, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"expected top_k=4"):
            ex.decode(0, xt, torch.ones(3, 5), torch.zeros(3, 5, dtype=torch.int64))
