"""What every CPU layout (a format that is another format's bytes, moved: q4_0_x16, nvfp4_x16, ds_fp4_x16,
fp8_block_x16) does the same way: its quantizer, random banks and float64 weights go through the source format,
and it is built from the source's banks by its module's `repack(banks)` (read back by `unpack(banks)`)."""
from __future__ import annotations

import sys

import numpy as np

from .._arrays import aligned_empty
from ..schema import BankSpec

GROUP = 16  # rows per group


def pair_groups(a: np.ndarray) -> np.ndarray:
    """[E, R, K] elements (R % 16 == 0, K even) -> groups [E, R/16, K*16], 64-byte aligned: element p*32 + 2r + j
    of a group row = row r's element 2p + j (fp8_block_x16, bf16_x16: a K pair of 16 rows per vector)."""
    a = np.asarray(a)
    E, R, K = a.shape
    out = aligned_empty((E, R // GROUP, K * GROUP), a.dtype)
    out.reshape(E, R // GROUP, K // 2, GROUP, 2)[...] = a.reshape(E, R // GROUP, GROUP, K // 2, 2).transpose(
        0, 1, 3, 2, 4)
    return out


def from_pair_groups(a: np.ndarray) -> np.ndarray:
    """groups [E, G, K*16] -> [E, G*16, K] (the inverse of pair_groups)."""
    a = np.asarray(a)
    E, G, W = a.shape
    K = W // GROUP
    out = aligned_empty((E, G * GROUP, K), a.dtype)
    out.reshape(E, G, GROUP, K // 2, 2)[...] = a.reshape(E, G, K // 2, GROUP, 2).transpose(0, 1, 3, 2, 4)
    return out


def per_expert(fn, a: np.ndarray) -> np.ndarray:
    """fn (one format's whole-bank regrouping, [E, ...] -> [E, ...]) run one expert at a time into one 64-byte
    aligned array, so its temporaries (transposes copied by reshape, concatenations) are one expert's: on a whole
    layer they held 2-3 extra copies of the bank at once (a q6_k down of Qwen3-30B: peak 467 MB against 170; the
    full-size Q4_K_M load's peak RSS 22.34 -> 21.93 GB)."""
    a = np.asarray(a)
    first = fn(a[:1])
    out = aligned_empty((a.shape[0],) + first.shape[1:], first.dtype)
    out[:1] = first
    for e in range(1, a.shape[0]):
        out[e:e + 1] = fn(a[e:e + 1])
    return out


class CpuLayout:
    """Mixin before the source format's class: `source` is the source SPEC; the subclass's module defines
    repack(source banks) -> banks and unpack(banks) -> source banks."""

    source = None

    def _module(self):
        return sys.modules[type(self).__module__]

    def from_source(self, banks):
        """From the source format's banks: one gather per bank where the repack is a byte permutation (_moves.py;
        1.6-4.5x faster than the module's regrouping on a Qwen3-30B-A3B layer, one thread), else the module's repack."""
        _, (_, H, I) = self.source.validate(banks)  # noqa: E741
        moves = self.moves_from(self.source, H, I)
        return moves.apply(banks) if moves is not None else self._module().repack(banks)

    def moves_from(self, source, H: int, I: int):  # noqa: E741
        from ._moves import byte_moves

        return byte_moves(self.name, H, I) if source is self.source else None

    def repack_from(self, banks):  # from the format whose cpu_layout this is (the source, unless overridden)
        return self.from_source(banks)

    def quantize(self, gate_up, down, **opts):
        """As the source format's quantize (the same codes and scales), then the repack."""
        return self._module().repack(self.source.quantize(gate_up, down, **opts))

    def random_banks(self, E, H, I, rng):  # noqa: E741
        self.check_dims(H, I)  # this layout's own shape rules first (fp8_block takes any H, I; its layout does not)
        return self._module().repack(self.source.random_banks(E, H, I, rng))

    def dequantize(self, banks):
        return self.source.dequantize(self._module().unpack(banks))


def regroup(spec, fn, banks) -> dict:
    """`spec`'s banks, validated, each regrouped by fn one expert at a time (per_expert): new arrays. Threads: any."""
    arrs, _ = spec.validate(banks)
    return {n: per_expert(fn, a) for n, a in zip(spec.bank_names, arrs)}


def group_banks(qk: int, gb: int) -> tuple:
    """The two banks of a BlockGroups layout: gate_up [E, 2I/16, (H/qk)*gb], down [E, H/16, (I/qk)*gb], uint8."""
    return (BankSpec("gate_up", (np.uint8,), lambda E, H, I: (E, 2 * I // GROUP, H // qk * gb), align=1),
            BankSpec("down", (np.uint8,), lambda E, H, I: (E, H // GROUP, I // qk * gb), align=1))


class BlockGroups(CpuLayout):
    """A GGUF block format's bytes with 16 rows interleaved per block (q4_0_x16, q8_0_x16, q4_k_x16, q5_k_x16,
    q6_k_x16): a bank row is a group of 16 weight rows, `group_bytes` per group and block (group_banks); the
    module's repack / unpack regroup every bank (regroup)."""

    group_bytes = 0

    def dims(self, banks):
        gu, dn, gb = banks["gate_up"], banks["down"], self.group_bytes
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"{self.name} banks must be 3-D, got gate_up {gu.shape}, down {dn.shape}")
        if gu.shape[2] % gb or dn.shape[2] % gb:
            raise ValueError(f"{self.name} bank rows hold {gb}-byte group blocks: gate_up row {gu.shape[2]} bytes, "
                             f"down row {dn.shape[2]} bytes must be multiples of {gb}")
        if gu.shape[1] % 2:
            raise ValueError(f"{self.name} bank 'gate_up': dim 1 = {gu.shape[1]} must be 2I/16 (even)")
        return gu.shape[0], dn.shape[1] * GROUP, gu.shape[1] * GROUP // 2
