"""Streaming helpers: page-cache release for files written far larger than memory, and per-layer progress."""
from __future__ import annotations

import os
import sys
import time

DROP_EVERY = 512 << 20  # bytes: a sync per 512 MB keeps the dirty page cache far below the 24 GB machine's memory


def drop_cache(path_or_fd) -> None:
    """Write the file's dirty pages and let the kernel drop its cached pages: a 19 GB file written on a 24 GB
    machine otherwise evicts every other process's cache on the way (Linux; a no-op elsewhere)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path_or_fd, os.O_RDONLY) if isinstance(path_or_fd, (str, os.PathLike)) else path_or_fd
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        if fd is not path_or_fd:
            os.close(fd)


class Progress:
    """One line per step on stderr ('layer 12/48  4.93 GB  61.0 s'), and the totals. Single-threaded."""

    def __init__(self, total: int, what: str, enabled: bool = True):
        self.total, self.what, self.enabled = total, what, enabled
        self.t0, self.bytes, self.done = time.perf_counter(), 0, 0

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes

    def step(self, label: str = "layer") -> None:
        self.done += 1
        if self.enabled:
            print(f"[synth] {self.what}: {label} {self.done}/{self.total}  {self.bytes / 1e9:.2f} GB  "
                  f"{time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0
