# Called by: ci/check_wheel.sh (nox -s package-check-<pkg>, tests-integration/test_packaging.py), on the wheel.
"""Smoke test of an installed cpumoe-formats wheel, alone (no test extras, no torch).

A tiny bf16 MoE step through the kernels at every tier this CPU runs, against the float64
reference; the shipped C ABI header; the import came from the install, not a source tree.
"""
import sys
from pathlib import Path

import numpy as np

import cpumoe_formats as cf

assert "site-packages" in cf.__file__, f"imported from {cf.__file__}, not from an installed wheel"
assert (Path(cf.get_include()) / "cpumoe_formats" / "abi.h").is_file(), "abi.h is not in the wheel"

rng = np.random.default_rng(0)
E, H, I, K, T = 4, 96, 40, 2, 3
banks = cf.quantize("bf16", rng.standard_normal((E, 2 * I, H), np.float32) * 0.1,
                    rng.standard_normal((E, H, I), np.float32) * 0.1)
x = rng.standard_normal((T, H), np.float32)
w = rng.random((T, K), np.float32) + 0.05
ids = np.array([[0, 1], [3, 3], [2, -1]], np.int32)
ref = cf.reference.moe("bf16", banks, x, w, ids)
for tier in cf.usable_tiers():
    y = cf.moe_forward("bf16", banks, x, w, ids, isa=tier).astype(np.float64)
    err = float(np.abs(y - ref).max() / np.abs(ref).max())
    assert err < 4e-3, f"bf16 at {tier}: rel err {err:.2e}"
    print(f"bf16 moe_forward at {tier}: kernel {cf.selected_tier('bf16', isa=tier)}, rel err {err:.1e}")
assert "torch" not in sys.modules
print(f"cpumoe_formats {cf.__version__} ABI {cf.ABI_VERSION[0]}.{cf.ABI_VERSION[1]} from {cf.__file__}")
print(f"build: {cf.BUILD_INFO}; selected tier: {cf.selected_tier('bf16')}")
