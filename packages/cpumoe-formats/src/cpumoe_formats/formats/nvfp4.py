"""Placeholder: the nvfp4 format is being written (schema, quantizer, dequantizer)."""
from ..schema import FormatSpec

SPEC = FormatSpec(name="nvfp4", id=1, banks=())
