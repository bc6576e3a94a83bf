"""The kernels from Python: tier selection, a kernel handle, and a
single-threaded whole MoE step (`moe_forward`) for given banks and routes."""
from __future__ import annotations

import logging
import math

import numpy as np

from . import _native, activations
from ._arrays import as_array, describe
from .formats import get_format
from .inputs import check_routing, x_as_bf16
from .numerics import BF16

log = logging.getLogger("cpumoe_formats")
TIERS = ("scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512bf16", "amx")
_MODES = ("native", "w4a8")


def usable_tiers() -> list[str]:
    """Tiers this CPU, its OS and this build can run, lowest first."""
    m = _native.usable_tier_mask()
    return [t for i, t in enumerate(TIERS) if m >> i & 1]


def detected_tier() -> str:
    return TIERS[_native.detected_tier()]


PEAK_KINDS = ("int8", "bf16", "fp32")  # cpumoe_peak_kind, in enum order


def peak_loop(kind: str, tier: str, iters: int) -> int:
    """Multiply-adds done by `iters` rounds of `tier`'s widest multiply-add instruction for `kind` on this thread
    (abi.h peak_loop: int8 = vpmaddubsw / vpdpbusd / tdpbssd, bf16 = vdpbf16ps / tdpbf16ps or fp32 FMA below
    avx512bf16, fp32 = vfmadd231ps); 0 where this machine or build cannot run the tier or it has no such
    instruction (scalar). Timed on every core it is the compute roof of that tier (cpumoe_executor.bench)."""
    if kind not in PEAK_KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {list(PEAK_KINDS)}")
    if tier not in TIERS:
        raise ValueError(f"tier={tier!r} is not a tier; expected one of {list(TIERS)}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters={iters!r}; expected a positive int")
    return _native.peak_loop(PEAK_KINDS.index(kind), TIERS.index(tier), iters)


def _tier_cap(isa) -> int:
    if isa is None:
        return -1  # CPUMOE_ISA or the best
    if isa not in TIERS:
        raise ValueError(f"isa={isa!r} is not a tier; expected one of {list(TIERS)}")
    return TIERS.index(isa)


