"""fp8_block experts: DeepSeek-V3-style 128x128 block FP8 (Qwen3.5/3.6-FP8).

Banks (slot order):
  gate_up       [E, 2I, H]               float8_e4m3fn (uint8 accepted)
  gate_up_scale [E, nb(2I), >= nb(H)]    bfloat16 (uint16 accepted)
  down          [E, H, I]                float8_e4m3fn
  down_scale    [E, nb(H), >= nb(I)]     bfloat16
with nb(n) = ceil(n / 128). gate_up rows 0..I-1 are gate, I..2I-1 up.

    w[r, k] = e4m3(code[r, k]) * scale[r // 128, k // 128]

The scale MULTIPLIES (upstream calls it weight_scale_inv) and is indexed
[output-row block][K block]. The scale banks' last dim may be padded: the
reference allocates fp8_block_scale_pad(rows, cols) columns (cols grown until
rows * cols * 2 bytes is a multiple of 16), e.g. H=2560, I=640 gives down_scale
[E, 20, 6]. Kernels take the scale row stride from the bank view and never read
the padding. Any H and I (partial 128-blocks and K tails are handled).
e4m3 codes 0x7F/0xFF decode to +-480 (no NaN), subnormals m * 2^-9.
Activations are consumed as bf16 values (W8A16); accumulation is fp32.
"""
from __future__ import annotations

import numpy as np

from .._arrays import aligned_empty
from ..numerics import BF16, E4M3, bf16_decode, codes, e4m3_decode, to_e4m3
from ..schema import BankSpec, FormatSpec

BLOCK = 128
E4M3_MAX = 448.0


def nb(n: int) -> int:
    """Number of 128-blocks covering n."""
    return -(-int(n) // BLOCK)


def fp8_block_scale_pad(rows: int, cols: int) -> int:
    """The reference's scale-bank column count: cols grown until rows * cols * 2 bytes % 16 == 0."""
    cols = int(cols)
    while (int(rows) * cols * 2) % 16:
        cols += 1
    return cols


def _expand(scale: np.ndarray, R: int, K: int) -> np.ndarray:
    """[E, nb(R), >= nb(K)] block scales -> [E, R, K] float64 (padding columns dropped)."""
    s = bf16_decode(scale)[:, :, :nb(K)]
    return np.repeat(np.repeat(s, BLOCK, axis=1)[:, :R], BLOCK, axis=2)[:, :, :K]


def _block_amax(w: np.ndarray) -> np.ndarray:
    """[E, R, K] -> [E, nb(R), nb(K)] max |w| per 128x128 block (partial edge blocks included)."""
    E, R, K = w.shape
    pr, pk = nb(R) * BLOCK - R, nb(K) * BLOCK - K
    a = np.abs(w)
    if pr or pk:
        a = np.pad(a, ((0, 0), (0, pr), (0, pk)))
    return a.reshape(E, nb(R), BLOCK, nb(K), BLOCK).max(axis=(2, 4))


def _quantize_bank(w: np.ndarray, scale_pad: bool) -> tuple[np.ndarray, np.ndarray]:
    E, R, K = w.shape
    amax = _block_amax(w)
    s = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1.0)).astype(BF16)  # all-zero block: scale 1
    cols = fp8_block_scale_pad(nb(R), nb(K)) if scale_pad else nb(K)
    sbank = aligned_empty((E, nb(R), cols), BF16)
    sbank[...] = 0
    sbank[:, :, :nb(K)] = s
    sf = s.astype(np.float32)
    sfull = np.repeat(np.repeat(sf, BLOCK, axis=1)[:, :R], BLOCK, axis=2)[:, :, :K]
    q = aligned_empty((E, R, K), E4M3)
    q[...] = to_e4m3(w / sfull)  # fp32 division, then e4m3 RNE saturating at +-448
    return q, sbank


