"""Torch-side pieces of a decode step that both sync backends (gpusync-cuda, gpusync-hip) share: argument
checks, row layout, GPU-resident expert masking, the synchronous fallback, and the bookkeeping of the step's
two halves (submit, then finish on the same stream: one task in flight per executor). torch is passed in by
the caller (a backend's decode), never imported here: cpumoe-executor installs and imports without it."""
from __future__ import annotations

import operator
import time


def check_step(sync, torch, layer, x, w, ids, mask, target):
    ex = sync.executor
    if not hasattr(layer, "__index__") or not 0 <= int(layer) < ex.num_layers:
        raise ValueError(f"layer={layer!r} is not in [0, {ex.num_layers})")
    if x.dim() != 2 or x.shape[1] != ex.H:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [num_tokens, {ex.H}]")
    T = x.shape[0]
    if not 1 <= T <= ex.max_tokens:
        raise ValueError(f"batch size {T} is not in [1, max_tokens={ex.max_tokens}]")
    for name, a in (("topk_ids", ids), ("topk_weights", w)):
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


def eager_y(sync, torch, layer, x, w, ids, mask):
    """No GPU handshake: synchronous CPU decode of host copies, y on x's device (never under capture)."""
    ids_c = ids.detach().to("cpu", torch.int32)
    if mask is not None:
        ids_c = mask_ids(torch, ids_c, mask.detach().cpu(), sync.executor.E)
    xc = x.detach().cpu()
    if xc.dtype != torch.bfloat16:
        xc = xc.float()
    return sync.executor.decode(layer, xc, w.detach().cpu().float(), ids_c).to(x.device)


def apply(y, out, partial):
    """y added into partial (in place), or written into out, or y itself: the tensor holding the result."""
    if partial is not None:
        return partial.add_(y)
    if out is not None:
        return out.copy_(y)
    return y


def eager_step(sync, torch, layer, x, w, ids, mask, out, partial):
    """No GPU handshake: synchronous CPU decode of host copies (never under capture)."""
    return apply(eager_y(sync, torch, layer, x, w, ids, mask), out, partial)


# ---- the two halves: submit -> (other GPU work on the same stream) -> finish ----------------------------
class Pending:
    """A submitted step that finish has not completed yet: what finish needs (layer, batch, path, stream,
    whether it was captured, the eager path's y) and the submit's temporaries the stream still reads (`keep`)."""

    __slots__ = ("layer", "T", "path", "device", "stream", "capturing", "y", "keep", "extra", "in_decode")

    def __init__(self, layer, T, path, device, *, stream=None, capturing=False, y=None, keep=(), extra=None):
        self.layer, self.T, self.path, self.device = int(layer), int(T), path, device
        self.stream, self.capturing, self.y, self.keep, self.extra = stream, capturing, y, keep, extra
        self.in_decode = False  # finished by the same decode() call: same stream and capture state by construction

    @property
    def issued(self) -> bool:
        """Work was enqueued for real (a GPU path, not captured): the CPU may be running the task now."""
        return self.path != "eager" and not self.capturing

    def __repr__(self) -> str:
        how = "captured" if self.capturing else "eager" if self.path == "eager" else "issued"
        return f"Pending(layer={self.layer}, T={self.T}, path={self.path!r}, {how})"


def check_idle(sync, layer) -> None:
    """RuntimeError naming the pending layer unless no task is pending (one task in flight per executor)."""
    p = sync._pending
    if p is not None:
        raise RuntimeError(f"submit(layer={layer!r}): layer {p.layer}'s task is still pending (submitted, not "
                           f"finished): call finish({p.layer}, ...) first; one task is in flight per executor")


def take_pending(sync, layer) -> Pending:
    """The pending task for finish(layer), no longer pending: RuntimeError when none is; ValueError naming both
    layers when another layer's task is (that task is abandoned: nothing stays pending after an error)."""
    p = sync._pending
    if p is None:
        raise RuntimeError(f"finish(layer={layer!r}): no task is pending: call submit(layer, ...) first")
    try:
        same = operator.index(layer) == p.layer
    except TypeError:
        same = False
    sync._pending = None
    if not same:
        abandon(sync, p)
        raise ValueError(f"finish(layer={layer!r}): layer {p.layer} was submitted, not layer {layer!r}; layer "
                         f"{p.layer}'s task was abandoned (its CPU work drained first): submit it again")
    return p


