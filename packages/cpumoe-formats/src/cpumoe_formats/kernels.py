"""The kernels from Python: tier selection, a kernel handle, and a
single-threaded whole MoE step (`moe_forward`) for given banks and routes."""
from __future__ import annotations

import logging
import math

import numpy as np

from . import _native, activations
from ._arrays import check_array, describe
from .formats import get_format
from .inputs import check_routing, x_as_bf16
from .numerics import BF16

log = logging.getLogger("cpumoe_formats")
TIERS = ("scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512bf16", "amx")
_MODES = ("native", "w4a8")


def usable_tiers() -> list[str]:
    """Tiers this CPU, its OS and this build can run, lowest first. Threads: any."""
    m = _native.usable_tier_mask()
    return [t for i, t in enumerate(TIERS) if m >> i & 1]


def detected_tier() -> str:
    """The best tier of this CPU, OS and build, before any cap. Threads: any."""
    return TIERS[_native.detected_tier()]


# The layouts whose avx512vnni kernels CPUMOE_X16_PREFETCH switches (the callers of x16.h's install_pf with two
# kernels); q5_k_x16 always prefetches.
X16_PREFETCH_LAYOUTS = ("q4_0_x16", "q4_k_x16", "q6_k_x16", "q8_0_x16")


def x16_prefetch() -> dict:
    """Whether the avx512vnni tier's GGUF x16 kernels (X16_PREFETCH_LAYOUTS) run their software
    prefetch, as CPUMOE_X16_PREFETCH (auto | on | off; default auto: off on AMD, on elsewhere) chose it, read once per
    process: {"prefetch": "on" | "off", "why": "auto: AuthenticAMD" | "CPUMOE_X16_PREFETCH=off" | ...}. Benches
    record it beside the isa (machine_info). Raises ValueError naming the variable for an invalid value, as kernel
    creation then fails. Threads: any."""
    on, why = _native.x16_prefetch()
    if on < 0:
        raise ValueError(why)
    return {"prefetch": "on" if on else "off", "why": why}


PEAK_KINDS = ("int8", "bf16", "fp32")  # cpumoe_peak_kind, in enum order


def peak_loop(kind: str, tier: str, iters: int) -> int:
    """Multiply-adds done by `iters` rounds of `tier`'s widest multiply-add instruction for `kind` on this thread
    (abi.h peak_loop: int8 = vpmaddubsw / vpdpbusd / tdpbssd, bf16 = vdpbf16ps / tdpbf16ps or fp32 FMA below
    avx512bf16, fp32 = vfmadd231ps); 0 where this machine or build cannot run the tier or it has no such
    instruction (scalar). Timed on every core it is the compute roof of that tier (cpumoe_executor.bench).
    Threads: any number at once (the GIL released; one call per thread is what the roof times)."""
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


