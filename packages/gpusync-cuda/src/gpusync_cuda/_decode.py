"""The decode step of each path in two halves, on torch tensors (imported only here): submit enqueues the
inputs and the doorbell on the current stream, finish the wait and y's way back (written into out or added
into partial); decode is both. The backend-neutral torch helpers and the pending-step bookkeeping are
cpumoe_executor.sync_torch's."""
from __future__ import annotations

from cpumoe_executor.sync_torch import Pending, apply, capturing, check_finish, check_step, eager_y, mask_ids, rows

from . import _native

_ID = dict(_native.PATHS)


def _bf16_rows(torch, t) -> bool:
    return t.dtype == torch.bfloat16 and t.stride(-1) == 1


def _kernel_ok(torch, x, target) -> bool:
    return _bf16_rows(torch, x) and (target is None or _bf16_rows(torch, target))


def submit(sync, path, layer, x, w, ids, mask, target=None) -> Pending:
    """Validate the step (target: decode's out/partial, so that it is checked before anything is enqueued and the
    kernel path is only taken when its combine can write it) and enqueue its first half."""
    import torch

    T = check_step(sync, torch, layer, x, w, ids, mask, target)
    layer = int(layer)
    ex = sync.executor
    if path != "eager":
        devs = {t.device for t in (x, w, ids, mask, target) if t is not None}
        if devs != {torch.device("cuda", sync.ordinal)}:
            raise ValueError(f"all tensors must be on cuda:{sync.ordinal}, got {sorted(map(str, devs))}")
    if path == "kernel" and not _kernel_ok(torch, x, target):
        # Kernel IO moves bf16 only: this step takes the best copy path.
        path = next((p for p in ("memop", "host-func") if sync._usable(p)), "eager")
    if path != "eager" and not sync._usable(path):
        raise RuntimeError(f"gpusync-cuda: path {path!r} is unavailable here: {sync.reasons.get(path, 'unknown path')}")
    cap = capturing(torch)
    if path == "eager":
        if cap:
            raise CaptureRefused(sync)
        return Pending(layer, T, "eager", x.device, y=eager_y(sync, torch, layer, x, w, ids, mask))

    stream = torch.cuda.current_stream(x.device)
    h = stream.cuda_stream
    ids32, w32 = rows(ids, torch, torch.int32), rows(w, torch, torch.float32)
    if path == "kernel":
        m = None
        if mask is not None:
            m = mask.view(torch.uint8) if mask.dtype in (torch.bool, torch.uint8) else (mask != 0).to(torch.uint8)
            m = m.contiguous()
        # In-kernel wait (the probe passed it): combine polls done itself, which costs less in a
        # graph than a satisfied stream memop wait; else the memop wait, then a plain combine.
        poll = sync.kernel_wait == "poll"
        sync._kio.publish(h, T, x.data_ptr(), x.stride(0), ids32.data_ptr(), ids32.stride(0), w32.data_ptr(),
                          w32.stride(0), 0 if m is None else m.data_ptr(), ex.E, (layer << 32) | T)
        return Pending(layer, T, "kernel", x.device, stream=stream, capturing=cap, keep=(x, ids32, w32, m),
                       extra=poll)

    # Copy paths: D2H x/ids/w and the doorbell now (gpusync step_submit); the wait and H2D y in finish.
    if mask is not None:
        ids32 = mask_ids(torch, ids32, mask, ex.E)
    ids32, w32 = ids32.contiguous(), w32.contiguous()
    xb = x.to(torch.bfloat16).contiguous()
    sync._iob.step_submit(_ID[path], h, layer, T, xb.data_ptr(), ids32.data_ptr(), w32.data_ptr())
    return Pending(layer, T, path, x.device, stream=stream, capturing=cap, keep=(xb, ids32, w32))


def finish(sync, pend: Pending, out, partial):
    """Check out/partial against the submitted step and enqueue the second half; returns the tensor holding y."""
    import torch

    check_finish(sync, torch, pend, out, partial, lambda: CaptureRefused(sync))
    if pend.path == "eager":
        return apply(pend.y, out, partial)
    h, T, H = pend.stream.cuda_stream, pend.T, sync.executor.H
    target = partial if partial is not None else out
    if pend.path == "kernel":
        poll = pend.extra
        if not poll:
            sync._iob.wait(_ID["kernel"], h)
        # combine writes (or adds into) a bf16 target with unit-stride rows; anything else gets y through a
        # bf16 buffer and a torch op (decode takes a copy path for such a target instead).
        direct = target is None or _bf16_rows(torch, target)
        y = target if direct and target is not None else torch.empty((T, H), dtype=torch.bfloat16, device=pend.device)
        sync._kio.combine(h, T, y.data_ptr(), y.stride(0), direct and partial is not None, poll)
        return y if direct else apply(y, out, partial)

    direct = out is not None and out.dtype == torch.bfloat16 and out.is_contiguous()
    y = out if direct else torch.empty((T, H), dtype=torch.bfloat16, device=pend.device)
    sync._iob.step_finish(_ID[pend.path], h, T, y.data_ptr())
    return y if direct else apply(y, out, partial)


def CaptureRefused(sync) -> Exception:  # noqa: N802 - builds the exception
    why = "; ".join(f"{p}: {r}" for p, r in sync.reasons.items())
    return _native.CaptureRefusedError(
        "gpusync_cuda: CUDA graph capture refused: no replay-safe GPU<->CPU handshake on this machine "
        f"({why}). Decode MoE layers eagerly: disable CUDA graphs for decode (e.g. --cuda-graph-max-bs 0 / "
        "enforce_eager=True); eager decode stays correct.")
