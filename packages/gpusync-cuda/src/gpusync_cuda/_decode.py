"""The decode step of each path, on torch tensors (imported only here)."""
from __future__ import annotations

from cpumoe_executor.sync_torch import check_step, eager_step, mask_ids, rows

from . import _native

_ID = dict(_native.PATHS)


def _kernel_ok(torch, x, target) -> bool:
    bf = torch.bfloat16
    return x.dtype == bf and x.stride(-1) == 1 and (target is None or (target.dtype == bf and target.stride(-1) == 1))


def decode(sync, path, layer, x, w, ids, mask, out, partial):
    import torch

    if out is not None and partial is not None:
        raise ValueError("give out= or partial=, not both")
    target = partial if partial is not None else out
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
    capturing = torch.cuda.is_current_stream_capturing()
    if path == "eager":
        if capturing:
            raise CaptureRefused(sync)
        return eager_step(sync, torch, layer, x, w, ids, mask, out, partial)

    stream = torch.cuda.current_stream(x.device).cuda_stream
    ids32, w32 = rows(ids, torch, torch.int32), rows(w, torch, torch.float32)
    if path == "kernel":
        m = None
        if mask is not None:
            m = mask.view(torch.uint8) if mask.dtype in (torch.bool, torch.uint8) else (mask != 0).to(torch.uint8)
            m = m.contiguous()
        sync._kio.publish(stream, T, x.data_ptr(), x.stride(0), ids32.data_ptr(), ids32.stride(0), w32.data_ptr(),
                          w32.stride(0), 0 if m is None else m.data_ptr(), ex.E, (layer << 32) | T)
        # In-kernel wait (the probe passed it): combine polls done itself, which costs less in a
        # graph than a satisfied stream memop wait; else the memop wait, then a plain combine.
        poll = sync.kernel_wait == "poll"
        if not poll:
            sync._iob.wait(_ID["kernel"], stream)
        if target is None:
            target = torch.empty((T, ex.H), dtype=torch.bfloat16, device=x.device)
        sync._kio.combine(stream, T, target.data_ptr(), target.stride(0), partial is not None, poll)
        return target

    # Copy paths: D2H x/ids/w, doorbell, wait, H2D y (gpusync step), then the add.
    if mask is not None:
        ids32 = mask_ids(torch, ids32, mask, ex.E)
    ids32, w32 = ids32.contiguous(), w32.contiguous()
    xb = x.to(torch.bfloat16).contiguous()
    direct = out is not None and out.dtype == torch.bfloat16 and out.is_contiguous()
    y = out if direct else torch.empty((T, ex.H), dtype=torch.bfloat16, device=x.device)
    sync._iob.step(_ID[path], stream, layer, T, xb.data_ptr(), ids32.data_ptr(), w32.data_ptr(), y.data_ptr())
    if partial is not None:
        return partial.add_(y)
    if out is not None and not direct:
        return out.copy_(y)
    return y


def CaptureRefused(sync) -> Exception:  # noqa: N802 - builds the exception
    why = "; ".join(f"{p}: {r}" for p, r in sync.reasons.items())
    return _native.CaptureRefusedError(
        "gpusync_cuda: CUDA graph capture refused: no replay-safe GPU<->CPU handshake on this machine "
        f"({why}). Decode MoE layers eagerly: disable CUDA graphs for decode (e.g. --cuda-graph-max-bs 0 / "
        "enforce_eager=True); eager decode stays correct.")
