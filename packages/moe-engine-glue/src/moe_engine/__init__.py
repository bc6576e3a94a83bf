"""moe-engine-glue: what an LLM engine calls to run mixture-of-experts expert layers on the CPU (alone or
beside GPU experts) and stay correct under CUDA/HIP graph replay. The only package of the project that
imports torch and triton.

    from moe_engine import MoERunner                  # one runner for every MoE layer of a model
    from moe_engine import offload_experts            # a loaded transformers model's experts through a runner
    from moe_engine import from_pretrained            # a checkpoint loaded with its experts streamed into banks

The transformers integration needs the `transformers` extra (pip install 'moe-engine-glue[transformers]'); its
names are imported on first use, so `import moe_engine` works without transformers."""
from __future__ import annotations

__version__ = "0.2.0"

_LAZY = {
    "MoERunner": ("runner", "MoERunner"),
    "CaptureRefusedError": ("runner", "CaptureRefusedError"),
    "STRATEGIES": ("runner", "STRATEGIES"),
    "fraction_masks": ("runner", "fraction_masks"),
    "HostSync": ("sync", "HostSync"),
    "open_sync": ("sync", "open_sync"),
    "GpuExperts": ("gpu.experts", "GpuExperts"),
    "offload_experts": ("integrations.transformers", "offload_experts"),
    "from_pretrained": ("integrations.transformers", "from_pretrained"),
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    """The public names, imported on first use (torch, triton and transformers only when asked for)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'moe_engine' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
