# Called by: ci/check_wheel.sh (nox -s package-check-<pkg>, tests-integration/test_packaging.py), on the wheel.
"""Smoke test of an installed moe-engine-glue wheel with its runtime dependencies only (torch, no triton, no test
extras): a tiny two-layer bf16 model through MoERunner on the CPU, bit-identical to the executor's decode; the
moe-engine console script answers `info --json`."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import cpumoe_formats as cf
import moe_engine
from moe_engine.runner import MoERunner

assert "site-packages" in moe_engine.__file__, f"imported from {moe_engine.__file__}, not from an installed wheel"
rng = np.random.default_rng(0)
E, H, I, K = 4, 96, 40, 2
banks = [cf.get_format("bf16").random_banks(E, H, I, rng) for _ in range(2)]
x = torch.randn(3, H).to(torch.bfloat16)
w = torch.rand(3, K) + 0.05
ids = torch.tensor([[0, 1], [3, 3], [2, -1]], dtype=torch.int32)
with MoERunner("bf16", banks, top_k=K, strategy="cpu", device="cpu", threads=2, progress=False) as r:
    for layer in range(2):
        y = r.forward(layer, x, w, ids)
        want = r.executor.decode(layer, x, w, ids)
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), f"layer {layer}: runner != executor"
exe = Path(sys.executable).parent / "moe-engine"
assert exe.is_file(), f"the moe-engine console script is not installed beside {sys.executable}"
info = json.loads(subprocess.run([exe, "info", "--json", "--no-probe"], check=True, capture_output=True,
                                 text=True).stdout)
assert info["cpu"]["kernels"]["bf16"]["native"], info
print(f"moe_engine {moe_engine.__version__}: cpu strategy bit-identical to the executor; moe-engine info ok")