class Fp8BlockFormat(FormatSpec):
    def dims(self, banks):
        gu, dn = banks["gate_up"], banks["down"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"fp8_block banks must be 3-D, got gate_up {gu.shape}, down {dn.shape}")
        if gu.shape[1] % 2:
            raise ValueError(f"fp8_block bank 'gate_up': dim 1 = {gu.shape[1]} must be 2*I (even)")
        return gu.shape[0], gu.shape[2], gu.shape[1] // 2

    def quantize(self, gate_up, down, *, scale_pad: bool = True, **opts):
        """Per 128x128 block: scale = bf16(amax / 448) (1 for an all-zero block),
        code = e4m3_rne(fp32(w / scale)) saturating at +-448. Scale banks get the
        reference's padded column count (scale_pad=False: exactly nb(K) columns)."""
        if opts:
            raise TypeError(f"fp8_block quantize takes only scale_pad=, got {sorted(opts)}")
        if not isinstance(scale_pad, bool):
            raise TypeError(f"fp8_block quantize: scale_pad must be a bool, got {type(scale_pad).__name__}")
        gu_q, gu_s = _quantize_bank(np.asarray(gate_up, np.float32), scale_pad)
        dn_q, dn_s = _quantize_bank(np.asarray(down, np.float32), scale_pad)
        return {"gate_up": gu_q, "gate_up_scale": gu_s, "down": dn_q, "down_scale": dn_s}

    def random_banks(self, E, H, I, rng):  # noqa: E741
        """Random e4m3 codes (~N(0, 64^2) values) with block scales ~0.02/64 (weights ~N(0, 0.02)).
        Fast: one random byte per weight indexes a 256-entry code table."""
        table = np.ascontiguousarray(to_e4m3(rng.standard_normal(256, np.float32) * 64)).view(np.uint8)

        def codes_bank(R, K):
            a = aligned_empty((E, R, K), E4M3)
            idx = np.frombuffer(rng.bytes(E * R * K), np.uint8)
            np.take(table, idx, out=a.reshape(-1).view(np.uint8))
            return a

        def scale_bank(R, K):
            s = aligned_empty((E, nb(R), fp8_block_scale_pad(nb(R), nb(K))), BF16)
            s[...] = ((0.5 + rng.random(s.shape, np.float32)) * np.float32(0.02 / 64)).astype(BF16)
            return s

        return {"gate_up": codes_bank(2 * I, H), "gate_up_scale": scale_bank(2 * I, H),
                "down": codes_bank(H, I), "down_scale": scale_bank(H, I)}

    def dequantize(self, banks):
        gu, dn = banks["gate_up"], banks["down"]
        _, H, I = self.dims(banks)  # noqa: E741
        return (e4m3_decode(codes(gu)) * _expand(banks["gate_up_scale"], 2 * I, H),
                e4m3_decode(codes(dn)) * _expand(banks["down_scale"], H, I))

    def bytes_per_expert(self, H, I):  # noqa: E741
        """3 I H code bytes + both scale banks at the reference's padded shapes."""
        gs = nb(2 * I) * fp8_block_scale_pad(nb(2 * I), nb(H))
        ds = nb(H) * fp8_block_scale_pad(nb(H), nb(I))
        return 3 * int(I) * int(H) + 2 * (gs + ds)


SPEC = Fp8BlockFormat(
    name="fp8_block", id=5,
    banks=(BankSpec("gate_up", (E4M3, np.uint8), lambda E, H, I: (E, 2 * I, H), align=1),
           BankSpec("gate_up_scale", (BF16, np.uint16), lambda E, H, I: (E, nb(2 * I), nb(H)), align=2,
                    padded_last=True),
           BankSpec("down", (E4M3, np.uint8), lambda E, H, I: (E, H, I), align=1),
           BankSpec("down_scale", (BF16, np.uint16), lambda E, H, I: (E, nb(H), nb(I)), align=2,
                    padded_last=True)),
    description="128x128 block FP8 e4m3 weights with bf16 block scales (W8A16), fp32 accumulation",
    kernel_tiers={"native": ("scalar", "avx2", "avx512f", "avx512bf16", "amx")},
    # AMX tiles: a batch sharing experts costs little more than one token, but one token reads at about half the
    # avx512f rate; auto keeps avx512f, isa="amx" / CPUMOE_ISA=amx picks the tiles (docs/formats/fp8_block.md)
    opt_in_tiers=("amx",),
    amd_auto_tiers=("avx512bf16",),  # vdpbf16ps kernel: faster than avx512f on Zen 4, slower on the Xeon tested
    cpu_layout="fp8_block_x16",  # 16 rows per vector: a token sharing an expert costs one vdpbf16ps per 32 weights
    # fp32-FMA kernels from avx2 (x16_fma.h): shared batch 8 12% faster than fp8_block's avx2 kernel (Zen 3, 2
    # threads; docs/formats/fp8_block.md)
    cpu_layout_min_tier="avx2",
)
