"""GpuExperts: one weight format's (or one (gate_up, down) pair's) GPU-resident experts for every layer,
`capacity` slots per layer, and the decode-sized forward over them (Triton; kernels.py)."""
from __future__ import annotations

import math

import numpy as np
import torch
import triton

from . import config as _config
from . import layouts
from ._tl import ACT_IDS, INTERP, INTERPRET
from .kernels import FMT_IDS, down_group_kernel, down_token_kernel, gate_up_kernel, route_sum_kernel
from .moved import MovedRole, role_banks
from .routing import route_groups


class GpuExperts:
    """GPU-resident experts for num_layers layers, `capacity` slots per layer, in one format or a (gate_up, down)
    pair of formats (every layer the same; a model whose layers differ builds one GpuExperts per distinct pair).

    format: a name of FORMATS, or a (gate_up_format, down_format) pair of them (Q4_K_M files: ("q4_k", "q6_k")); a
    pair of one name twice is that format. `.format` is the name (or the pair when the two differ), `.formats` the
    (gate_up, down) pair either way.

    forward(layer, x, slots, topk_weights) computes, per token t, sum over routes k with slots[t, k] in
    [0, capacity) of the expert in that slot applied to x[t] (router weight on the output, or on the input when
    apply_router_weight_on_input), following cpumoe_formats.reference.moe in mode "native": fp32 accumulation, the
    activation in fp32 on gate and up, the intermediate rounded to bf16, the route sum in fp32 in route order, the
    output rounded to bf16 once. Slots outside [0, capacity) (-1: not on the GPU) are skipped.

    host_format: the format (or pair) of the banks load() reads, where it is a CPU layout of `format` (q4_0_x16 for
    q4_0; gpu/moved.py): each load copies the layout's bytes and puts them in the format's order on the device, so
    the host holds one copy of the experts, the executor's. None: the banks are in `format`.

    Capture-safe: a forward is a fixed sequence of kernel launches whose grids depend on T only; no host
    synchronisation; workspaces come from torch's caching allocator.

    Threads: one caller at a time (MoERunner calls it under its lock); load(), set_config() and forward() take no
    lock of their own and run on the caller's current stream.
    """

    FORMATS = ("bf16", "fp8_block", "mxfp4", "nvfp4", "q4_0", "q8_0", "q4_k", "q6_k")

    def __init__(self, format, *, num_layers: int, capacity: int, E: int, H: int, I: int,  # noqa: E741
                 top_k: int, activation: str = "silu", alpha: float | None = None, limit: float | None = None,
                 apply_router_weight_on_input: bool = False, max_tokens: int, device, config=None,
                 host_format=None):
        from cpumoe_formats import activations

        specs = _format_pair(format, self.FORMATS)
        for nm, v in (("num_layers", num_layers), ("capacity", capacity), ("E", E), ("H", H), ("I", I),
                      ("top_k", top_k), ("max_tokens", max_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if nm == "capacity" else 1):
                raise ValueError(f"{nm}={v!r}: expected a positive int")
        if capacity > E:
            raise ValueError(f"capacity={capacity} > E={E}: at most E slots per layer")
        for spec in specs:
            spec.check_dims(H, I)
            if apply_router_weight_on_input and not spec.input_weight:
                raise ValueError(f"format {spec.name!r} applies the router weight on the output; "
                                 "apply_router_weight_on_input=True is not supported")
        act = activations.resolve(activation, alpha, limit)
        self.device = torch.device(device)
        if self.device.type == "cpu" and not INTERPRET:
            raise RuntimeError("GpuExperts on device 'cpu' needs Triton's interpreter: set TRITON_INTERPRET=1 before "
                               "moe_engine.gpu is first imported")
        self._specs = specs
        self.formats = (specs[0].name, specs[1].name)
        self._host_specs, self._moved = specs, {}
        if host_format is not None:
            from . import moved

            self._host_specs = _format_pair(host_format, None)
            for role, h, g in zip(layouts.ROLES, self._host_specs, specs):
                if h is g:
                    continue
                if moved.source(h.name, H, I) != g.name:
                    raise ValueError(f"host_format={host_format!r}: the {role} banks in {h.name!r} are not "
                                     f"{g.name!r}'s bytes moved, so the GPU cannot load {g.name!r} experts from them")
                self._moved[role] = MovedRole(h.name, role, H, I, self.device)
        self.format = self.formats[0] if specs[0] is specs[1] else self.formats
        self.fmt_ids = (FMT_IDS[self.formats[0]], FMT_IDS[self.formats[1]])
        self.num_layers, self.capacity, self.E, self.H, self.I = num_layers, capacity, E, H, I
        self.top_k, self.max_tokens = top_k, max_tokens
        self.activation, self.act_id = act.name, ACT_IDS[act.name]
        self.alpha = float(act.alpha)
        self.limit = float(act.limit) if math.isfinite(act.limit) else float("inf")
        self.apply_router_weight_on_input = bool(apply_router_weight_on_input)
        self.srs = layouts.scale_row_stride(self.formats, H, I)
        self.bytes_per_expert = layouts.bytes_per_expert(self.formats, H, I)
        slots = max(capacity, 1)
        self.parts = {}
        for name, (shape, dtype) in layouts.specs(self.formats, H, I).items():
            self.parts[name] = torch.zeros((num_layers, slots) + tuple(shape), dtype=dtype, device=self.device)
        self._dummy = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._configs = {}
        self._default_config = config
        if config is not None:
            _config.check(self.formats, config)

    # ---- configuration -------------------------------------------------------------------------------
    def config_for(self, T: int) -> _config.Config:
        cfg = self._configs.get(T, self._default_config)
        return cfg if cfg is not None else _config.default(self.formats, T, self.H, self.I)

    def set_config(self, T: int | None, cfg: _config.Config) -> None:
        """Use `cfg` for batch size T (None: every T without its own)."""
        _config.check(self.formats, cfg)
        if T is None:
            self._default_config = cfg
        else:
            self._configs[int(T)] = cfg

    # ---- weights -------------------------------------------------------------------------------------
    def load(self, layer: int, slot: int, banks: dict, expert: int, *, non_blocking: bool = False) -> None:
        """Copy expert `expert` of `banks` (one layer's cpumoe_formats banks: numpy arrays, leading dim E) into
        `slot` of `layer` (stream-ordered on the current stream). For a pair, `banks` holds the gate_up format's
        gate-up banks and the down format's down banks under their schema names (q4_k's "gate_up", q6_k's "down")."""
        self._check_layer(layer)
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot={slot}: expected 0 <= slot < capacity={self.capacity}")
        if not 0 <= expert < self.E:
            raise ValueError(f"expert={expert}: expected 0 <= expert < E={self.E}")
        self._validate(banks)
        parts = layouts.to_device(self.formats, banks, expert, self.H, self.I, self.device, non_blocking, self._moved)
        for name, t in parts.items():
            self.parts[name][layer, slot].copy_(t, non_blocking=non_blocking)

    def load_range(self, layer: int, slot: int, banks: dict, lo: int, hi: int, *, non_blocking: bool = False) -> None:
        """Copy experts lo..hi-1 of `banks` into slots slot..slot+hi-lo-1 of `layer`: one copy per bank and part for
        the whole range (a staged prefill's layer: the per-expert load() ran 128 copies and plane splits a layer)."""
        self._check_layer(layer)
        n = hi - lo
        if not (0 <= lo < hi <= self.E and 0 <= slot and slot + n <= self.capacity):
            raise ValueError(f"experts {lo}..{hi} into slots from {slot}: expected 0 <= lo < hi <= E={self.E} and "
                             f"slot + (hi - lo) <= capacity={self.capacity}")
        self._validate(banks)
        parts = layouts.to_device(self.formats, banks, slice(lo, hi), self.H, self.I, self.device, non_blocking,
                                  self._moved)
        for name, t in parts.items():
            self.parts[name][layer, slot:slot + n].copy_(t, non_blocking=non_blocking)

    def _validate(self, banks) -> None:
        h = self._host_specs
        if h[0] is h[1]:
            h[0].validate(banks, self.E, self.H, self.I)
        else:
            _validate_pair(h, banks, self.E, self.H, self.I)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer}: expected 0 <= layer < num_layers={self.num_layers}")

    def _part(self, layer: int, name: str, src=None):
        """(tensor view of one layer, slot stride in elements) or the dummy for a part the format lacks."""
        t = (self if src is None else src).parts.get(name)
        if t is None:
            return self._dummy, 0
        v = t[layer]
        return v, v.stride(0)

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, layer: int, x, topk_weights, slots, out=None, bank=None):
        """y [T, H] bf16 = sum over routes with a resident slot of weight * expert(x) (or into `out`).
        bank: another store of experts in this layout (`parts` {name: [layers, n, ...]}, `capacity` n), e.g. the
        zero-copy host bank (placement/zerocopy.py); `slots` then index it."""
        self._check_layer(layer)
        src = self if bank is None else bank
        T, K, H, I = x.shape[0], self.top_k, self.H, self.I  # noqa: E741
        if x.ndim != 2 or x.shape[1] != H:
            raise ValueError(f"x: shape {tuple(x.shape)}, expected [T, H={H}]")
        if tuple(slots.shape) != (T, K) or tuple(topk_weights.shape) != (T, K):
            raise ValueError(f"slots {tuple(slots.shape)} and topk_weights {tuple(topk_weights.shape)}: expected "
                             f"[T={T}, top_k={K}]")
        if out is None:
            out = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
        elif tuple(out.shape) != (T, H) or out.dtype != torch.bfloat16 or (T and out.stride(1) != 1):
            raise ValueError(f"out: {tuple(out.shape)} {out.dtype}, expected [T, H] bfloat16 with unit column stride")
        if T == 0:
            return out
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        if x.stride(1) != 1:
            x = x.contiguous()
        slots = slots.to(torch.int32).contiguous() if slots.dtype != torch.int32 else slots.contiguous()
        tw = topk_weights.to(torch.float32).contiguous()
        cfg = self.config_for(T)
        R = T * K
        dev = x.device
        if cfg.grouped:
            order, count = route_groups(slots, src.capacity)
        else:
            order = count = slots  # unused by the kernels (GROUPED=0)
        gw, gws = self._part(layer, "gu_w", src)
        gs, gss = self._part(layer, "gu_s", src)
        gv, gvs = self._part(layer, "gu_v", src)
        dw, dws = self._part(layer, "dn_w", src)
        ds, dss = self._part(layer, "dn_s", src)
        dv, dvs = self._part(layer, "dn_v", src)
        h = torch.empty((R, I), dtype=torch.bfloat16, device=dev)
        g = cfg.gate_up
        gate_up_kernel[(R, triton.cdiv(I, g.block_n))](
            x, x.stride(0), slots, tw, order, count, src.capacity,
            gw, gs, gv, gws, gss, gvs, self.srs[0], h, I, H, self.alpha, self.limit,
            FMT=self.fmt_ids[0], ACT=self.act_id, TOP_K=K, GROUPED=cfg.grouped, DOT=g.dot,
            WEIGHT_IN=self.apply_router_weight_on_input, BN=g.block_n, BK=g.block_k, BM=g.block_m, INTERP=INTERP,
            num_warps=g.num_warps, num_stages=g.num_stages)
        d = cfg.down
        wout = not self.apply_router_weight_on_input
        if cfg.down_mode == "token":
            down_token_kernel[(T, triton.cdiv(H, d.block_n))](
                h, slots, tw, src.capacity, dw, ds, dv, dws, dss, dvs, self.srs[1], out, out.stride(0), H, I,
                FMT=self.fmt_ids[1], TOP_K=K, WEIGHT_OUT=wout, BN=d.block_n, BK=d.block_k, INTERP=INTERP,
                num_warps=d.num_warps, num_stages=d.num_stages)
        else:
            o = torch.empty((R, H), dtype=torch.float32, device=dev)
            down_group_kernel[(R, triton.cdiv(H, d.block_n))](
                h, slots, tw, order, count, src.capacity, dw, ds, dv, dws, dss, dvs, self.srs[1], o, H, I,
                FMT=self.fmt_ids[1], GROUPED=cfg.grouped, DOT=d.dot, WEIGHT_OUT=wout, BN=d.block_n, BK=d.block_k,
                BM=d.block_m, INTERP=INTERP, num_warps=d.num_warps, num_stages=d.num_stages)
            route_sum_kernel[(T, triton.cdiv(H, cfg.sum_block))](
                o, slots, src.capacity, out, out.stride(0), H, TOP_K=K, BN=cfg.sum_block, INTERP=INTERP,
                num_warps=4)
        return out

    __call__ = forward


