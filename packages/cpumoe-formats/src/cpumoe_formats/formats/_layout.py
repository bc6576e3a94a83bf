"""What every CPU layout (a format that is another format's bytes, moved: q4_0_x16, nvfp4_x16, ds_fp4_x16,
fp8_block_x16) does the same way: its quantizer, random banks and float64 weights go through the source format,
and it is built from the source's banks by its module's `repack(banks)` (read back by `unpack(banks)`)."""
from __future__ import annotations

import sys


class CpuLayout:
    """Mixin before the source format's class: `source` is the source SPEC; the subclass's module defines
    repack(source banks) -> banks and unpack(banks) -> source banks."""

    source = None

    def _module(self):
        return sys.modules[type(self).__module__]

    def repack_from(self, banks):  # from the format whose cpu_layout this is
        return self._module().repack(banks)

    def quantize(self, gate_up, down, **opts):
        """As the source format's quantize (the same codes and scales), then the repack."""
        return self._module().repack(self.source.quantize(gate_up, down, **opts))

    def random_banks(self, E, H, I, rng):  # noqa: E741
        self.check_dims(H, I)  # this layout's own shape rules first (fp8_block takes any H, I; its layout does not)
        return self._module().repack(self.source.random_banks(E, H, I, rng))

    def dequantize(self, banks):
        return self.source.dequantize(self._module().unpack(banks))
