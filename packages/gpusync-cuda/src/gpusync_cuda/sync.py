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

from cpumoe_executor.sync_torch import Pending, StepSync, apply, mask_ids

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


def _bf16_rows(torch, t) -> bool:
    return t.dtype == torch.bfloat16 and t.stride(-1) == 1


class CudaSync(StepSync):
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
        self.ordinal = _ordinal(device)
        super().__init__(executor, f"cuda:{self.ordinal}", timeout_s)
        self.reasons: dict[str, str] = {p: "not tried" for p in PATHS if p != "eager"}
        self.path, self.kernel_image = "eager", None
        # How the kernel path waits for done: "poll" (in combine) or "memop" (stream wait); kernelio's probe
        # chooses, $KERNELIO_WAIT forces (kernelio.probe_wait).
        self.kernel_wait: str | None = None
        self._dev = self._iob = self._kio = None
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

    # ---- the step's native halves (StepSync does the checks and the bookkeeping) ----------------------------
    def _enqueue(self, torch, path, layer, T, x, w, ids, mask, target) -> Pending:
        ex = self.executor
        if path == "kernel" and not (_bf16_rows(torch, x) and (target is None or _bf16_rows(torch, target))):
            # Kernel IO moves bf16 only: this step takes the best copy path.
            path = next((p for p in ("memop", "host-func") if self._usable(p)), "eager")
            if path == "eager":
                if torch.cuda.is_current_stream_capturing():
                    raise self._refused(path)
                return Pending(layer, T, "eager", x.device, y=self._eager_y(torch, layer, x, w, ids, mask))
        cap = torch.cuda.is_current_stream_capturing()
        stream = torch.cuda.current_stream(x.device)
        h = stream.cuda_stream
        ids32, w32 = ids.to(torch.int32), w.to(torch.float32)  # no copy when they already are
        if ids32.stride(-1) != 1 or w32.stride(-1) != 1:  # the kernels take a row stride only
            ids32, w32 = ids32.contiguous(), w32.contiguous()
        if path == "kernel":
            m = None
            if mask is not None:
                m = mask.view(torch.uint8) if mask.dtype in (torch.bool, torch.uint8) else (mask != 0).to(torch.uint8)
                m = m.contiguous()
            # In-kernel wait (the probe passed it): combine polls done itself, which costs less in a graph than a
            # satisfied stream memop wait; else the memop wait, then a plain combine.
            self._kio.publish(h, T, x.data_ptr(), x.stride(0), ids32.data_ptr(), ids32.stride(0), w32.data_ptr(),
                              w32.stride(0), 0 if m is None else m.data_ptr(), ex.E, (layer << 32) | T)
            return Pending(layer, T, "kernel", x.device, stream=stream, capturing=cap, keep=(x, ids32, w32, m),
                           extra=self.kernel_wait == "poll")
        # Copy paths: D2H x/ids/w and the doorbell now (gpusync step_submit); the wait and H2D y in finish.
        if mask is not None:
            ids32 = mask_ids(torch, ids32, mask, ex.E)
        ids32, w32 = ids32.contiguous(), w32.contiguous()
        xb = x.to(torch.bfloat16).contiguous()
        self._iob.step_submit(_ID[path], h, layer, T, xb.data_ptr(), ids32.data_ptr(), w32.data_ptr())
        return Pending(layer, T, path, x.device, stream=stream, capturing=cap, keep=(xb, ids32, w32))

    def _complete(self, torch, pend: Pending, out, partial):
        h, T, H = pend.stream.cuda_stream, pend.T, self.executor.H
        target = partial if partial is not None else out
        if pend.path == "kernel":
            poll = pend.extra
            if not poll:
                self._iob.wait(_ID["kernel"], h)
            # combine writes (or adds into) a bf16 target with unit-stride rows; anything else gets y through a
            # bf16 buffer and a torch op (decode takes a copy path for such a target instead).
            direct = target is None or _bf16_rows(torch, target)
            y = target if direct and target is not None else torch.empty((T, H), dtype=torch.bfloat16,
                                                                          device=pend.device)
            self._kio.combine(h, T, y.data_ptr(), y.stride(0), direct and partial is not None, poll)
            return y if direct else apply(y, out, partial)
        direct = out is not None and out.dtype == torch.bfloat16 and out.is_contiguous()
        y = out if direct else torch.empty((T, H), dtype=torch.bfloat16, device=pend.device)
        self._iob.step_finish(_ID[pend.path], h, T, y.data_ptr())
        return y if direct else apply(y, out, partial)

    def _refused(self, path) -> Exception:
        why = "; ".join(f"{p}: {r}" for p, r in self.reasons.items())
        return CaptureRefusedError(
            "gpusync_cuda: CUDA graph capture refused: no replay-safe GPU<->CPU handshake on this machine "
            f"({why}). Decode MoE layers eagerly: disable CUDA graphs for decode (e.g. --cuda-graph-max-bs 0 / "
            "enforce_eager=True); eager decode stays correct.")

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
        self.abandon()
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
