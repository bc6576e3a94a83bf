"""HipSync: one CpuMoeExecutor's doorbell on one HIP device, from Python.

At start-up it registers the executor's IO block, allocates the ready/done
words in signal memory and (re)starts the executor's coordinator on them, then
probes: the copy step under native memops if the runtime records them under
capture, else under spliced batch-memop nodes, each proven by a real capture,
instantiate and replay with changed inputs against the synchronous CPU result;
host functions are probed eagerly only (never replay-safe on ROCm). With torch
present, the chosen copy path is also qualified with the real decode (eager +
HIP-graph replay; decode and the split submit/finish with other GPU work between
the halves). One log line names the path. decode() runs on the current
stream; only the copy paths may be captured, the others raise
CaptureRefusedError saying what to do. submit() and finish() are its two halves,
so an engine can run its GPU-resident experts on the same stream while the CPU
works (decode() == submit() + finish()).

Paths (GPUSYNC_HIP_PATH or path=): auto (default: best proven), copy-native,
copy-splice (native / splice are aliases), host-func, eager.
"""

from __future__ import annotations

import logging
import os
import warnings

from cpumoe_executor.sync_torch import Pending, StepSync, apply, mask_ids, rows

from . import _native
from ._native import CaptureRefusedError, GpuSyncError

log = logging.getLogger("gpusync_hip")
PATHS = ("copy-native", "copy-splice", "host-func", "eager")  # best first
CHOICES = ("auto", "native", "splice") + PATHS
_ALIASES = {"native": "copy-native", "splice": "copy-splice"}
_ID = dict(_native.PATHS)
_MECH = dict(_native.MECHANISMS)


def _torch():
    import torch  # only when handling torch tensors

    return torch


