"""Placeholder: the mxfp4 format is being written (schema, quantizer, dequantizer)."""
from ..schema import FormatSpec

SPEC = FormatSpec(name="mxfp4", id=2, banks=())
