"""The zero-copy bank: every expert of each pinned layer, in the GPU experts' layout, read by the GPU experts'
kernels straight from page-locked host memory (no staging copy, capture-safe). The big weight tensors alias the host
banks themselves (bf16, fp8_block, nvfp4 keep the GPU layout's row-major [N, K] order on the host); the small side
tensors (fp8_block's fp32 scales and +-480 flags, nvfp4's globals) are converted once into device memory. mxfp4's
host bank is transposed, so it has no zero-copy bank (its misses stay on the CPU).

On a GPU a host array becomes a CUDA tensor through __cuda_array_interface__ on its registered address (under
unified addressing the device pointer is the host pointer); in Triton's interpreter (no GPU) the CPU tensors are used
as they are, so the split's control logic runs on any machine.

Thread contract: owned by its MoERunner; read-only after construction."""
from __future__ import annotations

import numpy as np

from ..gpu import layouts

FORMATS = ("bf16", "fp8_block", "nvfp4")


class _HostArray:
    """A registered host array seen as device memory (torch.as_tensor reads __cuda_array_interface__)."""

    def __init__(self, a: np.ndarray):
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False),
                                         "version": 3, "strides": a.strides}


def _view(a, np_view, torch_dtype, device):
    import torch

    a = np.asarray(a)
    if not a.flags.c_contiguous:
        raise ValueError(f"zero-copy bank: a host bank of shape {a.shape} is not C-contiguous; expected the banks' "
                         "own row-major arrays")
    a = a.view(np_view)
    if device.type == "cpu":
        t = torch.from_numpy(a)
    else:
        try:
            t = torch.as_tensor(_HostArray(a), device=device)
        except RuntimeError as e:  # the runtime refuses a pointer it has no registration for
            raise ValueError(f"zero-copy bank: a host bank of shape {a.shape} is not page-locked for {device}; "
                             "register it first (placement.pinning.PinnedBanks, or MoERunner(pin_memory=...))") from e
    return t.view(torch_dtype) if t.dtype != torch_dtype else t


class ZeroCopyBank:
    """parts {name: [one tensor [E, ...] per layer, None where the layer is not pinned]}, capacity E: the `bank=` of
    GpuExperts.forward, where a route's slot is its expert id."""

    def __init__(self, format: str, banks, pinned, *, E: int, H: int, I: int, device):  # noqa: E741
        import torch

        if format not in FORMATS:
            raise ValueError(f"format {format!r} has no zero-copy bank (its host layout is not the GPU's); the miss "
                             f"split runs {list(FORMATS)}")
        self.format, self.capacity, self.device = format, E, device
        self.layers = [bool(p) for p in pinned]
        specs = layouts.specs(format, H, I)
        self.parts = {name: [None] * len(banks) for name in specs}
        bf, u8 = torch.bfloat16, torch.uint8
        for li, b in enumerate(banks):
            if not self.layers[li]:
                continue
            p = self.parts
            if format == "bf16":
                p["gu_w"][li] = _view(b["gate_up"], np.uint16, bf, device)
                p["dn_w"][li] = _view(b["down"], np.uint16, bf, device)
            elif format == "fp8_block":
                for pre, name, k in (("gu", "gate_up", H), ("dn", "down", I)):
                    codes = np.asarray(b[name]).view(np.uint8)
                    p[f"{pre}_w"][li] = _view(codes, np.uint8, u8, device)
                    sc = np.ascontiguousarray(np.asarray(b[f"{name}_scale"])[:, :, :layouts.nb(k)].view(np.uint16))
                    p[f"{pre}_s"][li] = torch.from_numpy(sc).view(bf).float().to(device)
                    flag = ((codes.reshape(E, -1) & 0x7F) == 0x7F).any(axis=1).astype(np.int32).reshape(E, 1)
                    p[f"{pre}_v"][li] = torch.from_numpy(flag).to(device)
            else:  # nvfp4
                for pre, name in (("gu", "gate_up"), ("dn", "down")):
                    p[f"{pre}_w"][li] = _view(b[f"{name}_packed"], np.uint8, u8, device)
                    p[f"{pre}_s"][li] = _view(b[f"{name}_scale"], np.uint8, u8, device)
                    g = np.ascontiguousarray(np.asarray(b[f"{name}_global"]).view(np.uint16))
                    p[f"{pre}_v"][li] = torch.from_numpy(g).view(torch.float16).float().to(device)
