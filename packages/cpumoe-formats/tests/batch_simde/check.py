"""Driver of run.sh: every tier of bf16, fp8_block, nvfp4, ds_fp4 and q4_0 (AVX-512 / VNNI ones emulated by
SIMDe) through the package's own step, per (format, mode, tier, shape, routing):
  - batch == single-token steps bit for bit (ragged shapes, batch 9, duplicated and -1 routes);
  - the probe check of test_batch_identity.test_probe_cancels_exactly (y[probe] exactly 0), which sees any
    fp32 difference between the token-blocked and the single-token arithmetic;
  - the float64 reference within each format's test tolerance (ds_fp4: 2e-2, a sanity bound; its pytest
    computes a tighter one)."""

import ctypes
import os
import sys

import numpy as np

import cpumoe_formats as cf
from cpumoe_formats.numerics import BF16

TIERS = ["scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512bf16", "amx"]
FMT_ID = {"bf16": 0, "nvfp4": 1, "ds_fp4": 3, "q4_0": 4, "fp8_block": 5, "nvfp4_x16": 9}
TOL = {"bf16": 6e-3, "fp8_block": 5e-3, "nvfp4": 5e-3, "q4_0": 5e-3, "ds_fp4": 2e-2, "nvfp4_x16": 5e-3}
BITWISE = {"nvfp4_x16"}  # layouts whose tiers are defined to give scalar's bits
SHAPES = {  # ragged shapes (tails of every loop) and a model-like one
    "bf16": [(5, 1059, 331), (3, 2048, 768), (4, 2051, 8), (4, 515, 13), (3, 300, 32), (4, 96, 64)],  # tiny I
    "fp8_block": [(5, 1100, 300), (3, 2048, 512)],
    "nvfp4": [(5, 720, 368), (3, 2048, 512)],
    "ds_fp4": [(5, 640, 384), (3, 1024, 512)],
    "q4_0": [(5, 736, 416), (3, 2816, 704)],
    "nvfp4_x16": [(5, 720, 368), (3, 2048, 512), (4, 272, 144)],  # 45/23 groups, partial chunks; 17/9
}


class Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("format", "act", "mode", "on_input", "E", "H", "I")] + [
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
    ]


class Bank(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("es", ctypes.c_int64), ("rs", ctypes.c_int64)]


class Case:
    """One format at one shape: its banks, and a copy whose experts 0 and 1 are identical (the probe)."""

    def __init__(self, lib, fmt, E, H, I, rng):  # noqa: E741
        self.lib, self.fmt, self.E, self.H, self.I, self.rng = lib, fmt, E, H, I, rng
        self.spec = cf.get_format(fmt)
        self.banks = self.spec.random_banks(E, H, I, rng)
        self.pbanks = {n: a.copy() for n, a in self.banks.items()}
        for a in self.pbanks.values():
            a[1] = a[0]
        self.views = self._views(self.banks)
        self.pviews = self._views(self.pbanks)

    def _views(self, banks):
        arrays, _ = self.spec.validate(banks)
        return (Bank * 8)(*[Bank(*v) for v in self.spec.bank_views(arrays)])

    def step(self, mode, tier, x, w, ids, probe_banks=False):
        p = Params(FMT_ID[self.fmt], 0, 0 if mode == "native" else 1, 0, self.E, self.H, self.I, 1.0, float("inf"))
        xb = np.ascontiguousarray(x.astype(BF16))
        ids = np.ascontiguousarray(ids, np.int32)
        w = np.ascontiguousarray(w, np.float32)
        y = np.full((x.shape[0], self.H), 0x7FC1, np.uint16)
        rc = self.lib.bk_step(
            ctypes.byref(p),
            TIERS.index(tier),
            32,
            self.pviews if probe_banks else self.views,
            x.shape[0],
            ids.shape[1],
            xb.ctypes.data,
            ids.ctypes.data,
            w.ctypes.data,
            y.ctypes.data,
        )
        assert rc == 0, (self.fmt, mode, tier, rc)
        assert not (y == 0x7FC1).any(), "unwritten output"
        return y

    def probe_ok(self, mode, tier):
        T, rng = 9, self.rng
        x = rng.standard_normal((T, self.H), dtype=np.float32)
        w = rng.random((T, 3), dtype=np.float32) + 0.05
        for probe in (0, 4, T - 1):
            ids = rng.integers(2, self.E, (T, 3)).astype(np.int32)
            ids[:, 0] = 0
            ids[probe] = [0, 1, -1]
            w[probe, 1] = -w[probe, 0]
            if (self.step(mode, tier, x, w, ids, probe_banks=True)[probe] != 0).any():
                return False
        return True

    def run(self, routing, skip=frozenset()):
        """Yields (mode, tier, batch == single and probe ok, rel err vs reference) for every kernel."""
        rng, T, top_k = self.rng, 9, 4
        for mode, tiers in self.spec.kernel_tiers.items():
            tiers = [t for t in tiers if t not in skip]
            x = rng.standard_normal((T, self.H), dtype=np.float32)
            ids = rng.integers(0, self.E, (T, top_k)).astype(np.int32)
            if routing == "shared":
                ids[:] = ids[0]
            ids[0, 1] = ids[0, 0]  # duplicated expert
            ids[-1, 2] = -1
            w = rng.random((T, top_k), dtype=np.float32) + 0.05
            ref = cf.reference.moe(self.fmt, self.banks, x, w, ids, mode=mode)
            y0 = self.step(mode, tiers[0], x, w, ids)  # scalar
            for tier in tiers:
                y = self.step(mode, tier, x, w, ids)
                if self.fmt in BITWISE and not (y == y0).all():
                    yield mode, tier, False, float("nan")
                    continue
                same = all(
                    (y[t] == self.step(mode, tier, x[t : t + 1], w[t : t + 1], ids[t : t + 1])[0]).all()
                    for t in range(T)
                )
                err = float(np.abs(y.view(BF16).astype(np.float64) - ref).max() / np.abs(ref).max())
                yield mode, tier, same and self.probe_ok(mode, tier), err


def main(lib_path, seed=1):
    lib = ctypes.CDLL(lib_path)
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.bk_step.argtypes = [ctypes.POINTER(Params), i32, i32, ctypes.POINTER(Bank), i32, i32, vp, vp, vp, vp]
    rng = np.random.default_rng(seed)
    fails = 0
    only = [f for f in os.environ.get("BK_FORMATS", "").split(",") if f]  # e.g. BK_FORMATS=q4_0: one format
    skip = {t for t in os.environ.get("BK_SKIP_TIERS", "").split(",") if t}  # e.g. a tier not built this time
    for fmt, shapes in SHAPES.items():
        if only and fmt not in only:
            continue
        for E, H, I in shapes:  # noqa: E741
            case = Case(lib, fmt, E, H, I, rng)
            for routing in ("shared", "random"):
                for mode, tier, same, err in case.run(routing, skip):
                    ok = same and err < TOL[fmt]
                    fails += not ok
                    print(
                        f"{'ok  ' if ok else 'FAIL'} {fmt:9s} {mode:6s} {tier:10s} {routing:6s} H={H:4d} "
                        f"I={I:4d} batch==single+probe: {same}  rel err vs reference {err:.2e} "
                        f"(tol {TOL[fmt]:.0e})",
                        flush=True,
                    )
    print("all ok" if not fails else f"{fails} FAILED")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))
