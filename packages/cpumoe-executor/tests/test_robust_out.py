"""`out=` buffers a decode must not write, every format (conftest.FORMATS): read-only ones (a flag, an immutable
bytes object, a PROT_READ mapping: written through, or a SIGSEGV, before), the wrong dtype or shape, strided,
misaligned. Each is refused before the native call with an error naming `out` and what was expected, and the
buffer is left as it was. The patterns also fit cpumoe_formats.arrays.check_array, the formats' own check."""
import mmap
import re

import numpy as np
import pytest
from conftest import FORMATS, bits, executor_for, step_inputs

from cpumoe_formats.numerics import BF16

T = 3


def bad_outs(H):
    """(what, buffer, error type, message pattern) for each way an out= can be wrong."""
    n = T * H * 2
    flagged = np.zeros((T, H), BF16)
    flagged.flags.writeable = False
    immutable = bytes(n)
    ro_map = mmap.mmap(-1, n, prot=mmap.PROT_READ)
    raw = np.zeros(n + 1, np.uint8)
    return [
        ("read-only flag", flagged, ValueError, "out: .*read-only"),
        ("bytes", np.frombuffer(immutable, BF16).reshape(T, H), ValueError, "out: .*read-only"),
        ("PROT_READ mapping", np.frombuffer(ro_map, BF16).reshape(T, H), ValueError, "out: .*read-only"),
        ("float32", np.zeros((T, H), np.float32), ValueError, "out: .*dtype float32"),
        ("uint16", np.zeros((T, H), np.uint16), ValueError, "out: .*dtype uint16"),
        ("shape", np.zeros((T + 1, H), BF16), ValueError, rf"out: shape \({T + 1}, {H}\)"),
        ("transposed", np.zeros((H, T), BF16).T, ValueError, "out: .*not C-contiguous"),
        ("every other row", np.zeros((2 * T, H), BF16)[::2], ValueError, "out: .*not C-contiguous"),
        ("misaligned", raw[1:].view(BF16).reshape(T, H), ValueError, "out: .*not 2-byte aligned"),
        ("not an array", [[0.0] * H] * T, TypeError, "out must be a numpy array"),
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_out_is_refused_before_the_native_call(fmt, rng):
    ex, _, _ = executor_for(fmt, rng)
    s = step_inputs(rng, ex, T)
    want = bits(ex.decode(0, *s)).copy()
    expected = rf"expected .*bfloat16 of shape \({T}, {ex.H}\), writable"  # cpumoe_formats' check_array's words
    for what, out, err, msg in bad_outs(ex.H):
        before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
        with pytest.raises(err, match=msg) as e:
            ex.decode(0, *s, out=out)
        if what != "not an array":
            assert re.search(expected, str(e.value)), (what, str(e.value))
        if before is not None:
            assert out.tobytes() == before.tobytes(), f"{what} was written"
    good = np.empty((T, ex.H), BF16)
    assert ex.decode(0, *s, out=good) is good and (bits(good) == want).all()
    ex.close()
