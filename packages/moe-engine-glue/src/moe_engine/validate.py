"""Argument checks of the runner: each names the argument and the value expected, before anything runs."""
from __future__ import annotations

X_DTYPES = ("bfloat16", "float16", "float32")


def device(torch, value):
    """The activations' device: `value`, or cuda where torch sees a GPU, else cpu; a GPU that is not there is named."""
    if value is None:
        value = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        d = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={value!r}: {e}; expected 'cpu', 'cuda' or 'cuda:N'") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device={value!r}: expected 'cpu', 'cuda' or 'cuda:N' (HIP devices are 'cuda' in torch)")
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"device={value!r}, but torch {torch.__version__} sees no CUDA/HIP GPU here "
                             "(torch.cuda.is_available() is False); expected device='cpu'")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        elif d.index >= n:
            raise ValueError(f"device={value!r}: torch sees {n} GPU(s) (cuda:0..cuda:{n - 1})")
    return d


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


def step(r, layer_, x, w, ids) -> int:
    """Shapes, dtypes and devices of one forward(); returns the batch size T."""
    if isinstance(layer_, bool) or not hasattr(layer_, "__index__") or not 0 <= int(layer_) < r.num_layers:
        raise ValueError(f"layer={layer_!r}: expected an int in [0, {r.num_layers})")
    if r.closed:
        from .layer_formats import describe

        raise RuntimeError(f"MoERunner ({describe(r.layer_formats)}, {r.num_layers} layers) is closed")
    for name, t in (("hidden_states", x), ("topk_weights", w), ("topk_ids", ids)):
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
    for name, t in (("topk_weights", w), ("topk_ids", ids)):
        if tuple(t.shape) != (T, r.top_k):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected ({T}, top_k={r.top_k})")
    ids_int = not (ids.dtype.is_floating_point or ids.dtype.is_complex or str(ids.dtype) == "torch.bool")
    if not ids_int or not w.dtype.is_floating_point:
        swapped = ids.dtype.is_floating_point and not w.dtype.is_floating_point
        hint = (" (swapped? the order is (layer, hidden_states, topk_weights, topk_ids), as every layer of "
                "moe_engine and vLLM's fused-MoE take them)") if swapped else ""
        if not w.dtype.is_floating_point:
            raise TypeError(f"topk_weights: dtype {w.dtype}, expected a floating dtype{hint}")
        raise TypeError(f"topk_ids: dtype {ids.dtype}, expected an integer dtype (torch.int32 or torch.int64)")
    return T


def ids_range(ids, E: int) -> None:
    """Every id in [-1, E) (-1 = no route). Reads the values: on a GPU this synchronises (eager steps only)."""
    lo, hi = (int(v) for v in ids.aminmax()) if ids.numel() else (0, 0)
    if lo < -1 or hi >= E:
        raise ValueError(f"topk_ids: values in [{lo}, {hi}], expected ids in [-1, E={E}) (-1 = no route)")
