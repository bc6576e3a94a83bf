"""Synthetic checkpoints in real formats and real shapes, random weights, streamed to disk.

    python -m moe_engine.tools.synth --kind gguf-q4_0 --out /work/models/qwen3moe-q4_0.gguf
    python -m moe_engine.tools.synth --kind fp8 --small --out /tmp/qwen3moe-fp8-small

Kinds (KINDS): GGUF files of the qwen3moe shape with routed experts Q4_0, Q8_0, Q4_K, Q5_K, Q6_K or by the Q4_K_M /
Q5_K_M rules (gguf_file.py); Hugging Face directories of the qwen3moe shape in bf16 or FP8 block, and of the gpt-oss
shape with MXFP4 experts (hf_dir.py). Shapes and their small variants: shapes.py; weights and encodings: weights.py; the
tokenizer every file carries: tokenizer.py; reading back: check.py.

Imports numpy, ml_dtypes, gguf and safetensors only (never torch), so it runs wherever the wheels are carried.
Thread contract: `write` and `check` are plain functions over their arguments; calls on different paths may run
in parallel, calls on one path may not."""
from __future__ import annotations

from ...layer_formats import use_more_bits
from . import check as _check
from . import gguf_file, hf_dir
from .shapes import ARCHS, Shape, get_shape

# kind -> (shape it is written for, writer, layout or expert types)
KINDS = {
    "gguf-q4_0": ("qwen3moe", "gguf", "q4_0"),
    "gguf-q8_0": ("qwen3moe", "gguf", "q8_0"),
    "gguf-q4_k_m": ("qwen3moe", "gguf", "q4_k_m"),
    "gguf-q5_k_m": ("qwen3moe", "gguf", "q5_k_m"),
    "gguf-q4_k": ("qwen3moe", "gguf", "q4_k"),
    "gguf-q5_k": ("qwen3moe", "gguf", "q5_k"),
    "gguf-q6_k": ("qwen3moe", "gguf", "q6_k"),
    "bf16": ("qwen3moe", "hf", "bf16"),
    "fp8": ("qwen3moe", "hf", "fp8"),
    "mxfp4": ("gpt-oss", "hf", "mxfp4"),
}

__all__ = ["ARCHS", "KINDS", "Shape", "check", "get_shape", "use_more_bits", "write"]


def _resolve(kind: str, small: bool, layers: int | None) -> tuple[Shape, str, str]:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {sorted(KINDS)}")
    arch, writer, what = KINDS[kind]
    return get_shape(arch, small, layers), writer, what


def write(kind: str, out, *, small: bool = False, layers: int | None = None, seed: int = 0,
          shard_bytes: int = 1 << 30, progress: bool = True, random_codes: bool = False) -> dict:
    """Write one checkpoint of `kind` at `out` (a .gguf file for gguf-*, else a directory). Returns
    {'path', 'bytes', 'seconds', 'tensors', 'kind', 'shape'} (+ 'shards' for directories)."""
    s, writer, what = _resolve(kind, small, layers)
    if writer == "gguf":
        r = gguf_file.write(out, s, what, seed=seed, progress=progress, random_codes=random_codes)
    else:
        r = hf_dir.write(out, s, what, seed=seed, shard_bytes=shard_bytes, progress=progress,
                         random_codes=random_codes)
    return {**r, "kind": kind, "shape": s}


def check(kind: str, out, *, small: bool = False, layers: int | None = None) -> dict:
    """Read `out` back (check.py) and compare it with what `write` declares for the same arguments."""
    s, writer, what = _resolve(kind, small, layers)
    return _check.check_gguf(out, s, what) if writer == "gguf" else _check.check_hf(out, s, what)