class HipSync(StepSync):
    """The GPU side of `executor`'s doorbell on HIP device `ordinal`.

    path: auto | copy-native | copy-splice | host-func | eager (default: $GPUSYNC_HIP_PATH or auto). A forced
    path that its probe cannot prove raises GpuSyncError naming why.
    qualify: also prove the chosen copy path with the real torch decode (when torch is importable).
    """

    def __init__(
        self, executor, ordinal: int = 0, *, path: str | None = None, timeout_s: float = 10.0, qualify: bool = True
    ):
        import cpumoe_executor

        want = path if path is not None else os.environ.get("GPUSYNC_HIP_PATH", "") or "auto"
        if want not in CHOICES:
            raise ValueError(
                f"path={want!r} (from {'path=' if path is not None else 'GPUSYNC_HIP_PATH'}) is not "
                f"one of {list(CHOICES)}"
            )
        want = _ALIASES.get(want, want)
        if not isinstance(ordinal, int) or ordinal < 0:
            raise ValueError(f"ordinal={ordinal!r}: expected a device index >= 0")
        super().__init__(executor, f"cuda:{ordinal}", timeout_s)  # torch names HIP devices 'cuda'
        self.ordinal = ordinal
        self.requested = want
        self.reasons: dict[str, str] = {"copy": "not tried", "host-func": "not tried"}
        self.path, self.mechanism = "eager", "none"
        self._dev = self._iob = None
        self._hostfn_eager = False
        self._coordinator = None  # None: untouched; "moved": was running on the block's words; "started"
        st = _native.driver_status()
        if not (st["loaded"] and st["initialized"]):
            self.reasons = {p: st["error"] for p in self.reasons}
        else:
            self._dev = _native.Device(ordinal)
            self._iob = _native.Iob(self._dev, cpumoe_executor.C_API_CAPSULE, executor.handle, executor)
            self._start_coordinator()
            self._probe(want)
        self._choose(want, qualify)
        log.info(
            "gpusync_hip: handshake=%s on hip:%d (runtime %s from %s: %s) (%s)",
            self.path,
            ordinal,
            st.get("runtime_version"),
            st.get("library") or "-",
            st.get("choice") or st.get("error"),
            self.summary(),
        )

    # ---- start-up -----------------------------------------------------------------------------
    def _start_coordinator(self) -> None:
        words = self._iob.words
        was_running = self.executor.health()["coordinator_running"]
        if was_running:
            self.executor.stop_coordinator()  # it polls the block's words; ours live in signal memory
        self.executor.start_coordinator(ready=words["ready"], done=words["done"])
        self._coordinator = "moved" if was_running else "started"

    def _probe(self, want: str) -> None:
        forced = {"copy-native": _MECH["native"], "copy-splice": _MECH["splice"]}.get(want, -1)
        if want in ("auto", "copy-native", "copy-splice"):
            ok, _eager, self.reasons["copy"] = self._iob.probe(_ID["memop"], self.timeout_s, forced)
            if ok:
                self.mechanism = {v: k for k, v in _MECH.items()}[self._iob.mechanism]
        if want in ("auto", "host-func"):
            _ok, eager, self.reasons["host-func"] = self._iob.probe(_ID["host-func"], self.timeout_s)
            self._hostfn_eager = eager

    def _usable(self, p: str) -> bool:
        if p == "eager":
            return True
        if self._iob is None:
            return False
        if p.startswith("copy-"):
            return self._iob.replay_safe(_ID["memop"]) and self.mechanism == p[5:]
        return p == "host-func" and getattr(self, "_hostfn_eager", False)

    def _choose(self, want: str, qualify: bool) -> None:
        order = PATHS if want == "auto" else (want,)
        for p in order:
            if self._usable(p) and (not (qualify and p.startswith("copy-")) or self._qualify(p)):
                self.path = p
                return
        if want != "auto" and want != "eager":
            why = self.reasons.get("copy" if want.startswith("copy-") else want, "no HIP runtime")
            self.close()
            raise GpuSyncError(f"gpusync_hip: the forced path {want!r} is unavailable here: {why}")

    def _qualify(self, path: str) -> bool:
        """Eager and HIP-graph-replayed decode on `path` == the executor's synchronous result, bit for bit."""
        try:
            torch = _torch()
        except ImportError:
            self.reasons["copy"] += "; not qualified (torch is not importable)"
            return True
        from cpumoe_executor.sync_qualify import qualify  # backend-neutral: drives decode / submit / finish

        try:
            qualify(self, path, torch)
            return True
        except Exception as e:  # noqa: BLE001 - any failure disqualifies the path
            self.reasons["copy"] = f"failed qualification: {type(e).__name__}: {e}"
            warnings.warn(
                f"gpusync_hip: the {path} path failed its start-up qualification: {e}", RuntimeWarning, stacklevel=3
            )
            self._iob.set_replay_safe(_ID["memop"], False)
            return False

    def summary(self) -> str:
        return "; ".join(f"{p}: {r}" for p, r in self.reasons.items())

    @property
    def words(self) -> dict:
        """Host addresses of the ready/done words the coordinator polls (signal memory when available)."""
        return dict(self._iob.words) if self._iob is not None else {}

    # ---- the step's native halves (StepSync does the checks and the bookkeeping) ----------------------------
    def _enqueue(self, torch, path, layer, T, x, w, ids, mask, target) -> Pending:
        cap = torch.cuda.is_current_stream_capturing()
        if path == "host-func" and cap:
            raise self._refused(path)
        stream = torch.cuda.current_stream(x.device)
        ids32, w32 = rows(ids, torch, torch.int32), rows(w, torch, torch.float32)
        if mask is not None:
            ids32 = mask_ids(torch, ids32, mask, self.executor.E)
        ids32, w32 = ids32.contiguous(), w32.contiguous()
        xb = x.to(torch.bfloat16).contiguous()
        step_path = _ID["memop"] if path.startswith("copy-") else _ID["host-func"]
        self._iob.step_submit(step_path, stream.cuda_stream, layer, T, xb.data_ptr(), ids32.data_ptr(),
                              w32.data_ptr())
        return Pending(layer, T, path, x.device, stream=stream, capturing=cap, keep=(xb, ids32, w32), extra=step_path)

    def _complete(self, torch, pend: Pending, out, partial):
        direct = out is not None and out.dtype == torch.bfloat16 and out.is_contiguous()
        y = out if direct else torch.empty((pend.T, self.executor.H), dtype=torch.bfloat16, device=pend.device)
        self._iob.step_finish(pend.extra, pend.stream.cuda_stream, pend.T, y.data_ptr())
        return y if direct else apply(y, out, partial)

    def _refused(self, path) -> Exception:
        why = "; ".join(f"{p}: {r}" for p, r in self.reasons.items())
        return CaptureRefusedError(
            f"gpusync_hip: HIP graph capture refused: the {path} path is not replay-safe on ROCm and no replay-safe "
            f"GPU<->CPU handshake was proven on this machine ({why}). Decode MoE layers eagerly: disable HIP graphs "
            "for decode (e.g. --cuda-graph-max-bs 0 / enforce_eager=True); eager decode stays correct."
        )

    # ---- waits and health -----------------------------------------------------------------------
    def synchronize(self, stream=None, timeout_s: float | None = None) -> None:
        """Wait for `stream` (default: current) at most timeout_s; on expiry the stream is released
        (done := SHUTDOWN) and TimeoutError names the executor's state. Never hangs."""
        t = self.timeout_s if timeout_s is None else timeout_s
        if stream is None or hasattr(stream, "cuda_stream"):
            torch = _torch()
            s = torch.cuda.current_stream(self.ordinal) if stream is None else stream
            h = s.cuda_stream
        else:
            h = int(stream)
        if self._iob is None:
            _torch().cuda.synchronize(self.ordinal)
            return
        if not self._iob.sync(h, t):
            raise TimeoutError(
                f"gpusync_hip: stream did not complete within {t} s and was released; executor "
                f"health: {self.executor.health()}, words: {self.word_values()}"
            )

    def word_values(self) -> dict:
        w = self.words
        return {k: self._iob.load_word(w[k]) for k in ("ready", "done")} if w else {}

    def pending(self) -> bool:
        """A doorbell rung and not answered yet."""
        v = self.word_values()
        return bool(v) and (v["ready"] != 0 or v["done"] == 0)

    def close(self) -> None:
        if getattr(self, "_slot", None) is not None:
            self.abandon()
        if getattr(self, "_coordinator", None) is not None:
            self.executor.stop_coordinator()  # off our words before they are freed
            if self._coordinator == "moved":
                self.executor.start_coordinator()  # back on the block's own words
            self._coordinator = None
        self._iob = None  # frees the signal words, unregisters the IO block
        self._dev = None

    def __del__(self):
        # The coordinator must leave the signal words before they are freed, also when close() was forgotten.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown: nothing left to report to
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["CaptureRefusedError", "HipSync", "PATHS"]
