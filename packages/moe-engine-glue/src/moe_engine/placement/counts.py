"""Routing counts on the device: a [layers, E] int32 histogram of every decode step's expert ids, accumulated by
fixed-shape torch ops inside the step (capture-safe: no host sync, no data-dependent shape), and read between steps
without stalling the decode stream (a copy on a side stream into pinned host memory, gated by an event).

The device table only ever grows (int32, wrapping): a reader takes differences of snapshots modulo 2**32, so nothing
resets it from the host and a captured graph keeps adding to the same memory.

Thread contract: owned by its MoERunner; add() runs in the step (under the runner's lock or inside a graph the
runner's caller replays), snapshot() / poll() between steps on the thread driving the device."""
from __future__ import annotations

import numpy as np


class RoutingCounts:
    def __init__(self, layers: int, E: int, max_routes: int, device):
        import torch

        self.layers, self.E, self.device = layers, E, device
        # column E takes the routes that name no expert (-1, or out of range: the executor reports those)
        self.table = torch.zeros((layers, E + 1), dtype=torch.int32, device=device)
        self._ones = torch.ones(max_routes, dtype=torch.int32, device=device)
        cuda = device.type == "cuda"
        self._host = torch.zeros((layers, E + 1), dtype=torch.int32, pin_memory=cuda)
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._event = None
        self._last = np.zeros((layers, E), np.int64)

    def add(self, layer: int, ids) -> None:
        """Count one step's ids [T, top_k] of `layer`: on the current stream, capture-safe."""
        import torch

        v = ids.reshape(-1).long()
        v = torch.where((v >= 0) & (v < self.E), v, torch.full_like(v, self.E))
        self.table[layer].index_add_(0, v, self._ones[: v.numel()])

    def reset(self) -> None:
        """Forget every count (stream-ordered on the current stream); for start-up, before any step is served."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self.table.zero_()
        self._host.zero_()
        self._last[:] = 0

    def snapshot(self) -> None:
        """Start copying the table to pinned host memory, ordered after the work queued so far; returns at once."""
        import torch

        if self._stream is None:
            self._host.copy_(self.table)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._host.copy_(self.table, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)

    def poll(self):
        """The routes per expert [layers, E] (int64) since the last poll that returned them, once the latest
        snapshot has landed; None while it is still in flight."""
        if self._event is not None and not self._event.query():
            return None
        self._event = None
        now = self._host[:, : self.E].numpy().astype(np.int64) & 0xFFFFFFFF
        delta = (now - self._last) & 0xFFFFFFFF  # the int32 table wraps; differences stay right modulo 2**32
        self._last = now
        return delta

    def poll_now(self) -> np.ndarray:
        """snapshot() then poll(), waiting for the copy: the routes since the last poll (tests, profiles)."""
        self.snapshot()
        if self._event is not None:
            self._event.synchronize()
        return self.poll()

    def total(self) -> np.ndarray:
        """Every count so far [layers, E], synchronously (for a profile after a calibration run)."""
        self.snapshot()
        if self._event is not None:
            self._event.synchronize()
        return self._host[:, : self.E].numpy().astype(np.int64) & 0xFFFFFFFF


PROFILE_VERSION = 1


def save_routing_profile(path: str, counts, *, steps: int, format: str | None = None) -> str:
    """Write routed counts [layers, E] (a calibration run) as JSON, atomically."""
    import json
    import os
    import tempfile

    c = np.asarray(counts, np.int64)
    if c.ndim != 2:
        raise ValueError(f"counts: shape {c.shape}, expected [layers, E]")
    d = {"version": PROFILE_VERSION, "kind": "routing-counts", "layers": c.shape[0], "E": c.shape[1],
         "steps": int(steps), "format": format, "counts": c.tolist()}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".routing-", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(d, f)
    os.replace(tmp, path)
    return path


def load_routing_profile(src, *, layers: int, E: int) -> np.ndarray:
    """counts [layers, E] from a routing profile (a path from save_routing_profile, or an array)."""
    import json

    where = "routing_profile"
    if isinstance(src, (str, bytes)) or hasattr(src, "__fspath__"):
        where = f"routing_profile {src}"
        with open(src) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e}); rerun `moe-engine profile`") from None
        if not isinstance(d, dict) or d.get("kind") != "routing-counts" or d.get("version") != PROFILE_VERSION:
            raise ValueError(f"{where}: expected a version {PROFILE_VERSION} routing-counts file from "
                             "`moe-engine profile`")
        src = d["counts"]
    c = np.asarray(src)
    if c.shape != (layers, E) or c.dtype.kind not in "iuf" or (c < 0).any():
        raise ValueError(f"{where}: counts of shape {c.shape}, expected non-negative counts [layers={layers}, "
                         f"E={E}] (a profile of another model?)")
    return c.astype(np.float64)
