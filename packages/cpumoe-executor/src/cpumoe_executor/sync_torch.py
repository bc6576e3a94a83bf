"""Torch-side pieces of a decode step that both sync backends (gpusync-cuda, gpusync-hip) share: argument
checks, row layout, GPU-resident expert masking and the synchronous fallback. torch is passed in by the
caller (a backend's decode), never imported here: cpumoe-executor installs and imports without it."""
from __future__ import annotations


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


def eager_step(sync, torch, layer, x, w, ids, mask, out, partial):
    """No GPU handshake: synchronous CPU decode of host copies (never under capture)."""
    ids_c = ids.detach().to("cpu", torch.int32)
    if mask is not None:
        ids_c = mask_ids(torch, ids_c, mask.detach().cpu(), sync.executor.E)
    xc = x.detach().cpu()
    if xc.dtype != torch.bfloat16:
        xc = xc.float()
    y = sync.executor.decode(layer, xc, w.detach().cpu().float(), ids_c).to(x.device)
    if partial is not None:
        return partial.add_(y)
    if out is not None:
        return out.copy_(y)
    return y
