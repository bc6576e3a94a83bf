"""The CPU layout a format's banks run as on this machine (q4_0 -> q4_0_x16, mxfp4 -> mxfp4_panel -> mxfp4_x16, ...):
chosen by the layout's modes, shape rules and the kernel tier it gets here."""
from __future__ import annotations

import cpumoe_formats as cf
from cpumoe_formats.kernels import TIERS


def cpu_layout(format, H: int, I: int, mode: str | None = None, isa: str | None = None) -> str:  # noqa: A002, E741
    """The format a CpuMoeExecutor runs banks of `format` as on this machine (repack=None): the format itself, or the
    CPU layout it repacks them into (q4_0 -> q4_0_x16, mxfp4 -> mxfp4_panel / mxfp4_x16, ...). A loader that streams a
    model layer by layer converts each layer to it as it arrives (FormatSpec.to_layout), so the process never holds
    the given banks and the repacked copy at once. Threads: any; a pure function of its arguments and the machine."""
    spec = cf.get_format(format)
    mode = spec.default_mode if mode is None else mode
    if mode not in spec.modes:
        raise ValueError(f"mode={mode!r} is not supported by format {spec.name!r}; expected one of {list(spec.modes)}")
    target = repack_target(spec, H, I, mode, isa, None)
    return spec.name if target is None else target.name


def repack_target(spec, H: int, I: int, mode: str, isa: str | None, repack: bool | None):  # noqa: E741
    """The CPU layout to run as, or None: the format's cpu_layout, then that layout's own, as far as each step
    passes (mxfp4 -> mxfp4_panel -> mxfp4_x16 in w4a8). repack=True forces the first step only."""
    target = None
    while (step := _layout_step(spec, H, I, mode, isa, repack if target is None else None)) is not None:
        target = spec = step
    return target


def _layout_step(spec, H: int, I: int, mode: str, isa: str | None, repack: bool | None):  # noqa: E741
    """spec's CPU layout, or None. Auto (repack=None): when the layout has the mode, takes H and I, and its kernel
    on this machine (isa / CPUMOE_ISA respected) is at least spec's tier and spec's cpu_layout_min_tier (avx2
    for every layout but bf16's, avx512f: a scalar cap keeps the given format)."""
    if not spec.cpu_layout or repack is False:
        return None
    target = cf.get_format(spec.cpu_layout)
    if mode not in target.modes:
        if repack:
            raise ValueError(f"repack=True: format {target.name!r} (the CPU layout of {spec.name!r}) has "
                             f"no mode {mode!r}; expected mode in {list(target.modes)} or repack=None")
        return None
    try:  # the layout's own shape rules (fp8_block takes any H and I, fp8_block_x16 multiples of 16)
        target.check_dims(H, I)
    except ValueError as e:
        if repack:
            raise ValueError(f"repack=True: {e}; expected repack=None or False for these banks") from None
        return None
    if repack:
        return target
    tier = lambda fmt: TIERS.index(cf.selected_tier(fmt, mode, isa).split("+")[0])  # noqa: E731
    floor = TIERS.index(spec.cpu_layout_min_tier) if spec.cpu_layout_min_tier else 0
    return target if tier(target.name) >= max(tier(spec.name), floor) else None
