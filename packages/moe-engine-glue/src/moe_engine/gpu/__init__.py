"""GPU experts: Triton grouped GEMV/GEMM kernels per weight format over GPU-resident expert slots.

| module | job |
|---|---|
| experts.py | GpuExperts: slots per layer, load(), forward(); one format or a (gate_up, down) pair |
| layouts.py | cpumoe_formats banks -> the GPU tensors of each format, per matrix (GGUF blocks split into planes) |
| routing.py | the T*top_k routes grouped by slot on the GPU (fixed-size) |
| kernels.py | gate_up (+ activation), down (grouped or per token), the route sum |
| bf16.py ... q6_k.py (one per format) | each format's row-block products (FMA and tensor-core forms) |
| _tl.py | shared Triton helpers (activations, e4m3 / e2m1 decoders, the interpreter switch) |
| config.py | block sizes and kernel choice per batch size |

Under TRITON_INTERPRET=1 (set before this package is imported) everything runs on CPU tensors.
"""
from __future__ import annotations

from .config import Config, StageConfig
from .experts import GpuExperts

__all__ = ["Config", "GpuExperts", "StageConfig"]
