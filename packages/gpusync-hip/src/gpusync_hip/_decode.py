"""The decode step of each path in two halves, on torch tensors (imported only here): submit enqueues the
D2H copies, the system-release event and the doorbell on the current stream, finish the wait and y's way
back (written into out or added into partial); decode is both. The backend-neutral torch helpers (argument
checks, dtype/stride handling, GPU-resident expert masking, the synchronous fallback, the pending-step
bookkeeping) are cpumoe_executor.sync_torch's."""

from __future__ import annotations

from cpumoe_executor.sync_torch import Pending, apply, capturing, check_finish, check_step, eager_y, mask_ids, rows

from . import _native

_ID = dict(_native.PATHS)


def submit(sync, path, layer, x, w, ids, mask, target=None) -> Pending:
    """Validate the step (target: decode's out/partial, checked before anything is enqueued) and enqueue its
    first half."""
    import torch

    T = check_step(sync, torch, layer, x, w, ids, mask, target)
    layer = int(layer)
    ex = sync.executor
    cap = capturing(torch)
    if path == "eager" or (path == "host-func" and cap):
        if cap:
            raise CaptureRefused(sync, path)
        return Pending(layer, T, "eager", x.device, y=eager_y(sync, torch, layer, x, w, ids, mask))
    devs = {t.device for t in (x, w, ids, mask, target) if t is not None}
    if devs != {torch.device("cuda", sync.ordinal)}:
        raise ValueError(
            f"all tensors must be on the HIP device {sync.ordinal} (torch 'cuda:{sync.ordinal}'), "
            f"got {sorted(map(str, devs))}"
        )
    stream = torch.cuda.current_stream(x.device)
    ids32, w32 = rows(ids, torch, torch.int32), rows(w, torch, torch.float32)
    if mask is not None:
        ids32 = mask_ids(torch, ids32, mask, ex.E)
    ids32, w32 = ids32.contiguous(), w32.contiguous()
    xb = x.to(torch.bfloat16).contiguous()
    step_path = _ID["memop"] if path.startswith("copy-") else _ID["host-func"]
    sync._iob.step_submit(step_path, stream.cuda_stream, layer, T, xb.data_ptr(), ids32.data_ptr(), w32.data_ptr())
    return Pending(layer, T, path, x.device, stream=stream, capturing=cap, keep=(xb, ids32, w32), extra=step_path)


def finish(sync, pend: Pending, out, partial):
    """Check out/partial against the submitted step and enqueue the second half; returns the tensor holding y."""
    import torch

    check_finish(sync, torch, pend, out, partial, lambda: CaptureRefused(sync, "eager"))
    if pend.path == "eager":
        return apply(pend.y, out, partial)
    direct = out is not None and out.dtype == torch.bfloat16 and out.is_contiguous()
    y = out if direct else torch.empty((pend.T, sync.executor.H), dtype=torch.bfloat16, device=pend.device)
    sync._iob.step_finish(pend.extra, pend.stream.cuda_stream, pend.T, y.data_ptr())
    return y if direct else apply(y, out, partial)


def CaptureRefused(sync, path) -> Exception:  # noqa: N802 - builds the exception
    why = "; ".join(f"{p}: {r}" for p, r in sync.reasons.items())
    return _native.CaptureRefusedError(
        f"gpusync_hip: HIP graph capture refused: the {path} path is not replay-safe on ROCm and no replay-safe "
        f"GPU<->CPU handshake was proven on this machine ({why}). Decode MoE layers eagerly: disable HIP graphs "
        "for decode (e.g. --cuda-graph-max-bs 0 / enforce_eager=True); eager decode stays correct."
    )