def check_finish(sync, torch, pend: Pending, out, partial, refused) -> None:
    """finish's arguments against the submitted step, before anything is enqueued: out or partial (not both) of
    shape [T, H] for the submitted T (on the device for a GPU path); the same stream and the same capture state
    as submit (a graph holds both halves or neither). `refused()` builds the CaptureRefusedError for the eager
    path under capture."""
    if out is not None and partial is not None:
        raise ValueError("give out= or partial=, not both")
    target = partial if partial is not None else out
    H = sync.executor.H
    if target is not None and tuple(target.shape) != (pend.T, H):
        raise ValueError(f"out/partial: shape {tuple(target.shape)}, expected {(pend.T, H)} (layer {pend.layer}'s "
                         f"submitted batch of {pend.T})")
    if pend.in_decode:  # decode(): submit checked everything, on this stream, a moment ago
        return
    now = capturing(torch)
    if pend.path == "eager":
        if now:
            raise refused()
        return
    if target is not None and target.device != pend.device:
        raise ValueError(f"out/partial: on {target.device}, expected {pend.device} (where layer {pend.layer} was "
                         "submitted)")
    if now != pend.capturing:
        raise RuntimeError(f"finish(layer={pend.layer}): submitted {'while' if pend.capturing else 'outside'} "
                           f"capturing a graph but finished {'while' if now else 'outside'} capturing one: a graph "
                           "must hold both halves of a step or neither")
    cur = torch.cuda.current_stream(pend.device)
    if cur.cuda_stream != pend.stream.cuda_stream:
        raise RuntimeError(f"finish(layer={pend.layer}): the current stream ({cur.cuda_stream:#x}) is not the one "
                           f"the task was submitted on ({pend.stream.cuda_stream:#x}): finish on the same stream")


def abandon(sync, pend: Pending | None = None) -> None:
    """Forget a submitted step that finish will not complete (the pending one when `pend` is None). When it was
    issued for real, first wait (bounded by sync.timeout_s) for the stream and for the CPU to answer, so the
    next submit cannot overwrite the inputs of a task still running or be released by its done. Never raises."""
    if pend is None:
        pend, sync._pending = sync._pending, None
    if pend is None or not pend.issued:
        return
    try:
        sync.synchronize(pend.stream)
        end = time.monotonic() + sync.timeout_s
        while sync.pending() and time.monotonic() < end:
            time.sleep(1e-4)
    except Exception:  # noqa: BLE001, S110 - an error path already: the caller's error is the one raised
        pass


def submit_step(sync, impl, path, layer, x, w, ids, mask, target=None) -> None:
    """The first half on the current stream: `impl` (the backend's per-path submit) validates everything and
    enqueues the inputs and the doorbell; only a submit that raised nothing leaves a task pending."""
    check_idle(sync, layer)
    sync._pending = impl(sync, path, layer, x, w, ids, mask, target)


def finish_step(sync, impl, layer, out, partial):
    """The second half: `impl` (the backend's per-path finish) waits for done and brings y back into out /
    partial. Nothing stays pending afterwards, also when it raised (the task is abandoned, drained)."""
    pend = take_pending(sync, layer)
    try:
        return impl(sync, pend, out, partial)
    except BaseException:
        abandon(sync, pend)
        raise


def decode_step(sync, submit_impl, finish_impl, path, layer, x, w, ids, mask, out, partial):
    """decode = submit + finish, every argument (out / partial included) checked before anything is enqueued."""
    if out is not None and partial is not None:
        raise ValueError("give out= or partial=, not both")
    submit_step(sync, submit_impl, path, layer, x, w, ids, mask, partial if partial is not None else out)
    sync._pending.in_decode = True
    return finish_step(sync, finish_impl, layer, out, partial)
