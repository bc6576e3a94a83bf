"""mxfp4_panel: gpt-oss mxfp4 weights repacked for a CPU (64-column panels, K-pair rows contiguous).

The same codes, scales and biases as ``mxfp4`` (gpt-oss / Triton transposed split-K), only moved: the
output columns are cut into panels of 64, and each panel's K-pair rows are stored one after another.
A CPU work item covers 64 columns, so it reads one contiguous run of K/2 x 64 bytes; in the Triton
layout it reads 64 bytes out of every N-byte row, a pattern one core's prefetchers cannot keep fed
(docs/formats/mxfp4.md: 44-48% of the single-thread read ceiling against 79-83% for panels on the
Zen 3 dev VM, w4a8).

Banks (native slot order; P = ceil(N / 64) panels of the bank's N output columns):

| slot | bank | shape | dtype |
|---|---|---|---|
| 0 | gate_up_blocks | [E, (2I/64) * H/2, 64] | uint8 |
| 1 | gate_up_scales | [E, (2I/64) * H/32, 64] | uint8 or float8_e8m0fnu |
| 2 | gate_up_bias | [E, 2I] | bfloat16 (or uint16 bits) |
| 3 | down_blocks | [E, ceil(H/64) * I/2, 64] | uint8 |
| 4 | down_scales | [E, ceil(H/64) * I/32, 64] | uint8 or float8_e8m0fnu |
| 5 | down_bias | [E, H] | bfloat16 (or uint16 bits) |

Row ``p * K/2 + kb`` of a blocks bank holds K-pair kb of columns 64p .. 64p + 63 (byte c: column
64p + c, nibbles as in mxfp4); scales likewise with K/32 rows per panel. The last panel of an N that
is not a multiple of 64 (only H can be: H % 32 == 0) is padded; its padding is never read and
``repack`` zero-fills it. Rows may be padded (row stride >= 64 bytes); gate/up stay interleaved by
column.

``repack(banks)`` turns mxfp4 banks into these (and ``unpack(banks, H)`` back); the kernels are
mxfp4's, so both formats give bit-identical outputs in every mode and tier (tested). The math, the
modes (native W4A16, w4a8) and the reference are mxfp4's.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._arrays import aligned_copy, aligned_empty
from . import mxfp4

PANEL = 64  # columns per panel (the kernels' work-item width)


def _panels(n: int) -> int:
    return -(-n // PANEL)


def to_panels(a: np.ndarray) -> np.ndarray:
    """[E, R, N] (R rows of N columns) -> [E, ceil(N/64) * R, 64], the last panel zero padded."""
    a = np.asarray(a)
    E, R, N = a.shape
    P = _panels(N)
    out = aligned_empty((E, P * R, PANEL), a.dtype)
    view = out.reshape(E, P, R, PANEL)
    full = N // PANEL
    if full:
        view[:, :full] = a[:, :, :full * PANEL].reshape(E, R, full, PANEL).transpose(0, 2, 1, 3)
    if N % PANEL:
        view[:, full, :, :] = 0
        view[:, full, :, :N % PANEL] = a[:, :, full * PANEL:]
    return out


def from_panels(a: np.ndarray, n: int) -> np.ndarray:
    """[E, ceil(n/64) * R, 64] -> [E, R, n] (the inverse of to_panels)."""
    a = np.asarray(a)
    E, PR, W = a.shape
    P = _panels(n)
    if W != PANEL or PR % P:
        raise ValueError(f"mxfp4_panel: a panel bank of shape {a.shape} does not hold {P} panels of 64 columns")
    R = PR // P
    return np.ascontiguousarray(a.reshape(E, P, R, PANEL).transpose(0, 2, 1, 3).reshape(E, R, P * PANEL)[:, :, :n])


# The banks that are cut into panels, and the number of columns N each holds (the biases are copied as they are).
_COLUMNS = {"gate_up_blocks": lambda H, I: 2 * I, "gate_up_scales": lambda H, I: 2 * I,  # noqa: E741
            "down_blocks": lambda H, I: H, "down_scales": lambda H, I: H}  # noqa: E741


def repack(banks) -> dict:
    """mxfp4 (gpt-oss / Triton) banks -> mxfp4_panel banks (new arrays, 64-byte aligned; biases copied).
    Threads: any (reads the banks, returns new arrays)."""
    arrs, _ = mxfp4.SPEC.validate(banks)
    return {n: to_panels(a) if n in _COLUMNS else aligned_copy(a) for n, a in zip(mxfp4.SPEC.bank_names, arrs)}


def unpack(banks) -> dict:
    """mxfp4_panel banks -> mxfp4 (gpt-oss / Triton) banks. Threads: any (reads the banks, returns new arrays)."""
    arrs, (_, H, I) = SPEC.validate(banks)  # noqa: E741
    return {n: aligned_copy(from_panels(a, _COLUMNS[n](H, I)) if n in _COLUMNS else a)
            for n, a in zip(SPEC.bank_names, arrs)}


class Mxfp4PanelFormat(mxfp4.Mxfp4Format):
    def repack_from(self, banks):  # from mxfp4 (its cpu_layout)
        return repack(banks)

    def dims(self, banks):
        gub, dnb = banks["gate_up_bias"], banks["down_bias"]
        if gub.ndim != 2 or dnb.ndim != 2 or gub.shape[1] % 2:
            raise ValueError(f"mxfp4_panel biases must be gate_up_bias [E, 2I] and down_bias [E, H], "
                             f"got {gub.shape} and {dnb.shape}")
        return gub.shape[0], dnb.shape[1], gub.shape[1] // 2

    def quantize(self, gate_up, down, gate_up_bias=None, down_bias=None, **opts):
        """As mxfp4.quantize (same codes and scales), then repack."""
        if opts:
            raise TypeError(f"mxfp4_panel quantize takes only gate_up_bias= and down_bias=, got {sorted(opts)}")
        return repack(mxfp4.SPEC.quantize(gate_up, down, gate_up_bias=gate_up_bias, down_bias=down_bias))

    def dequantize(self, banks):
        return mxfp4.SPEC.dequantize(unpack(banks))


# mxfp4's banks (names, dtypes, alignment) with the panel shapes; the biases keep theirs.
_SHAPES = {"gate_up_blocks": lambda E, H, I: (E, _panels(2 * I) * H // 2, PANEL),  # noqa: E741
           "gate_up_scales": lambda E, H, I: (E, _panels(2 * I) * H // 32, PANEL),  # noqa: E741
           "down_blocks": lambda E, H, I: (E, _panels(H) * I // 2, PANEL),  # noqa: E741
           "down_scales": lambda E, H, I: (E, _panels(H) * I // 32, PANEL)}  # noqa: E741
SPEC = Mxfp4PanelFormat(
    name="mxfp4_panel", id=6,
    banks=tuple(dataclasses.replace(b, shape=_SHAPES.get(b.name, b.shape)) for b in mxfp4.SPEC.banks),
    k_multiple=32,
    input_weight=False,
    aliases=("mxfp4_cpu",),
    description="gpt-oss mxfp4 repacked into 64-column panels (K-pair rows contiguous per panel) for CPU "
                "streaming; mxfp4's math, bit-identical results (native W4A16; w4a8 = int8 activations per 32 K)",
    modes=("native", "w4a8"),
    kernel_tiers=mxfp4.SPEC.kernel_tiers,
    # w4a8 only (the layout has no native mode): lanes are rows, so a batch sharing experts folds once per 16 rows
    cpu_layout="mxfp4_x16",
    cpu_layout_min_tier="avx2",  # Zen 3, 2 threads, w4a8: batch 1 1431-1465 against 1522-1624 us (the panels)
)
