"""The C heap after a big conversion: glibc keeps freed pages in its per-thread malloc arenas; trim() gives them back.

Thread contract: plain functions (malloc_trim takes glibc's own locks)."""
from __future__ import annotations

import functools


def trim() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere). A layer's conversion
    frees its temporaries into the converting threads' arenas: on the full-size Q4_K_M file (2 cores) the loaded
    model sat 0.27 GB higher in RSS without a trim after each layer."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None
