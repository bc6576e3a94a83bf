"""Driver of run.sh: every tier of bf16, fp8_block, nvfp4, ds_fp4 and q4_0 (AVX-512 / VNNI ones emulated by
SIMDe) through the package's own step: batch == single-token steps bit for bit, and the float64 reference
within each format's test tolerance (ds_fp4: 2e-2, a sanity bound; its pytest computes a tighter one)."""
import ctypes
import sys

import numpy as np

import cpumoe_formats as cf
from cpumoe_formats.numerics import BF16

TIERS = ["scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512bf16"]
FMT_ID = {"bf16": 0, "nvfp4": 1, "ds_fp4": 3, "q4_0": 4, "fp8_block": 5}
TOL = {"bf16": 6e-3, "fp8_block": 5e-3, "nvfp4": 5e-3, "q4_0": 5e-3, "ds_fp4": 2e-2}
SHAPES = {  # ragged shapes (tails of every loop) and a model-like one
    "bf16": [(5, 1059, 331), (3, 2048, 768)],
    "fp8_block": [(5, 1100, 300), (3, 2048, 512)],
    "nvfp4": [(5, 720, 368), (3, 2048, 512)],
    "ds_fp4": [(5, 640, 384), (3, 1024, 512)],
    "q4_0": [(5, 736, 416), (3, 2816, 704)],
}


class Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("format", "act", "mode", "on_input", "E", "H", "I")] + \
               [("alpha", ctypes.c_float), ("limit", ctypes.c_float)]


class Bank(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("es", ctypes.c_int64), ("rs", ctypes.c_int64)]


def main(lib_path):
    lib = ctypes.CDLL(lib_path)
    rng = np.random.default_rng(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    fails = 0
    for fmt, shapes in SHAPES.items():
        spec = cf.get_format(fmt)
        for E, H, I in shapes:  # noqa: E741
            banks = spec.random_banks(E, H, I, rng)
            arrays, _ = spec.validate(banks)
            bv = (Bank * 8)(*[Bank(*v) for v in spec.bank_views(arrays)])

            def step(mode, tier, x, w, ids):
                p = Params(FMT_ID[fmt], 0, 0 if mode == "native" else 1, 0, E, H, I, 1.0, float("inf"))
                xb = np.ascontiguousarray(x.astype(BF16))
                ids = np.ascontiguousarray(ids, np.int32)
                w = np.ascontiguousarray(w, np.float32)
                y = np.full((x.shape[0], H), 0x7FC1, np.uint16)
                rc = lib.bk_step(ctypes.byref(p), TIERS.index(tier), 32, bv, x.shape[0], ids.shape[1],
                                 xb.ctypes.data, ids.ctypes.data, w.ctypes.data, y.ctypes.data)
                assert rc == 0, (fmt, mode, tier, rc)
                assert not (y == 0x7FC1).any(), "unwritten output"
                return y

            for mode, tiers in spec.kernel_tiers.items():
                for routing in ("shared", "random"):
                    T, top_k = 9, 4
                    x = rng.standard_normal((T, H), dtype=np.float32)
                    ids = rng.integers(0, E, (T, top_k)).astype(np.int32)
                    if routing == "shared":
                        ids[:] = ids[0]
                    ids[0, 1] = ids[0, 0]  # duplicated expert
                    ids[-1, 2] = -1
                    w = rng.random((T, top_k), dtype=np.float32) + 0.05
                    ref = cf.reference.moe(fmt, banks, x, w, ids, mode=mode)
                    for tier in tiers:
                        y = step(mode, tier, x, w, ids)
                        same = all((y[t] == step(mode, tier, x[t:t + 1], w[t:t + 1], ids[t:t + 1])[0]).all()
                                   for t in range(T))
                        yf = y.view(BF16).astype(np.float64)
                        err = float(np.abs(yf - ref).max() / np.abs(ref).max())
                        ok = same and err < TOL[fmt]
                        fails += not ok
                        print(f"{'ok  ' if ok else 'FAIL'} {fmt:9s} {mode:6s} {tier:10s} {routing:6s} H={H:4d} I={I:4d} "
                              f"batch==single: {same}  rel err vs reference {err:.2e} (tol {TOL[fmt]:.0e})",
                              flush=True)
    print("all ok" if not fails else f"{fails} FAILED")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