def _format_pair(format, allowed) -> tuple:
    """A format name or a (gate_up, down) pair -> (gate_up spec, down spec), each a GPU experts format (any format
    where allowed is None)."""
    import cpumoe_formats as cf

    if isinstance(format, (tuple, list)):
        if len(format) != 2:
            raise ValueError(f"format={format!r}: expected a format name or a (gate_up_format, down_format) pair")
        names = tuple(format)
    else:
        names = (format, format)
    specs = tuple(cf.get_format(n) for n in names)
    for role, spec in zip(("gate_up", "down"), specs):
        if allowed is not None and spec.name not in allowed:
            what = f"format={format!r}" if specs[0] is specs[1] else f"format={format!r} ({role} {spec.name!r})"
            raise ValueError(f"{what}: GpuExperts runs {list(allowed)}")
    return specs


def _validate_pair(specs, banks, E: int, H: int, I: int) -> None:  # noqa: E741
    """A pair layer's banks: the gate_up format's gate-up banks and the down format's down banks, each of its
    schema's dtype and shape with contiguous rows."""
    from collections.abc import Mapping

    if not isinstance(banks, Mapping):
        raise TypeError(f"banks: expected a mapping of bank name to array, got {type(banks).__name__}")
    want = {b.name: (spec, role, b) for role, spec in zip(("gate_up", "down"), specs) for b in role_banks(spec, role)}
    missing, extra = [n for n in want if n not in banks], [n for n in banks if n not in want]
    if missing or extra:
        raise ValueError(f"banks for the pair ({specs[0].name}, {specs[1].name}) need {list(want)}; missing "
                         f"{missing}, unexpected {extra}")
    for name, (spec, role, b) in want.items():
        a = np.asarray(banks[name])
        where = f"{role} bank {name!r} ({spec.name})"
        if a.dtype not in [np.dtype(d) for d in b.dtypes]:
            raise TypeError(f"{where}: dtype {a.dtype}, expected {np.dtype(b.dtypes[0])}")
        exp = b.expected(E, H, I)
        ok = a.ndim == len(exp) and a.shape[:-1] == exp[:-1] and (
            a.shape[-1] >= exp[-1] if b.padded_last else a.shape[-1] == exp[-1])
        if not ok:
            raise ValueError(f"{where}: shape {a.shape}, expected {exp} (E={E}, H={H}, I={I})")
        if a.strides[-1] != a.dtype.itemsize:
            raise ValueError(f"{where}: innermost stride {a.strides[-1]} bytes, expected {a.dtype.itemsize}")
