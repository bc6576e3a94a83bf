"""CpuMoeExecutor's IO block and doorbell (docs/protocol.md, version 1) and its health words: the block's addresses
and views, the coordinator that polls the doorbell, the host-function arguments, and the served / error state.

Thread contract: CpuMoeExecutor's (any thread may call any method; see its docstring)."""
from __future__ import annotations

import logging

import numpy as np

from cpumoe_formats.numerics import BF16

from . import _native

log = logging.getLogger("cpumoe_executor")


class Doorbell:
    """Mixin of CpuMoeExecutor: needs its _x, H, top_k, max_tokens, num_layers, core_ids and _check."""

    def io_block(self) -> dict:
        """Addresses and layout of the IO block (docs/protocol.md). The addresses stay valid while the dict's
        "owner" (the block's memory, which io_arrays' views hold too) or this executor lives."""
        self._check()
        mem = self._x.io_memory()
        base = mem.address
        hdr = np.frombuffer(mem, np.uint64, count=9)  # up to total_bytes
        x_off, ids_off, w_off, y_off, total = (int(v) for v in hdr[4:9])
        return {
            "owner": mem, "version": _native.PROTOCOL_VERSION, "magic": _native.IOB_MAGIC, "base": base,
            "bytes": total,
            "ready": base + 128, "done": base + 192, "error": base + 256, "served": base + 320,
            "x": base + x_off, "ids": base + ids_off, "w": base + w_off, "y": base + y_off,
            "layout": {"x": ("bfloat16", (self.max_tokens, self.H)), "ids": ("int32", (self.max_tokens, self.top_k)),
                       "w": ("float32", (self.max_tokens, self.top_k)), "y": ("bfloat16", (self.max_tokens, self.H))},
            "max_tokens": self.max_tokens, "hidden": self.H, "top_k": self.top_k, "num_layers": self.num_layers,
        }

    def io_arrays(self) -> dict:
        """numpy views of x, ids, w, y inside the IO block. Each keeps the block's memory alive: writing one after
        close() or `del` of the executor is safe (and reaches no one)."""
        iob = self.io_block()
        raw = np.frombuffer(iob["owner"], np.uint8)
        out = {}
        for name, (dt, shape) in iob["layout"].items():
            dtype = BF16 if dt == "bfloat16" else np.dtype(dt)
            off, n = iob[name] - iob["base"], int(np.prod(shape)) * dtype.itemsize
            out[name] = raw[off:off + n].view(dtype).reshape(shape)
        return out

    def start_coordinator(self, ready: int | None = None, done: int | None = None, error: int | None = None,
                          core: int | None = None) -> None:
        """Start polling the doorbell (the IO block's words unless a sync backend gives its own)."""
        self._check()
        c = self.core_ids[0] if core is None else int(core)
        self._x.start_coordinator(ready or 0, done or 0, error or 0, c)
        log.info("cpumoe_executor coordinator polling on core %d", c)

    def stop_coordinator(self) -> None:
        """Stop polling; writes done = SHUTDOWN so any waiter is released (a doorbell rung and not served sets the
        error word). A no-op once closed or in a forked child."""
        self._x.stop_coordinator()

    def hostfn_arg(self, layer: int, num_tokens: int) -> int:
        """The stable argument (cpumoe_hostfn_arg*) of the host-function entry points for (layer, num_tokens):
        valid while this object lives."""
        self._check()
        a = self._x.hostfn_arg(layer, num_tokens)
        if not a:
            raise ValueError(f"layer={layer}, num_tokens={num_tokens}: need layer < {self.num_layers} and "
                             f"1 <= num_tokens <= max_tokens={self.max_tokens}")
        return a

    def health(self) -> dict:
        """Doorbells served, service and busy time, the ready / done / error words and the error message."""
        iob = self.io_block()
        return {"served": self._x.served, "service_s": self._x.service_ns / 1e9, "busy_s": self._x.busy_ns / 1e9,
                "ready": _native.load_u64(iob["ready"]), "done": _native.load_u64(iob["done"]),
                "error": _native.load_u64(iob["error"]), "error_message": self._x.last_error(),
                "coordinator_running": self._x.coordinator_running}

    def raise_if_unhealthy(self, stuck_after_s: float = 10.0) -> None:
        """Raise RuntimeError if a task failed (error word) or one has run longer than stuck_after_s."""
        h = self.health()
        if h["error"]:
            raise RuntimeError(f"cpumoe executor task failed (error code {h['error']}): {h['error_message']}")
        if h["busy_s"] > stuck_after_s:
            raise RuntimeError(f"cpumoe executor step running for {h['busy_s']:.1f} s (> {stuck_after_s} s): stuck")

    def clear_error(self) -> None:
        self._check()
        self._x.clear_error()
