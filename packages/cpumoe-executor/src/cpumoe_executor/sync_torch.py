"""StepSync: the torch side of one executor's decode step, shared by every sync backend (gpusync_cuda.CudaSync,
gpusync_hip.HipSync, moe_engine's HostSync).

It owns what is the same on every backend: the step's argument checks (once, at the public boundary), the rule of
one task in flight per executor (protocol v1, docs/architecture.md), the two halves submit -> finish and their
bookkeeping, the synchronous path (eager), and abandoning a failed step. A backend implements only what differs,
the native calls of its paths: `_enqueue` (the first half: inputs and doorbell on the current stream) and
`_complete` (the wait and y's way back), plus `_refused`, `synchronize` and `pending`.

This lives in cpumoe-executor because the rule it enforces, one task in flight, is the executor's protocol, and
every consumer (both GPU backends and the glue) already depends on this package. torch is imported lazily, only
when a step handles torch tensors: the package installs and imports without it."""
from __future__ import annotations

import operator
import threading
import time


def _torch():
    import torch  # only when a step handles torch tensors

    return torch


def check_step(ex, torch, layer, x, w, ids, mask, target) -> int:
    """The step's shapes and dtypes against the executor; returns its batch size T."""
    if not hasattr(layer, "__index__") or not 0 <= int(layer) < ex.num_layers:
        raise ValueError(f"layer={layer!r} is not in [0, {ex.num_layers})")
    if x.dim() != 2 or x.shape[1] != ex.H:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [num_tokens, {ex.H}]")
    T = x.shape[0]
    if not 1 <= T <= ex.max_tokens:
        raise ValueError(f"batch size {T} is not in [1, max_tokens={ex.max_tokens}]")
    for name, a in (("topk_weights", w), ("topk_ids", ids)):
        if tuple(a.shape) != (T, ex.top_k):
            raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {(T, ex.top_k)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"topk_ids: dtype {ids.dtype}, expected an integer dtype")
    if mask is not None and (mask.dim() != 1 or mask.shape[0] != ex.E):
        raise ValueError(f"residency_mask: shape {tuple(mask.shape)}, expected [{ex.E}]")
    if target is not None and tuple(target.shape) != (T, ex.H):
        raise ValueError(f"out/partial: shape {tuple(target.shape)}, expected {(T, ex.H)}")
    return T


def rows(t, torch, dtype):
    """`t` as `dtype` with unit stride in the last dim (a copy only when needed)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def mask_ids(torch, ids, mask, E):
    """Routes of GPU-resident experts -> -1 (ids outside [0, E) are left for the executor to reject)."""
    valid = (ids >= 0) & (ids < E)
    hit = mask.to(torch.bool)[ids.clamp(0, E - 1).long()] & valid
    return ids.masked_fill(hit, -1)


def capturing(torch) -> bool:
    """Whether the current stream is capturing a graph (False, without asking, before CUDA/HIP is initialised:
    nothing can capture then, and a CPU-only torch build cannot even be asked)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def apply(y, out, partial):
    """y added into partial (in place), or written into out, or y itself: the tensor holding the result."""
    if partial is not None:
        return partial.add_(y)
    if out is not None:
        return out.copy_(y)
    return y


class Pending:
    """A submitted step that finish has not completed yet: what finish needs (layer, batch, path, stream,
    whether it was captured, the eager path's y) and the submit's temporaries the stream still reads (`keep`)."""

    __slots__ = ("layer", "T", "path", "device", "stream", "capturing", "y", "keep", "extra", "in_decode", "thread")

    def __init__(self, layer, T, path, device, *, stream=None, capturing=False, y=None, keep=(), extra=None):
        self.layer, self.T, self.path, self.device = int(layer), int(T), path, device
        self.stream, self.capturing, self.y, self.keep, self.extra = stream, capturing, y, keep, extra
        self.in_decode = False  # finished by the same decode() call: same stream and capture state by construction
        self.thread = threading.get_ident()

    @property
    def issued(self) -> bool:
        """Work was enqueued for real (a GPU path, not captured): the CPU may be running the task now."""
        return self.path not in StepSync.SYNCHRONOUS and not self.capturing

    def __repr__(self) -> str:
        how = "captured" if self.capturing else "eager" if self.path in StepSync.SYNCHRONOUS else "issued"
        return f"Pending(layer={self.layer}, T={self.T}, path={self.path!r}, {how})"


