"""The decode step of each path, on torch tensors (imported only here). The
backend-neutral torch helpers (argument checks, dtype/stride handling, GPU-resident
expert masking, the synchronous fallback) are cpumoe_executor.sync_torch's."""

from __future__ import annotations

from cpumoe_executor.sync_torch import check_step, eager_step, mask_ids, rows

from . import _native

_ID = dict(_native.PATHS)


def decode(sync, path, layer, x, w, ids, mask, out, partial):
    import torch

    if out is not None and partial is not None:
        raise ValueError("give out= or partial=, not both")
    target = partial if partial is not None else out
    T = check_step(sync, torch, layer, x, w, ids, mask, target)
    layer = int(layer)
    ex = sync.executor
    capturing = torch.cuda.is_current_stream_capturing()
    if path == "eager" or (path == "host-func" and capturing):
        if capturing:
            raise CaptureRefused(sync, path)
        return eager_step(sync, torch, layer, x, w, ids, mask, out, partial)
    devs = {t.device for t in (x, w, ids, mask, target) if t is not None}
    if devs != {torch.device("cuda", sync.ordinal)}:
        raise ValueError(
            f"all tensors must be on the HIP device {sync.ordinal} (torch 'cuda:{sync.ordinal}'), "
            f"got {sorted(map(str, devs))}"
        )
    stream = torch.cuda.current_stream(x.device).cuda_stream
    ids32, w32 = rows(ids, torch, torch.int32), rows(w, torch, torch.float32)
    if mask is not None:
        ids32 = mask_ids(torch, ids32, mask, ex.E)
    ids32, w32 = ids32.contiguous(), w32.contiguous()
    xb = x.to(torch.bfloat16).contiguous()
    direct = out is not None and out.dtype == torch.bfloat16 and out.is_contiguous()
    y = out if direct else torch.empty((T, ex.H), dtype=torch.bfloat16, device=x.device)
    step_path = _ID["memop"] if path.startswith("copy-") else _ID["host-func"]
    sync._iob.step(step_path, stream, layer, T, xb.data_ptr(), ids32.data_ptr(), w32.data_ptr(), y.data_ptr())
    if partial is not None:
        return partial.add_(y)
    if out is not None and not direct:
        return out.copy_(y)
    return y


def CaptureRefused(sync, path) -> Exception:  # noqa: N802 - builds the exception
    why = "; ".join(f"{p}: {r}" for p, r in sync.reasons.items())
    return _native.CaptureRefusedError(
        f"gpusync_hip: HIP graph capture refused: the {path} path is not replay-safe on ROCm and no replay-safe "
        f"GPU<->CPU handshake was proven on this machine ({why}). Decode MoE layers eagerly: disable HIP graphs "
        "for decode (e.g. --cuda-graph-max-bs 0 / enforce_eager=True); eager decode stays correct."
    )
