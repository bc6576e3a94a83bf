#!/usr/bin/env python3
"""Our GGUF quantizers (cpumoe_formats q8_0, q4_k, q5_k, q6_k quantize_rows) against ggml's own reference quantizers
(ggml-quants.c quantize_row_{q8_0,q4_K,q5_K,q6_K}_ref) on the same float rows, byte for byte.

    PYTHONPATH=packages/cpumoe-formats/src python3 bench/llamacpp/check_quantizers.py [--rows 4096] [--seed 123]

Needs .ggml/ (bench/llamacpp/fetch_ggml.sh) and gcc. ggml-quants.c is compiled twice into a scratch shared library,
-O2 -march=native with -ffp-contract=off (C's evaluation, which ours reproduces) and with GCC's default
-ffp-contract=fast (what a llama.cpp build does where the CPU has FMA: the scale searches' sums then fuse, and pick
another candidate scale for some blocks). Prints, per type and build, how many rows of 256 differ; exit status 1
where the -ffp-contract=off build differs anywhere.
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from cpumoe_formats.formats import q4_k, q5_k, q6_k, q8_0

ROOT = Path(__file__).resolve().parents[2]
STUBS = r"""
#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char* f, int l, const char* fmt, ...) { (void)f; (void)l; (void)fmt; abort(); }
size_t ggml_row_size(int t, long n) { (void)t; (void)n; abort(); }
const char* ggml_type_name(int t) { (void)t; return "?"; }
size_t ggml_type_size(int t) { (void)t; abort(); }
"""  # the few ggml symbols ggml-quants.c refers to outside the reference quantizers (never called here)
TYPES = (("q8_0", q8_0, 32), ("q4_K", q4_k, 256), ("q5_K", q5_k, 256), ("q6_K", q6_k, 256))


def build(tmp: Path, contract: str) -> ctypes.CDLL:
    g = ROOT / ".ggml" / "ggml"
    (tmp / "stubs.c").write_text(STUBS)
    so = tmp / f"libquants_{contract}.so"
    subprocess.run(["gcc", "-O2", "-march=native", f"-ffp-contract={contract}", "-fPIC", "-shared", "-w",
                    f"-I{g / 'include'}", f"-I{g / 'src'}", str(g / "src" / "ggml-quants.c"), str(tmp / "stubs.c"),
                    "-o", str(so), "-lm"], check=True)
    return ctypes.CDLL(str(so))


def rows(n: int, seed: int) -> np.ndarray:
    """Normal weights at 0.02, every 7th row scaled by 1e-3 .. 1e2, an all-zero row, a partly zero one, a positive
    one and one with an outlier."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, 256)) * np.float32(0.02)).astype(np.float32)
    x[::7] *= np.float32(10.0) ** rng.integers(-3, 3, (len(x[::7]), 1)).astype(np.float32)
    x[5] = 0
    x[9, :64] = 0
    x[11] = np.abs(x[11])
    x[13, 100] = 1.0
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=123)
    o = ap.parse_args()
    if not (ROOT / ".ggml" / "ggml" / "src" / "ggml-quants.c").is_file():
        print("check_quantizers: no .ggml/ sources (run bench/llamacpp/fetch_ggml.sh)", file=sys.stderr)
        return 2
    x = rows(o.rows, o.seed)
    failed = False
    with tempfile.TemporaryDirectory() as d:
        for contract in ("off", "fast"):
            lib = build(Path(d), contract)
            for name, mod, qk in TYPES:
                fn = getattr(lib, f"quantize_row_{name}_ref")
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                want = np.zeros((o.rows, 256 // qk * mod.BLOCK_BYTES), np.uint8)
                fn(x.ctypes.data, want.ctypes.data, x.size)
                bad = int((mod.quantize_rows(x) != want).any(axis=1).sum())
                print(f"{name}: -ffp-contract={contract}: {bad} of {o.rows} rows of 256 differ")
                failed |= contract == "off" and bad > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