class StepSync:
    """One executor's decode step from torch: decode() = submit() + finish().

    Thread contract: not shareable while a step is in flight. One task is in flight per executor, so the pending
    slot is claimed atomically by submit() and freed by finish(); a submit() from any thread while a task is
    pending raises RuntimeError naming the pending layer and the thread that submitted it, and finish() from
    another thread than the submitting one raises too. Nothing is corrupted or handed to the wrong caller.
    """

    SYNCHRONOUS = ("eager", "host")  # paths that decode on the CPU right in submit (no GPU handshake)
    path = "eager"

    def __init__(self, executor, device: str, timeout_s: float = 10.0):
        """device: where a GPU path's tensors live, as torch names it ('cuda:0'; HIP devices too)."""
        self.executor, self.device, self.timeout_s = executor, device, float(timeout_s)
        self._pending: Pending | None = None
        self._slot = threading.Lock()  # held from submit until finish: the one task in flight

    # ---- the backend's part ------------------------------------------------------------------------------
    def _enqueue(self, torch, path, layer, T, x, w, ids, mask, target) -> Pending:  # pragma: no cover - abstract
        """The first half on a GPU path: inputs and doorbell on the current stream."""
        raise NotImplementedError(f"{type(self).__name__} has no GPU path {path!r}")

    def _complete(self, torch, pend: Pending, out, partial):  # pragma: no cover - abstract
        """The second half on a GPU path: the wait and y's way back; returns the tensor holding y."""
        raise NotImplementedError(f"{type(self).__name__} has no GPU path {pend.path!r}")

    def _refused(self, path) -> Exception:
        """The error for a synchronous path under graph capture."""
        return RuntimeError(f"{type(self).__name__}: path {path!r} cannot run under graph capture")

    def _usable(self, path) -> bool:
        return path == self.path or path in self.SYNCHRONOUS

    def synchronize(self, stream=None, timeout_s: float | None = None) -> None:
        """Wait for the stream's work (a bounded wait on GPU backends); nothing to wait for here."""

    def pending(self) -> bool:
        """A doorbell rung and not answered yet (never, without a GPU path)."""
        return False

    # ---- the step --------------------------------------------------------------------------------------------
    @property
    def pending_layer(self) -> int | None:
        """The layer submitted and not finished yet, or None."""
        p = self._pending
        return None if p is None else p.layer

    def submit(self, layer: int, x, topk_weights, topk_ids, residency_mask=None, *, into=None,
               path: str | None = None, check: bool = True) -> None:
        """The first half of decode() on the current stream: checks the step (shapes, dtypes, devices, batch <=
        max_tokens) before anything is enqueued, then rings the CPU (a synchronous path decodes now). The caller
        may enqueue other GPU work on the same stream, then calls finish(layer). One task in flight: RuntimeError
        naming the pending layer while one is submitted and not finished (also while capturing a graph: the graph
        then holds both halves). A synchronous path raises under capture.

        residency_mask: bool/u8 [E] on the activations' device, True = the expert runs on the GPU (its routes are
        skipped here). into: the tensor finish will write or add y into, checked now (a backend may pick its path
        by it; decode passes its out / partial). path: run this step on another usable path (start-up
        qualification, tests; default: the chosen one). check=False: the caller has checked the step already
        (MoERunner does, at its own boundary)."""
        torch = _torch()
        path = self.path if path is None else path
        T = self._check(torch, path, layer, x, topk_weights, topk_ids, residency_mask, into) if check else x.shape[0]
        if not self._slot.acquire(blocking=False):
            raise self._busy(layer)
        try:
            if path in self.SYNCHRONOUS:
                if capturing(torch):
                    raise self._refused(path)
                pend = Pending(layer, T, path, x.device,
                               y=self._eager_y(torch, int(layer), x, topk_weights, topk_ids, residency_mask))
            else:
                pend = self._enqueue(torch, path, int(layer), T, x, topk_weights, topk_ids, residency_mask, into)
        except BaseException:
            self._slot.release()
            raise
        self._pending = pend

    def finish(self, layer: int, *, out=None, partial=None):
        """The second half, on the stream submit ran on: waits for the CPU's done and brings y back, written into
        out or added into partial ([T, H] for the submitted T). Returns the tensor holding the result.
        RuntimeError when nothing is pending, ValueError naming both layers when another layer was submitted;
        after any error nothing is pending (the task is abandoned, its CPU work drained first when it was
        issued)."""
        pend = self._take(layer)
        torch = _torch()
        try:
            if out is not None and partial is not None:
                raise ValueError("give out= or partial=, not both")
            self._check_finish(torch, pend, out, partial)
            return apply(pend.y, out, partial) if pend.path in self.SYNCHRONOUS else \
                self._complete(torch, pend, out, partial)
        except BaseException:
            self.abandon(pend)
            raise

    def decode(self, layer: int, x, topk_weights, topk_ids, residency_mask=None, *, out=None, partial=None,
               path: str | None = None, check: bool = True):
        """y [T, H] bf16 of `layer`'s CPU experts on the current stream: exactly submit() + finish(), every
        argument (out / partial included) checked before anything is enqueued. out: write y into it; partial:
        add y into it in place (a GPU partial result). Returns the tensor holding the result."""
        if out is not None and partial is not None:
            raise ValueError("give out= or partial=, not both")
        into = partial if partial is not None else out
        if (self.path if path is None else path) in self.SYNCHRONOUS:
            return self._decode_now(layer, x, topk_weights, topk_ids, residency_mask, out, partial, path, check)
        self.submit(layer, x, topk_weights, topk_ids, residency_mask, into=into, path=path, check=check)
        self._pending.in_decode = True
        return self.finish(layer, out=out, partial=partial)

    def _decode_now(self, layer, x, w, ids, mask, out, partial, path, check):
        """decode() on a synchronous path: the CPU step runs here, holding the slot as submit ... finish would, in
        one call (a step between a model's layers finds Python's caches cold: every call saved is microseconds)."""
        torch = _torch()
        path = self.path if path is None else path
        into = partial if partial is not None else out
        T = self._check(torch, path, layer, x, w, ids, mask, into) if check else x.shape[0]
        if not self._slot.acquire(blocking=False):
            raise self._busy(layer)
        try:
            self._pending = Pending(layer, T, path, None)
            if capturing(torch):
                raise self._refused(path)
            return apply(self._eager_y(torch, int(layer), x, w, ids, mask), out, partial)
        finally:
            self._release()

    def _check(self, torch, path, layer, x, w, ids, mask, into) -> int:
        """submit's checks (check=True): the step against the executor, one device for a GPU path, a usable path.
        Returns T."""
        T = check_step(self.executor, torch, layer, x, w, ids, mask, into)
        if path not in self.SYNCHRONOUS:
            devs = {t.device for t in (x, w, ids, mask, into) if t is not None}
            if devs != {torch.device(self.device)}:
                raise ValueError(f"all tensors must be on {self.device}, got {sorted(map(str, devs))}")
        if not self._usable(path):
            raise RuntimeError(f"{type(self).__name__}: path {path!r} is unavailable here: {self.summary()}")
        return T

    def abandon(self, pend: Pending | None = None) -> None:
        """Forget a submitted step that finish will not complete (the pending one when `pend` is None). When it was
        issued for real, first wait (bounded by timeout_s) for the stream and for the CPU to answer, so the next
        submit cannot overwrite the inputs of a task still running or be released by its done. Never raises."""
        if pend is None:
            pend = self._pending
            if pend is not None:
                self._release()
        if pend is None or not pend.issued:
            return
        try:
            self.synchronize(pend.stream)
            end = time.monotonic() + self.timeout_s
            while self.pending() and time.monotonic() < end:
                time.sleep(1e-4)
        except Exception:  # noqa: BLE001, S110 - an error path already: the caller's error is the one raised
            pass

    # ---- bookkeeping -----------------------------------------------------------------------------------------
    def _busy(self, layer) -> RuntimeError:
        p = self._pending
        who = "" if p is None or p.thread == threading.get_ident() else f" by another thread ({p.thread})"
        pl = "?" if p is None else p.layer
        return RuntimeError(f"submit(layer={layer!r}): layer {pl}'s task is still pending (submitted{who}, not "
                            f"finished): call finish({pl}, ...) first; one task is in flight per executor")

    def _take(self, layer) -> Pending:
        p = self._pending
        if p is None:
            raise RuntimeError(f"finish(layer={layer!r}): no task is pending: call submit(layer, ...) first")
        if p.thread != threading.get_ident():
            raise RuntimeError(f"finish(layer={layer!r}): layer {p.layer} was submitted by another thread "
                               f"({p.thread}); a {type(self).__name__} serves one thread at a time")
        try:
            same = operator.index(layer) == p.layer
        except TypeError:
            same = False
        self._release()
        if not same:
            self.abandon(p)
            raise ValueError(f"finish(layer={layer!r}): layer {p.layer} was submitted, not layer {layer!r}; layer "
                             f"{p.layer}'s task was abandoned (its CPU work drained first): submit it again")
        return p

    def _release(self) -> None:
        self._pending = None
        if self._slot.locked():
            self._slot.release()

    def _check_finish(self, torch, pend: Pending, out, partial) -> None:
        """finish's arguments against the submitted step, before anything is enqueued: out or partial of shape
        [T, H] for the submitted T (on the device for a GPU path); the same stream and the same capture state as
        submit (a graph holds both halves or neither)."""
        target = partial if partial is not None else out
        H = self.executor.H
        if target is not None and tuple(target.shape) != (pend.T, H):
            raise ValueError(f"out/partial: shape {tuple(target.shape)}, expected {(pend.T, H)} (layer "
                             f"{pend.layer}'s submitted batch of {pend.T})")
        if pend.in_decode:  # decode(): submit checked everything, on this stream, a moment ago
            return
        now = capturing(torch)
        if pend.path in self.SYNCHRONOUS:
            if now:
                raise self._refused(pend.path)
            return
        if target is not None and target.device != pend.device:
            raise ValueError(f"out/partial: on {target.device}, expected {pend.device} (where layer {pend.layer} "
                             "was submitted)")
        if now != pend.capturing:
            raise RuntimeError(f"finish(layer={pend.layer}): submitted {'while' if pend.capturing else 'outside'} "
                               f"capturing a graph but finished {'while' if now else 'outside'} capturing one: a "
                               "graph must hold both halves of a step or neither")
        cur = torch.cuda.current_stream(pend.device)
        if cur.cuda_stream != pend.stream.cuda_stream:
            raise RuntimeError(f"finish(layer={pend.layer}): the current stream ({cur.cuda_stream:#x}) is not the "
                               f"one the task was submitted on ({pend.stream.cuda_stream:#x}): finish on the same "
                               "stream")

    def _eager_y(self, torch, layer, x, w, ids, mask):
        """No GPU handshake: synchronous CPU decode of host copies, y on x's device (never under capture). CPU
        tensors without a mask go to the executor as they are (it converts what its native step cannot read)."""
        if mask is None and x.is_cpu and w.is_cpu and ids.is_cpu:
            return self.executor.decode(layer, x, w, ids)
        ids_c = ids.detach().to("cpu", torch.int32)
        if mask is not None:
            ids_c = mask_ids(torch, ids_c, mask.detach().cpu(), self.executor.E)
        xc = x.detach().cpu()
        if xc.dtype != torch.bfloat16:
            xc = xc.float()
        return self.executor.decode(layer, xc, w.detach().cpu().float(), ids_c).to(x.device)

    def summary(self) -> str:
        return f"path {self.path}"

    def close(self) -> None:
        """Forget any pending step (drained first when it was issued)."""
        self.abandon()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Pending", "StepSync", "apply", "capturing", "check_step", "mask_ids", "rows"]
