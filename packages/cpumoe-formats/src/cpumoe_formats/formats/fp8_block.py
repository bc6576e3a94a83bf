"""Placeholder: the fp8_block format is being written (schema, quantizer, dequantizer)."""
from ..schema import FormatSpec

SPEC = FormatSpec(name="fp8_block", id=5, banks=())
