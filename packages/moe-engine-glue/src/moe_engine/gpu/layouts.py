"""cpumoe_formats banks -> the GPU tensors of each format, per matrix.

Every format keeps, per layer and slot, two matrices (gate_up: N = 2I rows of K = H; down: N = H rows of K = I),
row-major with K innermost, gate_up rows 0..I-1 gate and I..2I-1 up, and up to two side tensors each (parts
`gu_w gu_s gu_v` and `dn_w dn_s dn_v`). The two matrices may come from two formats (a pair: Q4_K_M files hold Q4_K
gate/up and Q6_K down): each matrix's parts follow its own format's row below. nb = blocks per row.

| format    | w [N, KW]                  | s (scales)                     | v                   |
|-----------|----------------------------|--------------------------------|---------------------|
| bf16      | bf16, KW = K               | -                              | -                   |
| fp8_block | e4m3 codes uint8, KW = K   | fp32 [nb(N), nb(K)] (bf16 exact, padding columns dropped) | int32 [1] |
| mxfp4     | uint8 e2m1 pairs, KW = K/2 | e8m0 uint8 [N, K/32]           | bias [N] fp32 (bf16 exact) |
| nvfp4     | uint8 e2m1 pairs, KW = K/2 | e4m3 uint8 [N, K/16]           | global [N] fp32 (fp16 exact) |
| q4_0      | uint8 nibbles, KW = K/2    | fp16 d [N, K/32]               | -                   |
| q8_0      | int8 codes, KW = K         | fp16 d [N, K/32]               | -                   |
| q4_k      | uint8 nibbles, KW = K/2    | uint8 [N, nb * 12] packed 6-bit scales / mins | fp16 [N, nb * 2] (d, dmin) |
| q6_k      | uint8 [N, nb * 192] (ql 128, qh 64 per block) | int8 [N, K/16] scales | fp16 d [N, nb] |

fp8_block's v is a flag: 1 when the matrix holds a code 0x7F / 0xFF (+-480; e4m3fn's NaN codes, which the GPU's
conversion would give as NaN), so the kernels fix those codes up only where they occur.

mxfp4's banks are transposed (K-pairs outer, N inner) and gate/up interleaved by column: `to_device` transposes
and de-interleaves them on the device, so every format's kernel reads rows. The values are the banks' own, widened
exactly (bf16 and fp16 -> fp32), never re-rounded.

The GGUF formats' blocks (q4_0 18 bytes, q8_0 34, q4_k 144, q6_k 210) are split on the device, at staging, into
planes of the same bytes (codes, scales, d): the bytes per weight stay the file's (4.5, 8.5, 4.5, 6.5625 bits), and a
row's codes become contiguous and 16-byte aligned. In the blocks, a q4_0 / q8_0 / q6_k block starts 2-byte aligned
(18, 34, 210 are not multiples of 16), so a warp reads its codes with 2-byte loads: 9 per q4_0 block of 32
weights against one 16-byte load of codes (plus a shared d) in planes.
"""
from __future__ import annotations

import numpy as np
import torch

ROLES = ("gate_up", "down")
PREFIX = {"gate_up": "gu_", "down": "dn_"}
# bytes per block and elements per block of the GGUF formats (cpumoe_formats.formats.<name>: BLOCK_BYTES, QK)
GGUF_BLOCK = {"q4_0": (18, 32), "q8_0": (34, 32), "q4_k": (144, 256), "q6_k": (210, 256)}


