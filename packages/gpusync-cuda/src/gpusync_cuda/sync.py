"""CudaSync: one CpuMoeExecutor's doorbell on one CUDA device, from Python.

At start-up it registers the executor's IO block, starts the coordinator if it
is not running, probes every path (native probes for memop and host-func,
kernelio's self-test for the kernels) and qualifies the best candidates with a
real decode, eager and under CUDA-graph capture + replay with changed inputs,
against the executor's synchronous result (decode and the split submit/finish with
other GPU work between the halves). The first path that passes is used; one log
line names it. decode() then runs on the current stream and is capture-safe on
every path but eager, which refuses capture with what to do. submit() and finish()
are its two halves, so an engine can run its GPU-resident experts on the same
stream while the CPU works (decode() == submit() + finish()).
torch is imported lazily, only to handle torch tensors.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

from . import _native
from ._native import CaptureRefusedError

log = logging.getLogger("gpusync_cuda")
PATHS = ("kernel", "memop", "host-func", "eager")  # best first
_ID = dict(_native.PATHS)


def _torch():
    import torch  # only when handling torch tensors

    return torch


def _ordinal(device) -> int:
    if device is None:
        torch = sys.modules.get("torch")
        return torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0
    if isinstance(device, int):
        return device
    if getattr(device, "type", "cuda") != "cuda":
        raise ValueError(f"device {device!r} is not a CUDA device")
    idx = getattr(device, "index", None)
    return _ordinal(None) if idx is None else int(idx)


class CudaSync:
    """The GPU side of `executor`'s doorbell on CUDA device `device`.

    paths: the paths allowed, best first (default: kernel, memop, host-func, eager).
    qualify: prove the chosen path with a real decode (eager + graph replay) at start-up.
    """

    def __init__(self, executor, device=None, *, paths=PATHS, timeout_s: float = 10.0, qualify: bool = True):
        import cpumoe_executor

        bad = [p for p in paths if p not in PATHS]
        if bad:
            raise ValueError(f"unknown paths {bad}; expected a subset of {list(PATHS)}")
        if "kernel" in paths:
            self._kernel_wait_forced()  # a bad KERNELIO_WAIT is refused before anything starts
        fork = os.environ.get("GPUSYNC_COPY_FORK")  # read again by the IO block; refused here, before anything starts
        if fork not in (None, "", "0", "1"):
            raise ValueError(f"GPUSYNC_COPY_FORK={fork!r}: expected 0 (serial copies, the default) or 1 (forked); "
                             "unset it for the default")
        self.executor, self.timeout_s, self.ordinal = executor, float(timeout_s), _ordinal(device)
        self.reasons: dict[str, str] = {p: "not tried" for p in PATHS if p != "eager"}
        self.path, self.kernel_image = "eager", None
        # How the kernel path waits for done: "poll" (in combine) or "memop" (stream wait); kernelio's probe
        # chooses, $KERNELIO_WAIT forces (kernelio.probe_wait).
        self.kernel_wait: str | None = None
        self._dev = self._iob = self._kio = None
        self._pending = None  # the submitted, unfinished step (cpumoe_executor.sync_torch.Pending)
        self._started_coordinator = False
        st = _native.driver_status()
        if not (st["loaded"] and st["initialized"]):
            self.reasons = {p: st["error"] for p in self.reasons}
        else:
            try:
                self._dev = _native.Device(self.ordinal)
                self._iob = _native.Iob(self._dev, cpumoe_executor.C_API_CAPSULE, executor.handle, executor)
            except _native.GpuSyncError as e:
                self.reasons = {p: str(e) for p in self.reasons}
        if self._iob is not None:
            if not executor.health()["coordinator_running"]:
                executor.start_coordinator()
                self._started_coordinator = True
            for name in ("memop", "host-func"):
                if name in paths or (name == "memop" and "kernel" in paths):  # the kernel path waits with memops
                    _ok, self.reasons[name] = self._iob.probe(_ID[name], self.timeout_s)
            if "kernel" in paths:
                self._open_kernels()
        for p in paths:
            if self._usable(p) and (p == "eager" or not qualify or self._qualify(p)):
                self.path = p
                break
        if self._iob is not None and self.path == "kernel":
            self._iob.set_replay_safe(_ID["kernel"], True)
        where = f"cuda:{self.ordinal} ({self._dev.name}, sm_{self._dev.cc})" if self._dev else f"cuda:{self.ordinal}"
        log.info("gpusync_cuda: handshake=%s on %s (%s)", self.path, where, self.summary())

    def summary(self) -> str:
        """Each path's verdict, identical reasons grouped: 'memop, host-func: ok; kernel: ...'."""
        groups: dict[str, list[str]] = {}
        for p, r in self.reasons.items():
            ok = self._usable(p) and "failed" not in r
            label = r if not ok else f"ok ({self.kernel_image}, {self.kernel_wait} wait)" if p == "kernel" else "ok"
            groups.setdefault(label, []).append(p)
        return "; ".join(f"{', '.join(ps)}: {r}" for r, ps in groups.items())

    # ---- start-up -----------------------------------------------------------------------------
    def _usable(self, p: str) -> bool:
        if p == "eager":
            return True
        if self._iob is None:
            return False
        if p == "kernel":
            return self._kio is not None and self._iob.replay_safe(_ID["memop"])
        return self._iob.replay_safe(_ID[p])

    def _open_kernels(self) -> None:
        try:
            import kernelio
        except ImportError:
            self.reasons["kernel"] = "kernelio is not installed"
            return
        if not self._iob.replay_safe(_ID["memop"]):
            self.reasons["kernel"] = "needs the memop wait, which failed its probe"
            return
        try:
            data = kernelio.image()
        except OSError as e:
            self.reasons["kernel"] = str(e)
            return
        wait, msg = kernelio.probe_wait(_native._C_API_v1, self._dev, data, self.timeout_s)
        if wait is None:
            self.reasons["kernel"] = msg
            warnings.warn(f"gpusync_cuda: kernel IO unavailable, decoding with copies + memops instead: {msg}",
                          RuntimeWarning, stacklevel=3)
            log.warning("kernel IO unavailable (%s); falling back to copies + memops", msg)
            return
        iob = self.executor.io_block()
        io = {k: self._iob.dptr(iob[k]) for k in ("x", "ids", "w", "y", "ready", "done")}
        io.update(H=self.executor.H, K=self.executor.top_k, max_tokens=self.executor.max_tokens)
        try:
            self._kio = kernelio.open_kernels(_native._C_API_v1, self._dev, io, data)
        except Exception as e:  # noqa: BLE001 - the path is unavailable, the others stay
            self.reasons["kernel"] = f"kernelio failed to open: {e}"
            return
        entries = kernelio.fatbin_entries(data) if data[:4] == b"\x50\xed\x55\xba" else []
        # A cubin runs on its own major at an equal or higher minor; else the driver JITs the PTX.
        major, minor = divmod(self._dev.cc, 10)
        sass = [a for k, a in entries if k == "sass" and int(a[3:]) // 10 == major and int(a[3:]) % 10 <= minor]
        self.kernel_image = f"{sass[-1]} SASS" if sass else "PTX (JIT)"
        self.kernel_wait = wait
        how = "waits in-kernel" if wait == "poll" else f"memop wait: {msg}"
        self.reasons["kernel"] = f"kernelio probe passed ({self.kernel_image}; {how})"

    def _qualify(self, path: str) -> bool:
        """Eager and graph-replayed decode on `path` == the executor's synchronous result, bit for bit."""
        try:
            torch = _torch()
        except ImportError:
            self.reasons[path] += "; not qualified (torch is not importable)"
            return path != "kernel"
        from cpumoe_executor.sync_qualify import qualify

        kid = _ID["kernel"]
        was = self._iob.replay_safe(kid)
        if path == "kernel":
            self._iob.set_replay_safe(kid, True)  # lets the probe's capture record the wait
        try:
            qualify(self, path, torch)
            return True
        except Exception as e:  # noqa: BLE001 - any failure disqualifies the path
            if path == "kernel" and self.kernel_wait == "poll" and self._kernel_wait_forced() is None:
                # The in-kernel wait failed under replay: the kernels with a memop wait may still qualify.
                self.kernel_wait = "memop"
                self.reasons[path] += f"; in-kernel wait did not qualify ({type(e).__name__}: {e}): memop wait"
                warnings.warn(f"gpusync_cuda: kernelio's in-kernel wait failed its qualification, waiting with "
                              f"memops instead: {e}", RuntimeWarning, stacklevel=3)
                return self._qualify(path)
            self.reasons[path] = f"failed qualification: {type(e).__name__}: {e}"
            warnings.warn(f"gpusync_cuda: the {path} path failed its start-up qualification: {e}", RuntimeWarning,
                          stacklevel=3)
            if path != "kernel":
                self._iob.set_replay_safe(_ID[path], False)
            return False
        finally:
            self._iob.set_replay_safe(kid, was)

    @staticmethod
    def _kernel_wait_forced() -> str | None:
        """$KERNELIO_WAIT ('poll' | 'memop', ValueError otherwise), None when unset or kernelio is absent."""
        try:
            import kernelio
        except ImportError:
            return None
        return kernelio.wait_override()

    # ---- decode ---------------------------------------------------------------------------------
    def decode(self, layer: int, x, topk_weights, topk_ids, residency_mask=None, *, out=None, partial=None):
        """y [T, H] bf16 of `layer`'s CPU experts on the current stream (capture-safe unless eager).

        residency_mask: bool/u8 [E] on the GPU, True = the expert runs on the GPU (its routes are
        skipped here). out: write y into it; partial: add y into it in place (a GPU partial result).
        Returns the tensor holding the result. Exactly submit() + finish(), every argument checked first."""
        return self._decode(self.path, layer, x, topk_weights, topk_ids, residency_mask, out, partial)

    def submit(self, layer: int, x, topk_weights, topk_ids, residency_mask=None) -> None:
        """The first half of decode() on the current stream: checks the step (shapes, dtypes, devices,
        batch <= max_tokens) before anything is enqueued, then rings the CPU (kernel path: the publish
        kernel; copy paths: the device-to-host copies and the doorbell; eager: the CPU decodes now). The
        caller may enqueue other GPU work on the same stream, then calls finish(layer). One task in flight:
        RuntimeError naming the pending layer while one is submitted and not finished (also while capturing a
        graph: the graph then holds both halves). Eager path: CaptureRefusedError under capture."""
        self._submit(self.path, layer, x, topk_weights, topk_ids, residency_mask)

    def finish(self, layer: int, *, out=None, partial=None):
        """The second half, on the stream submit ran on: waits for the CPU's done and brings y back (kernel path:
        the memop or in-kernel wait + combine; copy paths: the wait + host-to-device copy), written into out or
        added into partial ([T, H] for the submitted T). Returns the tensor holding the result. RuntimeError
        when nothing is pending, ValueError naming both layers when another layer was submitted; after any
        error nothing is pending (the task is abandoned, its CPU work drained first when it was issued)."""
        return self._finish(layer, out, partial)

    @property
    def pending_layer(self) -> int | None:
        """The layer submitted and not finished yet, or None."""
        return None if self._pending is None else self._pending.layer

    def _decode(self, path, layer, x, w, ids, mask, out, partial):
        from cpumoe_executor.sync_torch import decode_step

        from . import _decode

        return decode_step(self, _decode.submit, _decode.finish, path, layer, x, w, ids, mask, out, partial)

    def _submit(self, path, layer, x, w, ids, mask, target=None) -> None:
        from cpumoe_executor.sync_torch import submit_step

        from . import _decode

        submit_step(self, _decode.submit, path, layer, x, w, ids, mask, target)

    def _finish(self, layer, out, partial):
        from cpumoe_executor.sync_torch import finish_step

        from . import _decode

        return finish_step(self, _decode.finish, layer, out, partial)

    # ---- waits and health -----------------------------------------------------------------------
    def synchronize(self, stream=None, timeout_s: float | None = None) -> None:
        """Wait for `stream` (default: current) at most timeout_s; on expiry the stream is released
        (done := SHUTDOWN) and TimeoutError names the executor's state. Never hangs. With the in-kernel
        wait, also raises TimeoutError when a combine kernel gave up waiting (its own bound,
        kio.poll_timeout_s) since the last call: that step's output was not written."""
        torch = _torch()
        s = torch.cuda.current_stream(self.ordinal) if stream is None else stream
        h = getattr(s, "cuda_stream", s)
        t = self.timeout_s if timeout_s is None else timeout_s
        ok = self._iob.sync(h, t) if self._iob is not None else bool(s.synchronize() or True)
        if not ok:
            raise TimeoutError(f"gpusync_cuda: stream did not complete within {t} s and was released; "
                               f"executor health: {self.executor.health()}")
        if self._kio is not None and self.kernel_wait == "poll":
            n = self._kio.poll_timeouts(True)
            if n:
                raise TimeoutError(f"gpusync_cuda: {n} kernelio combine block(s) gave up waiting for done after "
                                   f"{self._kio.poll_timeout_s:g} s and left their output unwritten; "
                                   f"executor health: {self.executor.health()}")

    def pending(self) -> bool:
        """A doorbell rung and not answered yet."""
        h = self.executor.health()
        return h["ready"] != 0 or h["done"] == 0

    def close(self) -> None:
        self._pending = None
        self._kio = None
        self._iob = None  # unregisters the IO block
        if self._started_coordinator:
            self.executor.stop_coordinator()
            self._started_coordinator = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["CaptureRefusedError", "CudaSync", "PATHS"]
