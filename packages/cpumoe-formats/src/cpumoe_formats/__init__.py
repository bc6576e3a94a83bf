"""cpumoe-formats: the expert weight formats of CPU MoE decode (bf16, fp8_block, nvfp4, mxfp4, ds_fp4, q4_0, and the
GGUF block types q8_0, q4_k, q5_k, q6_k), plus the CPU layouts they are repacked into (bf16_x16, fp8_block_x16,
nvfp4_x16, mxfp4_panel, mxfp4_x16, ds_fp4_x16, q4_0_x16, q4_k_x16, q5_k_x16, q6_k_x16, q8_0_x16;
formats.CPU_LAYOUTS).

Bank schemas and validation, quantizers from float weights, float64
references, and CPU kernels for every ISA tier behind a versioned C ABI.

Contracts (docs/formats.md "Contracts"): every public function and class may be used from any number of threads
at once (each docstring's "Threads:" line says how); `Kernel` owns native memory and has close() and a context
manager; the constants (C_API_CAPSULE's table among them) live as long as the process; NaN and inf in inputs and
banks give NaN / inf where the float64 reference does.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import _native, reference
from ._arrays import aligned_copy, aligned_empty
from .activations import ACTIVATIONS
from .attention import DecodeAttention
from .formats import FORMATS, get_format
from .formats._moves import Moves, byte_moves
from .formats.bf16_x16 import repack as repack_bf16_x16
from .formats.bf16_x16 import unpack as unpack_bf16_x16
from .formats.ds_fp4_x16 import repack as repack_ds_fp4_x16
from .formats.ds_fp4_x16 import unpack as unpack_ds_fp4_x16
from .formats.fp8_block_x16 import repack as repack_fp8_block_x16
from .formats.fp8_block_x16 import unpack as unpack_fp8_block_x16
from .formats.mxfp4_panel import repack as repack_mxfp4_panels
from .formats.mxfp4_panel import unpack as unpack_mxfp4_panels
from .formats.mxfp4_x16 import repack as repack_mxfp4_x16
from .formats.mxfp4_x16 import unpack as unpack_mxfp4_x16
from .formats.nvfp4_x16 import repack as repack_nvfp4_x16
from .formats.nvfp4_x16 import unpack as unpack_nvfp4_x16
from .formats.q4_0_x16 import repack as repack_q4_0_x16
from .formats.q4_0_x16 import unpack as unpack_q4_0_x16
from .formats.q4_k_x16 import repack as repack_q4_k_x16
from .formats.q4_k_x16 import unpack as unpack_q4_k_x16
from .formats.q5_k_x16 import repack as repack_q5_k_x16
from .formats.q5_k_x16 import unpack as unpack_q5_k_x16
from .formats.q6_k_x16 import repack as repack_q6_k_x16
from .formats.q6_k_x16 import unpack as unpack_q6_k_x16
from .formats.q8_0_x16 import repack as repack_q8_0_x16
from .formats.q8_0_x16 import unpack as unpack_q8_0_x16
from .kernels import (
    PEAK_KINDS,
    TIERS,
    X16_PREFETCH_LAYOUTS,
    Kernel,
    detected_tier,
    moe_forward,
    peak_loop,
    selected_tier,
    usable_tiers,
    x16_prefetch,
)
from .layers import is_uniform, layer_formats, model_mode, validate_layer
from .linear import Linear
from .roles import ROLES

__version__ = "0.2.0"
ABI_VERSION = (_native.ABI_MAJOR, _native.ABI_MINOR)
C_API_CAPSULE = _native._C_API_v1
BUILD_INFO = _native.BUILD_INFO


def get_include() -> str:
    """Directory holding cpumoe_formats/abi.h (the versioned C ABI) and nogil.h. Threads: any."""
    return str(Path(__file__).resolve().parent / "include")


def require_abi(major: int, minor: int = 0) -> None:
    """For Python-level consumers: raise ImportError naming both versions on a mismatch. Threads: any."""
    if major != ABI_VERSION[0] or minor > ABI_VERSION[1]:
        raise ImportError(f"cpumoe-formats ABI mismatch: installed cpumoe-formats {__version__} provides ABI "
                          f"{ABI_VERSION[0]}.{ABI_VERSION[1]}, the caller needs ABI {major}.{minor}; "
                          f"install a cpumoe-formats providing ABI {major}.x with x >= {minor}")


def quantize(fmt, gate_up, down, **opts) -> dict:
    """Float weights gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I] -> banks.
    Threads: any (reads its arguments, returns new arrays)."""
    import numpy as np

    from ._arrays import as_array

    spec = get_format(fmt)
    gu = np.asarray(as_array(gate_up, "gate_up"), np.float32)
    dn = np.asarray(as_array(down, "down"), np.float32)
    if gu.ndim != 3 or gu.shape[1] % 2 or dn.ndim != 3:
        raise ValueError(f"gate_up must be [E, 2I, H] and down [E, H, I], got {gu.shape} and {dn.shape}")
    E, I2, H = gu.shape
    if dn.shape != (E, H, I2 // 2):
        raise ValueError(f"down: shape {dn.shape}, expected {(E, H, I2 // 2)} to match gate_up {gu.shape}")
    spec.check_dims(H, I2 // 2)
    banks = spec.quantize(gu, dn, **opts)
    spec.validate(banks)
    return banks


def validate_banks(fmt, banks, E: int | None = None, H: int | None = None, I: int | None = None):  # noqa: E741
    """Check banks against the format's schema; returns (E, H, I). Threads: any (reads the banks' metadata)."""
    return get_format(fmt).validate(banks, E, H, I)[1]


if os.environ.get("CPUMOE_DEBUG_INFO"):
    print(f"cpumoe_formats {__version__} ABI {ABI_VERSION} {BUILD_INFO} usable tiers {usable_tiers()}")

__all__ = ["ABI_VERSION", "ACTIVATIONS", "BUILD_INFO", "C_API_CAPSULE", "FORMATS", "PEAK_KINDS", "TIERS", "Kernel",
           "Linear", "DecodeAttention", "Moves", "byte_moves", "aligned_copy", "peak_loop",
           "ROLES", "aligned_empty", "detected_tier", "get_format", "get_include", "is_uniform", "layer_formats",
           "model_mode", "moe_forward", "quantize", "reference",
           "repack_bf16_x16", "repack_ds_fp4_x16", "repack_fp8_block_x16", "repack_mxfp4_panels", "repack_mxfp4_x16",
           "repack_nvfp4_x16", "repack_q4_0_x16", "repack_q4_k_x16",
           "repack_q5_k_x16", "repack_q6_k_x16", "repack_q8_0_x16", "require_abi", "selected_tier", "unpack_bf16_x16",
           "unpack_ds_fp4_x16", "unpack_fp8_block_x16", "unpack_mxfp4_panels", "unpack_mxfp4_x16", "unpack_nvfp4_x16",
           "unpack_q4_0_x16", "unpack_q4_k_x16", "unpack_q5_k_x16", "unpack_q6_k_x16", "unpack_q8_0_x16",
           "usable_tiers", "validate_banks", "validate_layer", "x16_prefetch",
           "X16_PREFETCH_LAYOUTS"]
