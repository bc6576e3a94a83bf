"""Argument checks of the runner: each names the argument and the value expected, before anything runs."""
from __future__ import annotations

X_DTYPES = ("bfloat16", "float16", "float32")


def batch_sizes(sizes) -> tuple[int, ...]:
    try:
        out = tuple(sorted({int(s) for s in sizes}))
    except (TypeError, ValueError):
        raise TypeError(f"graph_batch_sizes={sizes!r}: expected an iterable of positive ints") from None
    if not out or out[0] < 1:
        raise ValueError(f"graph_batch_sizes={sizes!r}: expected a non-empty set of positive ints")
    return out


def max_tokens(value, sizes: tuple[int, ...]) -> int:
    if value is None:
        return sizes[-1]
    if not isinstance(value, int) or value < sizes[-1]:
        raise ValueError(f"max_tokens={value!r}: expected an int >= the largest graph batch size ({sizes[-1]})")
    return value


def layer(value, num_layers: int) -> None:
    if isinstance(value, bool) or not hasattr(value, "__index__") or not 0 <= int(value) < num_layers:
        raise ValueError(f"layer={value!r}: expected an int in [0, {num_layers})")


def step(r, layer_, x, ids, w) -> int:
    """Shapes, dtypes and devices of one forward(); returns the batch size T."""
    layer(layer_, r.num_layers)
    for name, t in (("hidden_states", x), ("topk_ids", ids), ("topk_weights", w)):
        if not hasattr(t, "dtype") or not hasattr(t, "device"):
            raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
        if t.device != r.device:
            raise ValueError(f"{name}: on {t.device}, expected the runner's device {r.device}")
    if x.dim() != 2 or x.shape[1] != r.H:
        raise ValueError(f"hidden_states: shape {tuple(x.shape)}, expected [num_tokens, H={r.H}]")
    if str(x.dtype).replace("torch.", "") not in X_DTYPES:
        raise TypeError(f"hidden_states: dtype {x.dtype}, expected one of torch.{', torch.'.join(X_DTYPES)}")
    T = x.shape[0]
    if T < 1:
        raise ValueError("hidden_states: 0 tokens, expected at least 1")
    for name, t in (("topk_ids", ids), ("topk_weights", w)):
        if tuple(t.shape) != (T, r.top_k):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected ({T}, top_k={r.top_k})")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or str(ids.dtype) == "torch.bool":
        raise TypeError(f"topk_ids: dtype {ids.dtype}, expected an integer dtype (torch.int32 or torch.int64)")
    if not w.dtype.is_floating_point:
        raise TypeError(f"topk_weights: dtype {w.dtype}, expected a floating dtype")
    return T


def ids_range(ids, E: int) -> None:
    """Every id in [-1, E) (-1 = no route). Reads the values: on a GPU this synchronises (eager steps only)."""
    lo, hi = (int(v) for v in ids.aminmax()) if ids.numel() else (0, 0)
    if lo < -1 or hi >= E:
        raise ValueError(f"topk_ids: values in [{lo}, {hi}], expected ids in [-1, E={E}) (-1 = no route)")
