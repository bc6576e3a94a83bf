"""What the GGUF block formats (q4_0, q8_0, q4_k, q5_k, q6_k) share: banks that are the file's tensor bytes,
``gate_up [E, 2I, (H/QK)*BLOCK_BYTES]`` and ``down [E, H, (I/QK)*BLOCK_BYTES]`` uint8, quantized and decoded row by
row by the format's own module; random banks of random bytes whose fp16 scale fields are set to normal values of
random sign; and w4a8 activations quantized per QK-block by the Q8_0 rule (numerics.int8_blocks)."""
from __future__ import annotations

import numpy as np

from ..numerics import int8_blocks
from ..schema import BankSpec, FormatSpec

_F32 = np.float32


def gguf_banks(qk: int, block_bytes: int) -> tuple:
    """The two banks' specs of a GGUF block format."""
    return (BankSpec("gate_up", (np.uint8,), lambda E, H, I: (E, 2 * I, H // qk * block_bytes), align=1),  # noqa: E741
            BankSpec("down", (np.uint8,), lambda E, H, I: (E, H, I // qk * block_bytes), align=1))  # noqa: E741


class GgufBlockFormat(FormatSpec):
    """A subclass sets QK (elements per block), BLOCK_BYTES, RANDOM_SCALES ((byte offset, lowest magnitude, scale)
    of each fp16 field random_banks fills with (lowest + U[0, 1)) * scale, random sign), quantize_rows and
    decode_blocks (staticmethods: float rows -> block bytes, block bytes -> float64 rows), and GGUF_TYPE (the
    file's type name, for messages)."""

    QK: int
    BLOCK_BYTES: int
    RANDOM_SCALES: tuple
    GGUF_TYPE: str

    def check_dims(self, H: int, I: int) -> None:  # noqa: E741
        if H <= 0 or I <= 0 or H % self.QK or I % self.QK:
            raise ValueError(f"{self.name}: H and I must be positive multiples of {self.QK} (a {self.GGUF_TYPE} block "
                             f"is {self.QK} elements; Qwen3-30B-A3B has H=2048, I=768), got H={H}, I={I}")

    def dims(self, banks):
        gu, dn = banks["gate_up"], banks["down"]
        if gu.ndim != 3 or dn.ndim != 3:
            raise ValueError(f"{self.name} banks must be 3-D, got gate_up {gu.shape}, down {dn.shape}")
        if gu.shape[1] % 2:
            raise ValueError(f"{self.name} bank 'gate_up': dim 1 = {gu.shape[1]} must be 2*I (even)")
        return gu.shape[0], dn.shape[1], gu.shape[1] // 2

    def quantize(self, gate_up, down, **opts):
        if opts:
            raise TypeError(f"{self.name} quantize takes no options, got {sorted(opts)}")
        return {"gate_up": self.quantize_rows(gate_up), "down": self.quantize_rows(down)}

    def random_banks(self, E, H, I, rng):  # noqa: E741
        self.check_dims(H, I)
        qk, bb = self.QK, self.BLOCK_BYTES

        def bank(rows, K):
            nb = K // qk
            raw = np.frombuffer(rng.bytes(E * rows * nb * bb), np.uint8).copy()
            b = raw.reshape(E, rows, nb, bb)
            for off, lo, scale in self.RANDOM_SCALES:
                mag = rng.random((E, rows, nb), dtype=np.float32) + _F32(lo)
                sign = np.where(rng.random((E, rows, nb)) < 0.5, _F32(-1), _F32(1))
                b[..., off:off + 2] = (mag * sign * _F32(scale)).astype("<f2")[..., None].view(np.uint8)
            return raw.reshape(E, rows, nb * bb)

        return {"gate_up": bank(2 * I, H), "down": bank(H, I)}

    def dequantize(self, banks):
        return self.decode_blocks(banks["gate_up"]), self.decode_blocks(banks["down"])

    def act_in(self, v, mode):
        v = np.asarray(v, np.float64)
        if mode == "native":
            return v
        if mode != "w4a8":
            raise ValueError(f"{self.name}: unknown mode {mode!r}")
        q, d = int8_blocks(v, self.QK)
        return (q.astype(np.float64) * d.astype(np.float64)[:, None]).reshape(v.shape)
