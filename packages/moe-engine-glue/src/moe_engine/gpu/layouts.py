"""cpumoe_formats banks -> the GPU experts' tensors, per format.

Every format keeps, per layer and slot, two matrices (gate_up: N = 2I rows of K = H; down: N = H rows of K = I),
row-major with K innermost, gate_up rows 0..I-1 gate and I..2I-1 up, and up to two side tensors each:

| format    | w [N, KW]                  | s (scales)                     | v [N] fp32          |
|-----------|----------------------------|--------------------------------|---------------------|
| bf16      | bf16, KW = K               | -                              | -                   |
| fp8_block | e4m3 codes uint8, KW = K   | fp32 [nb(N), nb(K)] (bf16 exact, padding columns dropped) | int32 [1] |
| mxfp4     | uint8 e2m1 pairs, KW = K/2 | e8m0 uint8 [N, K/32]           | bias (bf16 exact)   |
| nvfp4     | uint8 e2m1 pairs, KW = K/2 | e4m3 uint8 [N, K/16]           | global (fp16 exact) |

fp8_block's v is a flag: 1 when the matrix holds a code 0x7F / 0xFF (+-480; e4m3fn's NaN codes, which the GPU's
conversion would give as NaN), so the kernels fix those codes up only where they occur.

mxfp4's banks are transposed (K-pairs outer, N inner) and gate/up interleaved by column: `to_device` transposes
and de-interleaves them on the device, so every format's kernel reads rows. The values are the banks' own, widened
exactly (bf16 and fp16 -> fp32), never re-rounded.
"""
from __future__ import annotations

import numpy as np
import torch

PARTS = ("gu_w", "gu_s", "gu_v", "dn_w", "dn_s", "dn_v")


def nb(n: int) -> int:
    return -(-int(n) // 128)


def specs(fmt: str, H: int, I: int) -> dict:  # noqa: E741
    """part name -> (per-slot shape, torch dtype) for the parts the format has."""
    u8, f32 = torch.uint8, torch.float32
    if fmt == "bf16":
        return {"gu_w": ((2 * I, H), torch.bfloat16), "dn_w": ((H, I), torch.bfloat16)}
    if fmt == "fp8_block":
        return {"gu_w": ((2 * I, H), u8), "gu_s": ((nb(2 * I), nb(H)), f32), "gu_v": ((1,), torch.int32),
                "dn_w": ((H, I), u8), "dn_s": ((nb(H), nb(I)), f32), "dn_v": ((1,), torch.int32)}
    if fmt == "mxfp4":
        return {"gu_w": ((2 * I, H // 2), u8), "gu_s": ((2 * I, H // 32), u8), "gu_v": ((2 * I,), f32),
                "dn_w": ((H, I // 2), u8), "dn_s": ((H, I // 32), u8), "dn_v": ((H,), f32)}
    if fmt == "nvfp4":
        return {"gu_w": ((2 * I, H // 2), u8), "gu_s": ((2 * I, H // 16), u8), "gu_v": ((2 * I,), f32),
                "dn_w": ((H, I // 2), u8), "dn_s": ((H, I // 16), u8), "dn_v": ((H,), f32)}
    raise ValueError(f"format={fmt!r} has no GPU layout; expected one of bf16, fp8_block, mxfp4, nvfp4")


def scale_row_stride(fmt: str, H: int, I: int) -> tuple[int, int]:  # noqa: E741
    """SRS of gate_up and down: the scale tensor's row length (0 where the format has none)."""
    if fmt == "fp8_block":
        return nb(H), nb(I)
    if fmt == "mxfp4":
        return H // 32, I // 32
    if fmt == "nvfp4":
        return H // 16, I // 16
    return 0, 0


def bytes_per_expert(fmt: str, H: int, I: int) -> int:  # noqa: E741
    total = 0
    for shape, dtype in specs(fmt, H, I).values():
        total += int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return total


def _t(a: np.ndarray, view, device, non_blocking: bool) -> torch.Tensor:
    """One expert's numpy slice -> a device tensor of the same bits (ml_dtypes arrays viewed as `view`)."""
    a = np.ascontiguousarray(np.asarray(a).view(view))
    return torch.from_numpy(a).to(device, non_blocking=non_blocking)


def _bf16(a, device, nbk) -> torch.Tensor:
    return _t(a, np.uint16, device, nbk).view(torch.bfloat16)


def _has_480(codes: torch.Tensor) -> torch.Tensor:
    """[1] int32 on the codes' device: 1 if any e4m3 code is 0x7F or 0xFF (computed there: on the host the scan
    held an fp8_block layer's staged prefill to 1.4 GB/s, against 4.2 GB/s now, on the H200 host)."""
    return ((codes & 0x7F) == 0x7F).any().to(torch.int32).reshape(1)


def _deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows 0, 2, 4, ... then 1, 3, 5, ... (mxfp4's interleaved gate/up columns -> gate rows then up rows)."""
    return torch.cat([t[0::2], t[1::2]], dim=0)


def to_device(fmt: str, banks: dict, e: int, H: int, I: int, device, non_blocking: bool = False) -> dict:  # noqa: E741
    """Expert e of one layer's (validated) banks -> {part: device tensor in the layout of `specs`}."""
    nbk = non_blocking
    if fmt == "bf16":
        return {"gu_w": _bf16(banks["gate_up"][e], device, nbk), "dn_w": _bf16(banks["down"][e], device, nbk)}
    if fmt == "fp8_block":
        gu, dn = (_t(banks[n][e], np.uint8, device, nbk) for n in ("gate_up", "down"))
        return {"gu_w": gu, "gu_s": _bf16(banks["gate_up_scale"][e][:, :nb(H)], device, nbk).float(),
                "gu_v": _has_480(gu),
                "dn_w": dn, "dn_s": _bf16(banks["down_scale"][e][:, :nb(I)], device, nbk).float(),
                "dn_v": _has_480(dn)}
    if fmt == "mxfp4":
        return {"gu_w": _deinterleave_rows(_t(banks["gate_up_blocks"][e], np.uint8, device, nbk).t()),
                "gu_s": _deinterleave_rows(_t(banks["gate_up_scales"][e], np.uint8, device, nbk).t()),
                "gu_v": _deinterleave_rows(_bf16(banks["gate_up_bias"][e], device, nbk).float()),
                "dn_w": _t(banks["down_blocks"][e], np.uint8, device, nbk).t(),
                "dn_s": _t(banks["down_scales"][e], np.uint8, device, nbk).t(),
                "dn_v": _bf16(banks["down_bias"][e], device, nbk).float()}
    if fmt == "nvfp4":
        return {"gu_w": _t(banks["gate_up_packed"][e], np.uint8, device, nbk),
                "gu_s": _t(banks["gate_up_scale"][e], np.uint8, device, nbk),
                "gu_v": _t(banks["gate_up_global"][e], np.uint16, device, nbk).view(torch.float16).float(),
                "dn_w": _t(banks["down_packed"][e], np.uint8, device, nbk),
                "dn_s": _t(banks["down_scale"][e], np.uint8, device, nbk),
                "dn_v": _t(banks["down_global"][e], np.uint16, device, nbk).view(torch.float16).float()}
    raise ValueError(f"format={fmt!r} has no GPU layout")
