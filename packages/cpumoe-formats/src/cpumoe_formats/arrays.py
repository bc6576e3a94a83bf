"""Array helpers other packages build on (the executor's argument checks, the glue's banks): numpy arrays or
anything with the array interface / DLPack (torch tensors) as checked numpy views, 64-byte-aligned buffers, and a
layer's experts repacked on several threads. Thread contract: plain functions, safe from any thread."""
from __future__ import annotations

from ._arrays import aligned_copy, aligned_empty, as_array, as_input, check_array, describe, split_experts, usable_cpus

__all__ = ["aligned_copy", "aligned_empty", "as_array", "as_input", "check_array", "describe", "split_experts",
           "usable_cpus"]
