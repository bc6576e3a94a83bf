"""The decode step of each path, on torch tensors (imported only here)."""
from __future__ import annotations

from . import _native

_ID = dict(_native.PATHS)


def _check(sync, torch, layer, x, w, ids, mask, target):
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


def _rows(t, torch, dtype):
    """`t` as `dtype` with unit stride in the last dim (a copy only when needed)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def _kernel_ok(torch, x, target) -> bool:
    bf = torch.bfloat16
    return x.dtype == bf and x.stride(-1) == 1 and (target is None or (target.dtype == bf and target.stride(-1) == 1))


def _mask_ids(torch, ids, mask, E):
    """Routes of GPU-resident experts -> -1 (ids outside [0, E) are left for the executor to reject)."""
    valid = (ids >= 0) & (ids < E)
    hit = mask.to(torch.bool)[ids.clamp(0, E - 1).long()] & valid
    return ids.masked_fill(hit, -1)


def decode(sync, path, layer, x, w, ids, mask, out, partial):
    import torch

    if out is not None and partial is not None:
        raise ValueError("give out= or partial=, not both")
    target = partial if partial is not None else out
    T = _check(sync, torch, layer, x, w, ids, mask, target)
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
        return _eager(sync, torch, layer, x, w, ids, mask, out, partial)

    stream = torch.cuda.current_stream(x.device).cuda_stream
    ids32, w32 = _rows(ids, torch, torch.int32), _rows(w, torch, torch.float32)
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
        ids32 = _mask_ids(torch, ids32, mask, ex.E)
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


def _eager(sync, torch, layer, x, w, ids, mask, out, partial):
    """No GPU handshake: synchronous CPU decode of host copies (never under capture)."""
    ids_c = ids.detach().to("cpu", torch.int32)
    if mask is not None:
        ids_c = _mask_ids(torch, ids_c, mask.detach().cpu(), sync.executor.E)
    xc = x.detach().cpu()
    if xc.dtype != torch.bfloat16:
        xc = xc.float()
    y = sync.executor.decode(layer, xc, w.detach().cpu().float(), ids_c).to(x.device)
    if partial is not None:
        return partial.add_(y)
    if out is not None:
        return out.copy_(y)
    return y


def CaptureRefused(sync) -> Exception:  # noqa: N802 - builds the exception
    why = "; ".join(f"{p}: {r}" for p, r in sync.reasons.items())
    return _native.CaptureRefusedError(
        "gpusync_cuda: CUDA graph capture refused: no replay-safe GPU<->CPU handshake on this machine "
        f"({why}). Decode MoE layers eagerly: disable CUDA graphs for decode (e.g. --cuda-graph-max-bs 0 / "
        "enforce_eager=True); eager decode stays correct.")