def nb(n: int) -> int:
    return -(-int(n) // 128)


def _nk(role: str, H: int, I: int) -> tuple[int, int]:  # noqa: E741
    return (2 * I, H) if role == "gate_up" else (H, I)


def matrix_specs(fmt: str, N: int, K: int) -> dict:
    """One matrix's parts {"w" | "s" | "v": (per-slot shape, torch dtype)} in format `fmt`."""
    u8, f32, f16 = torch.uint8, torch.float32, torch.float16
    if fmt == "bf16":
        return {"w": ((N, K), torch.bfloat16)}
    if fmt == "fp8_block":
        return {"w": ((N, K), u8), "s": ((nb(N), nb(K)), f32), "v": ((1,), torch.int32)}
    if fmt == "mxfp4":
        return {"w": ((N, K // 2), u8), "s": ((N, K // 32), u8), "v": ((N,), f32)}
    if fmt == "nvfp4":
        return {"w": ((N, K // 2), u8), "s": ((N, K // 16), u8), "v": ((N,), f32)}
    if fmt == "q4_0":
        return {"w": ((N, K // 2), u8), "s": ((N, K // 32), f16)}
    if fmt == "q8_0":
        return {"w": ((N, K), torch.int8), "s": ((N, K // 32), f16)}
    if fmt == "q4_k":
        return {"w": ((N, K // 2), u8), "s": ((N, K // 256 * 12), u8), "v": ((N, K // 256 * 2), f16)}
    if fmt == "q6_k":
        return {"w": ((N, K // 256 * 192), u8), "s": ((N, K // 16), torch.int8), "v": ((N, K // 256), f16)}
    raise ValueError(f"format={fmt!r} has no GPU layout; expected one of {list(MATRIX_FORMATS)}")


MATRIX_FORMATS = ("bf16", "fp8_block", "mxfp4", "nvfp4", "q4_0", "q8_0", "q4_k", "q6_k")


def specs(fmts, H: int, I: int) -> dict:  # noqa: E741
    """part name -> (per-slot shape, torch dtype) for the parts the formats have; fmts: a format name, or the
    (gate_up, down) pair."""
    fmts = (fmts, fmts) if isinstance(fmts, str) else tuple(fmts)
    out = {}
    for role, fmt in zip(ROLES, fmts):
        for k, v in matrix_specs(fmt, *_nk(role, H, I)).items():
            out[PREFIX[role] + k] = v
    return out


def matrix_row_stride(fmt: str, K: int) -> int:
    """SRS of one matrix: the scale tensor's row length in blocks (0 where the format has none)."""
    if fmt == "fp8_block":
        return nb(K)
    if fmt in ("mxfp4", "q4_0", "q8_0"):
        return K // 32
    if fmt == "nvfp4":
        return K // 16
    if fmt in ("q4_k", "q6_k"):
        return K // 256
    return 0


def scale_row_stride(fmts, H: int, I: int) -> tuple[int, int]:  # noqa: E741
    """SRS of gate_up and down (see matrix_row_stride)."""
    fmts = (fmts, fmts) if isinstance(fmts, str) else tuple(fmts)
    return matrix_row_stride(fmts[0], H), matrix_row_stride(fmts[1], I)


def bytes_per_expert(fmts, H: int, I: int) -> int:  # noqa: E741
    total = 0
    for shape, dtype in specs(fmts, H, I).values():
        total += int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return total


SAME_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # bytes as an integer type of their width


def _t(a, view, device, non_blocking: bool) -> torch.Tensor:
    """One expert's numpy slice -> a device tensor of the same bits (ml_dtypes arrays viewed as `view`); a tensor
    already on the device (moved.MovedRole.fetch) is viewed as an integer type of `view`'s width."""
    if isinstance(a, torch.Tensor):
        return a.contiguous().view(SAME_BITS[np.dtype(view).itemsize])
    a = np.ascontiguousarray(np.asarray(a).view(view))
    return torch.from_numpy(a).to(device, non_blocking=non_blocking)


def _bf16(a, device, nbk) -> torch.Tensor:
    return _t(a, np.uint16, device, nbk).view(torch.bfloat16)


def _has_480(codes: torch.Tensor, batched: bool = False) -> torch.Tensor:
    """[1] int32 on the codes' device ([n, 1] for a batch of experts): 1 if any e4m3 code is 0x7F or 0xFF (computed
    there: on the host the scan held an fp8_block layer's staged prefill to 1.4 GB/s, against 4.2 GB/s now, on the
    H200 host)."""
    hit = (codes & 0x7F) == 0x7F
    if batched:
        return hit.flatten(1).any(1).to(torch.int32).reshape(-1, 1)
    return hit.any().to(torch.int32).reshape(1)


def _deinterleave_rows(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Rows 0, 2, 4, ... then 1, 3, 5, ... along `dim` (mxfp4's interleaved gate/up columns -> gate rows then up
    rows)."""
    t = t.movedim(dim, 0)
    return torch.cat([t[0::2], t[1::2]], dim=0).movedim(0, dim)


def _planes(fmt: str, raw: torch.Tensor) -> dict:
    """A GGUF matrix's block bytes [N, nb * B] uint8 on the device ([n, N, nb * B] for n experts) -> its planes
    (views; load() copies them into the slots' contiguous parts)."""
    B = GGUF_BLOCK[fmt][0]
    lead = tuple(raw.shape[:-1])
    b = raw.reshape(-1, raw.shape[-1]).view(-1, raw.shape[-1] // B, B)
    N = b.shape[0]

    def f16(lo):  # the fp16 at byte lo of every block -> [N, nb]
        return b[:, :, lo:lo + 2].view(torch.float16).reshape(N, -1)

    if fmt == "q4_0":
        out = {"w": b[:, :, 2:].reshape(N, -1), "s": f16(0)}
    elif fmt == "q8_0":
        out = {"w": b[:, :, 2:].reshape(N, -1).view(torch.int8), "s": f16(0)}
    elif fmt == "q4_k":
        out = {"w": b[:, :, 16:].reshape(N, -1), "s": b[:, :, 4:16].reshape(N, -1),
               "v": b[:, :, 0:4].view(torch.float16).reshape(N, -1)}
    else:
        out = {"w": b[:, :, 0:192].reshape(N, -1), "s": b[:, :, 192:208].reshape(N, -1).view(torch.int8),
               "v": f16(208)}
    return {k: v.reshape(lead + (v.shape[-1],)) for k, v in out.items()}


def matrix_to_device(fmt: str, role: str, banks: dict, e, K: int, device, non_blocking: bool = False) -> dict:
    """Expert e's matrix `role` ("gate_up" or "down") of one layer's (validated) banks, stored in format `fmt` under
    that format's bank names -> {"w" | "s" | "v": device tensor (or view) in the layout of `matrix_specs`}. e: an
    expert, or a slice of experts (every part then gains their leading dimension: one copy of a layer's range
    instead of one per expert)."""
    nbk, p, batched = non_blocking, role, isinstance(e, slice)
    if fmt == "bf16":
        return {"w": _bf16(banks[p][e], device, nbk)}
    if fmt == "fp8_block":
        w = _t(banks[p][e], np.uint8, device, nbk)
        return {"w": w, "s": _bf16(banks[p + "_scale"][e][..., :nb(K)], device, nbk).float(),
                "v": _has_480(w, batched)}
    if fmt == "mxfp4":
        w = _t(banks[p + "_blocks"][e], np.uint8, device, nbk).transpose(-1, -2)
        s = _t(banks[p + "_scales"][e], np.uint8, device, nbk).transpose(-1, -2)
        v = _bf16(banks[p + "_bias"][e], device, nbk).float()
        if role == "gate_up":
            w, s, v = _deinterleave_rows(w, -2), _deinterleave_rows(s, -2), _deinterleave_rows(v, -1)
        return {"w": w, "s": s, "v": v}
    if fmt == "nvfp4":
        return {"w": _t(banks[p + "_packed"][e], np.uint8, device, nbk),
                "s": _t(banks[p + "_scale"][e], np.uint8, device, nbk),
                "v": _t(banks[p + "_global"][e], np.uint16, device, nbk).view(torch.float16).float()}
    if fmt in GGUF_BLOCK:
        return _planes(fmt, _t(banks[p][e], np.uint8, device, nbk))
    raise ValueError(f"format={fmt!r} has no GPU layout")


def to_device(fmts, banks: dict, e, H: int, I: int, device, non_blocking: bool = False,  # noqa: E741
              moved=None) -> dict:
    """Expert e (an int, or a slice of experts) of one layer's (validated) banks -> {part: device tensor (or view) in
    the layout of `specs`}. moved: {role: moved.MovedRole} for a matrix whose banks are in a CPU layout of its format
    (q4_0_x16 for q4_0): its bytes go to the device as they are and are put in the format's order there."""
    fmts = (fmts, fmts) if isinstance(fmts, str) else tuple(fmts)
    out = {}
    for role, fmt in zip(ROLES, fmts):
        K = _nk(role, H, I)[1]
        src, at = banks, e
        if moved and moved.get(role) is not None:
            src = moved[role].fetch(banks, e, non_blocking)
            at = slice(None) if isinstance(e, slice) else 0
        for k, v in matrix_to_device(fmt, role, src, at, K, device, non_blocking).items():
            out[PREFIX[role] + k] = v
    return out
