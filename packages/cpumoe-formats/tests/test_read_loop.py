"""The read ceiling's loop (csrc/step.cpp read_sum): every 128-byte block read once, whatever the size, so the
GB/s it reports are bytes it read. Its checksum is known per path: with AVX2 the 64-bit words of each 128-byte
block at indices 0 and 3 mod 4 (four ymm lanes folded, lanes 0 and 3 kept); without, the first word of each
64-byte line."""
import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats import _native

STAGGER = 4096 + 128  # the streams' extra spacing in step.cpp


def _want(words: np.ndarray, avx2: bool) -> int:
    idx = np.arange(words.size)
    keep = ((idx % 4 == 0) | (idx % 4 == 3)) if avx2 else (idx % 8 == 0)
    return int(words[keep].sum(dtype=np.uint64))


# small (the tail alone), around 3 x STAGGER (no streams yet / the first), ragged, a power of two of words
SIZES = [128, 384, 3 * STAGGER, 3 * STAGGER + 128, 3 * STAGGER + 512, 4 * 128 + 3 * STAGGER,
         (1 << 20) + 3 * 128, 1 << 22, 5_000_064]


@pytest.mark.parametrize("n", SIZES)
def test_read_sum_reads_each_block_once(n):
    rng = np.random.default_rng(n)
    words = rng.integers(0, 1 << 62, size=n // 8, dtype=np.uint64)
    avx2 = "avx2" in cf.usable_tiers()
    got = _native.read_sum(words.ctypes.data, words.nbytes)
    assert got == _want(words, avx2)


def test_read_sum_ignores_a_partial_block():
    """n is taken down to whole 128-byte blocks: bytes past them are not read (they may be past the buffer)."""
    words = np.random.default_rng(1).integers(0, 1 << 62, size=64, dtype=np.uint64)  # 512 bytes
    avx2 = "avx2" in cf.usable_tiers()
    assert _native.read_sum(words.ctypes.data, 512 - 8) == _want(words[:48], avx2)
