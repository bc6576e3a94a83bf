"""moe-engine-glue test machinery: small random models per format, fresh routing, GPU detection."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import cpumoe_formats as cf

# no GPU: the GPU experts run in Triton's interpreter on CPU tensors (set before triton is imported)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Small shapes per format that satisfy its divisibility (ragged where the format allows).
SHAPES = {"bf16": (96, 40), "fp8_block": (259, 131), "nvfp4": (96, 48), "mxfp4": (96, 64), "q4_0": (96, 64),
          "ds_fp4": (256, 128), "q8_0": (96, 64), "q4_k": (256, 256), "q6_k": (256, 256)}
ACT = {"mxfp4": dict(activation="swigluoai", alpha=1.702, limit=7.0),
       "ds_fp4": dict(activation="swiglu_clamp", alpha=1.0, limit=10.0)}


def pytest_configure(config):
    for m in ("cuda: needs an NVIDIA GPU and the CUDA driver", "gpu: needs some GPU (combine with cuda or rocm)"):
        config.addinivalue_line("markers", m)


@pytest.fixture(scope="session")
def small_gguf(tmp_path_factory):
    """The small 2-layer Q4_0 GGUF of the qwen3moe shape (moe_engine.tools.synth), written once per session."""
    pytest.importorskip("gguf")
    from moe_engine.tools import synth

    p = tmp_path_factory.mktemp("small_gguf") / "q4_0.gguf"
    synth.write("gguf-q4_0", p, small=True, layers=2, seed=11, progress=False)
    return p


@pytest.fixture
def rng():
    seed = int(os.environ.get("CPUMOE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"CPUMOE_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def make_banks(fmt, rng, layers=2, E=6):
    H, I = SHAPES[fmt]  # noqa: E741
    return [cf.get_format(fmt).random_banks(E, H, I, rng) for _ in range(layers)], (E, H, I)


def routes(rng, T, K, E, minus_one=True):
    import torch

    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    if minus_one and K > 1:
        ids[0, -1] = -1
    w = rng.random((T, K)).astype(np.float32) + 0.05
    return torch.from_numpy(ids), torch.from_numpy(w)


def cuda_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (it comes with torch's CUDA wheels)"
    return None
