"""Placeholder: the ds_fp4 format is being written (schema, quantizer, dequantizer)."""
from ..schema import FormatSpec

SPEC = FormatSpec(name="ds_fp4", id=3, banks=())
