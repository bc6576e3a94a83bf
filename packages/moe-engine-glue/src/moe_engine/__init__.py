"""moe-engine-glue: what an LLM engine calls to run mixture-of-experts expert layers on the CPU (alone or
beside GPU experts) and stay correct under CUDA/HIP graph replay. The only package of the project that
imports torch and triton."""
from __future__ import annotations

__version__ = "0.1.0"
