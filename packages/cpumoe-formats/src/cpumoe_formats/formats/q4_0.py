"""Placeholder: the q4_0 format is being written (schema, quantizer, dequantizer)."""
from ..schema import FormatSpec

SPEC = FormatSpec(name="q4_0", id=4, banks=())