class Kernel:
    """A format kernel at the best tier <= the cap (isa= or CPUMOE_ISA)."""

    def __init__(self, fmt, E: int, H: int, I: int, *, activation: str = "silu",  # noqa: E741
                 alpha: float | None = None, limit: float | None = None,
                 apply_router_weight_on_input: bool = False, mode: str | None = None, isa: str | None = None):
        self.spec = get_format(fmt)
        self.act = activations.resolve(activation, alpha, limit)
        mode = self.spec.default_mode if mode is None else mode
        if mode not in self.spec.modes:
            raise ValueError(f"mode={mode!r} is not supported by format {self.spec.name!r}; "
                             f"expected one of {list(self.spec.modes)}")
        if apply_router_weight_on_input and not self.spec.input_weight:
            raise ValueError(f"format {self.spec.name!r} applies the router weight on the output; "
                             "apply_router_weight_on_input=True is not supported")
        self.spec.check_dims(H, I)
        self.E, self.H, self.I, self.mode = E, H, I, mode
        limit_f = self.act.limit if math.isfinite(self.act.limit) else float("inf")
        self._k = _native.Kernel(self.spec.id, self.act.id, _MODES.index(mode), bool(apply_router_weight_on_input),
                                 E, H, I, self.act.alpha, limit_f, _tier_cap(isa))
        log.debug("cpumoe_formats: %s kernel %s (E=%d H=%d I=%d %s)", self.spec.name, self.name, E, H, I,
                  self.act.name)

    @property
    def name(self) -> str:
        """What runs: tier plus precision mode, e.g. 'avx2+w4a8'."""
        return self._k.name

    @property
    def tier(self) -> str:
        return TIERS[self._k.tier]

    def forward(self, banks, x, topk_weights, topk_ids, out=None) -> np.ndarray:
        arrays, dims = self.spec.validate(banks)
        if dims != (self.E, self.H, self.I):
            raise ValueError(f"banks have (E, H, I) = {dims}, this kernel was made for {(self.E, self.H, self.I)}")
        xb = x_as_bf16(x, self.H)
        T = xb.shape[0]
        w, ids = check_routing(topk_weights, topk_ids, T, self.E)
        if out is None:
            out = np.empty((T, self.H), BF16)
        else:
            out = as_array(out, "out")
            if out.shape != (T, self.H) or out.dtype != BF16 or not out.flags.c_contiguous:
                raise ValueError(f"out: {describe(out)}, expected C-contiguous bfloat16 of shape {(T, self.H)}")
        if T:
            self._k.moe_step(self.spec.bank_views(arrays), T, ids.shape[1], xb.ctypes.data, ids.ctypes.data,
                             w.ctypes.data, out.ctypes.data)
        return out

    def bind(self, banks):
        """Validate `banks` once; returns step(x, topk_weights, topk_ids, out) -> out for tight loops (the bench).

        The step takes C-contiguous numpy arrays only: x and out bf16 [T, H], topk_weights float32
        [T, top_k], topk_ids int32 [T, top_k] (cheap dtype/shape checks; ids are range-checked natively).
        The banks are not re-validated per call: keep them alive and unchanged while the step is used.
        """
        arrays, dims = self.spec.validate(banks)
        if dims != (self.E, self.H, self.I):
            raise ValueError(f"banks have (E, H, I) = {dims}, this kernel was made for {(self.E, self.H, self.I)}")
        views, native, H = self.spec.bank_views(arrays), self._k.moe_step, self.H

        def step(x, topk_weights, topk_ids, out):
            T, k = topk_ids.shape
            if not (x.dtype == BF16 and out.dtype == BF16 and topk_weights.dtype == np.float32
                    and topk_ids.dtype == np.int32 and x.shape == (T, H) and out.shape == (T, H)
                    and topk_weights.shape == (T, k) and x.flags.c_contiguous and out.flags.c_contiguous
                    and topk_weights.flags.c_contiguous and topk_ids.flags.c_contiguous):
                raise ValueError(f"bound step needs C-contiguous x, out bf16 [T, {H}], topk_weights float32 and "
                                 f"topk_ids int32 [T, top_k]; got x {describe(x)}, out {describe(out)}, "
                                 f"topk_weights {describe(topk_weights)}, topk_ids {describe(topk_ids)}")
            if T:
                native(views, T, k, x.ctypes.data, topk_ids.ctypes.data, topk_weights.ctypes.data, out.ctypes.data)
            return out

        step.arrays = arrays  # keeps the validated arrays alive with the step
        return step


def moe_forward(fmt, banks, x, topk_weights, topk_ids, *, activation: str = "silu", alpha: float | None = None,
                limit: float | None = None, apply_router_weight_on_input: bool = False, mode: str | None = None,
                isa: str | None = None, out=None) -> np.ndarray:
    """One whole MoE step, single-threaded, through the kernels: y [T, H] bf16.

    x [T, H] (bf16, or float converted to bf16), topk_weights [T, top_k] float32,
    topk_ids [T, top_k] integer in [-1, E) (-1 = skip). `out` may be a
    preallocated C-contiguous bf16 [T, H] array.
    """
    spec = get_format(fmt)
    _, (E, H, I) = spec.validate(banks)
    k = Kernel(spec, E, H, I, activation=activation, alpha=alpha, limit=limit,
               apply_router_weight_on_input=apply_router_weight_on_input, mode=mode, isa=isa)
    return k.forward(banks, x, topk_weights, topk_ids, out=out)


def selected_tier(fmt, mode: str | None = None, isa: str | None = None) -> str:
    """The kernel name a format gets on this machine (respects CPUMOE_ISA)."""
    spec = get_format(fmt)
    m = spec.k_multiple
    return Kernel(spec, 1, m * 4, m * 4, mode=mode, isa=isa).name


