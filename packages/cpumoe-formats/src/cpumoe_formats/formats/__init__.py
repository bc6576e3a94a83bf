"""The format registry: one line per format. A format lives in formats/<name>.py
(schema, quantizer, float64 dequantizer) and csrc/formats/<name>.cpp (kernels)."""
from __future__ import annotations

from ..schema import FormatSpec
from . import (
    bf16,
    bf16_x16,
    ds_fp4,
    ds_fp4_x16,
    fp8_block,
    fp8_block_x16,
    mxfp4,
    mxfp4_panel,
    mxfp4_x16,
    nvfp4,
    nvfp4_x16,
    q4_0,
    q4_0_x16,
    q4_k,
    q4_k_x16,
    q5_k,
    q5_k_x16,
    q6_k,
    q6_k_x16,
    q8_0,
    q8_0_x16,
)

FORMATS: dict[str, FormatSpec] = {
    m.SPEC.name: m.SPEC
    for m in (bf16, nvfp4, mxfp4, ds_fp4, q4_0, fp8_block, mxfp4_panel, q4_0_x16, fp8_block_x16, nvfp4_x16, ds_fp4_x16,
              bf16_x16, mxfp4_x16, q8_0, q4_k, q6_k, q4_k_x16, q8_0_x16, q5_k,
              q6_k_x16, q5_k_x16)
}
_ALIASES = {a: s.name for s in FORMATS.values() for a in s.aliases}
# repacked CPU layouts of a weight format (reached by its cpu_layout links): accepted by name, not listed as formats
CPU_LAYOUTS = tuple(sorted({s.cpu_layout for s in FORMATS.values() if s.cpu_layout}))
WEIGHT_FORMATS = tuple(n for n in FORMATS if n not in CPU_LAYOUTS)


def get_format(name) -> FormatSpec:
    """The FormatSpec for a format name (or alias); ValueError naming the valid ones. Threads: any (the registry
    is fixed at import)."""
    if isinstance(name, FormatSpec):
        return name
    if not isinstance(name, str):
        raise TypeError(f"format must be a format name (str), got {type(name).__name__}")
    key = _ALIASES.get(name, name)
    if key not in FORMATS:
        folded = {n.lower(): n for n in (*FORMATS, *_ALIASES)}.get(name.lower())
        hint = f" (names are lower case: did you mean {folded!r}?)" if folded else ""
        raise ValueError(f"format={name!r} is not a known weight format{hint}; expected one of "
                         f"{sorted(WEIGHT_FORMATS)}")
    return FORMATS[key]
