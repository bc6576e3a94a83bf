# Called by: ci/check_wheel.sh (nox -s package-check-<pkg>, tests-integration/test_packaging.py), on the wheel.
"""Smoke test of an installed cpumoe-executor wheel (with cpumoe-formats), alone: no test extras, no torch.

A tiny bf16 two-layer decode on two workers, bit-identical to cpumoe_formats.moe_forward; the shipped
headers; the import came from the install, not a source tree.
"""
import sys
from pathlib import Path

import numpy as np

import cpumoe_executor as ce
import cpumoe_formats as cf

assert "site-packages" in ce.__file__, f"imported from {ce.__file__}, not from an installed wheel"
for h in ("abi.h", "protocol.h"):
    assert (Path(ce.get_include()) / "cpumoe_executor" / h).is_file(), f"{h} is not in the wheel"

rng = np.random.default_rng(0)
E, H, I, K, T = 4, 96, 40, 2, 3
banks = [cf.get_format("bf16").random_banks(E, H, I, rng) for _ in range(2)]
x = rng.standard_normal((T, H), np.float32)
w = rng.random((T, K), np.float32) + 0.05
ids = np.array([[0, 1], [3, 3], [2, -1]], np.int32)
with ce.CpuMoeExecutor("bf16", banks, top_k=K, max_tokens=4, threads=2) as ex:
    for layer in range(2):
        y = ex.decode(layer, x, w, ids)
        want = cf.moe_forward("bf16", banks[layer], x, w, ids)
        assert (y.view(np.uint16) == want.view(np.uint16)).all(), f"layer {layer}: executor != moe_forward"
    print(f"bf16 decode on {ex.threads} threads at {ex.isa}: bit-identical to moe_forward")
assert "torch" not in sys.modules
print(f"cpumoe_executor {ce.__version__} ABI {ce.ABI_VERSION[0]}.{ce.ABI_VERSION[1]} protocol v{ce.PROTOCOL_VERSION} "
      f"from {ce.__file__}")