class NativeHandle:
    """What Kernel and Linear share: a native object `_k` with its tier's name, closed / close() and a `with` block
    that closes it. Subclasses set `_k`, `_name` and `_tier`."""

    @property
    def name(self) -> str:
        """What runs: the tier, plus the precision mode for a Kernel (e.g. 'avx2+w4a8')."""
        return self._name

    @property
    def tier(self) -> str:
        return self._tier

    @property
    def closed(self) -> bool:
        return self._k.closed

    def close(self) -> None:
        """Free the native object (idempotent). Later calls raise RuntimeError; calls in flight finish first."""
        self._k.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Kernel(NativeHandle):
    """A format kernel at the best tier <= the cap (isa= or CPUMOE_ISA), and the single-threaded MoE step through it.

    Threads: shareable. forward() and the steps bind() returns may run on any number of threads at once with the
    GIL released during the native step (a call uses the kernel's scratch when it is free, else its own); each
    concurrent call needs its own `out`: an `out` overlapping memory that a call in flight writes or reads, or an
    input overlapping another call's `out`, raises RuntimeError. Banks and inputs must not change during a call.
    Lifetime: the Kernel owns a native kernel; close() (or leaving a `with` block) frees it and every later call
    raises RuntimeError naming the kernel; a call in flight on another thread finishes first on the kernel it
    holds. In a forked child a Kernel from the parent works as in the parent.
    """

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
        self._name, self._tier = self._k.name, TIERS[self._k.tier]
        log.debug("cpumoe_formats: %s kernel %s (E=%d H=%d I=%d %s)", self.spec.name, self.name, E, H, I,
                  self.act.name)

    def __repr__(self) -> str:
        return (f"cpumoe_formats.Kernel({self.spec.name!r}, E={self.E}, H={self.H}, I={self.I}, {self._name}"
                f"{', closed' if self._k.closed else ''})")

    def _live(self):
        if self._k.closed:
            raise RuntimeError(f"{self!r} is closed; create a new Kernel")
        return self._k

    def _check_banks(self, banks):
        arrays, dims = self.spec.validate(banks)
        if dims != (self.E, self.H, self.I):
            raise ValueError(f"banks have (E, H, I) = {dims}, this kernel was made for {(self.E, self.H, self.I)}")
        return arrays

    def forward(self, banks, x, topk_weights, topk_ids, out=None) -> np.ndarray:
        """y [T, H] bf16 (into `out` if given: a writable, C-contiguous, aligned bf16 [T, H] array)."""
        k = self._live()
        arrays = self._check_banks(banks)
        xb = x_as_bf16(x, self.H)
        T = xb.shape[0]
        w, ids = check_routing(topk_weights, topk_ids, T, self.E)
        if out is None:
            out = np.empty((T, self.H), BF16)
        else:
            out = check_array(out, "out", dtype=BF16, shape=(T, self.H), writable=True)
        if T:
            k.moe_step(self.spec.bank_views(arrays), T, ids.shape[1], xb.ctypes.data, ids.ctypes.data,
                       w.ctypes.data, out.ctypes.data)
        return out

    def bind(self, banks):
        """Validate `banks` once; returns step(x, topk_weights, topk_ids, out) -> out for tight loops (the bench).

        The step takes numpy arrays the native call uses as they are (cheap checks, by check_array): x bf16
        [T, H], out bf16 [T, H] (writable), topk_weights float32 [T, top_k], topk_ids int32 [T, top_k], all
        C-contiguous and aligned (ids are range-checked natively). The banks are not re-validated per call: keep
        them alive and unchanged while the step is used (the step holds them). Threads: as forward().
        """
        arrays = self._check_banks(banks)
        views, H = self.spec.bank_views(arrays), self.H

        def step(x, topk_weights, topk_ids, out):
            k = self._live()
            ids = check_array(topk_ids, "topk_ids (bound step)", dtype=np.int32)
            if ids.ndim != 2:
                raise ValueError(f"topk_ids (bound step): {describe(ids)}, expected int32 [T, top_k]")
            T, top_k = ids.shape
            x = check_array(x, "x (bound step)", dtype=BF16, shape=(T, H))
            out = check_array(out, "out (bound step)", dtype=BF16, shape=(T, H), writable=True)
            w = check_array(topk_weights, "topk_weights (bound step)", dtype=np.float32, shape=(T, top_k))
            if T:
                k.moe_step(views, T, top_k, x.ctypes.data, ids.ctypes.data, w.ctypes.data, out.ctypes.data)
            return out

        step.arrays = arrays  # keeps the validated arrays alive with the step
        return step


def moe_forward(fmt, banks, x, topk_weights, topk_ids, *, activation: str = "silu", alpha: float | None = None,
                limit: float | None = None, apply_router_weight_on_input: bool = False, mode: str | None = None,
                isa: str | None = None, out=None) -> np.ndarray:
    """One whole MoE step, single-threaded, through the kernels: y [T, H] bf16.

    x [T, H] (bf16, or float converted to bf16), topk_weights [T, top_k] float32,
    topk_ids [T, top_k] integer in [-1, E) (-1 = skip). `out` may be a
    preallocated writable, C-contiguous, aligned bf16 [T, H] array.
    Threads: any number at once (a kernel per call, the GIL released during the step); concurrent calls need
    their own `out` (Kernel's rule).
    """
    spec = get_format(fmt)
    _, (E, H, I) = spec.validate(banks)
    with Kernel(spec, E, H, I, activation=activation, alpha=alpha, limit=limit,
                apply_router_weight_on_input=apply_router_weight_on_input, mode=mode, isa=isa) as k:
        return k.forward(banks, x, topk_weights, topk_ids, out=out)


def selected_tier(fmt, mode: str | None = None, isa: str | None = None) -> str:
    """The kernel name a format gets on this machine (respects CPUMOE_ISA). Threads: any."""
    spec = get_format(fmt)
    m = spec.k_multiple
    with Kernel(spec, 1, m * 4, m * 4, mode=mode, isa=isa) as k:
        return k.name


