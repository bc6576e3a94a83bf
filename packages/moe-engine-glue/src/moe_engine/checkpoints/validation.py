"""What a checkpoint tensor must be before its bytes are reinterpreted, and the scans that refuse non-finite scales.

Every loader states, per tensor, the dtypes it accepts (safetensors' names: "F8_E4M3", "F32", ...; GGUF's type
names) and the shape its layer's (E, H, I) implies; the stores (safetensors_store.py, gguf_store.py) check the file's
own header against them before any view or copy, so an FP8 checkpoint stored as e5m2 or int8 is refused instead of
read as e4m3 codes. Every refusal is a CheckpointError naming the file, the tensor, the layer (and expert) and what
was expected.

Scales are small next to the weights they scale (an FP8 128x128 block has one 4-byte scale, an NVFP4 16-element
block one byte, MXFP4 32 elements one byte); each loader scans them with one vectorised test per tensor and refuses
NaN / Inf unless the caller passed allow_nonfinite=True (a NaN scale makes every weight of its block NaN, so every
token routed to that expert comes out NaN). GGUF Q4_0 keeps its fp16 scale d inside each 18-byte block; its scan
reads the exponent byte of each d right after the block is copied into the bank, while it is in cache."""
from __future__ import annotations

import numpy as np

# safetensors dtype name -> (bytes per element, torch dtype attribute)
DTYPES = {"BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"), "F8_E4M3": (1, "float8_e4m3fn"),
          "F8_E5M2": (1, "float8_e5m2"), "F8_E8M0": (1, "float8_e8m0fnu"), "I16": (2, "int16"), "U16": (2, "uint16"),
          "F16": (2, "float16"), "BF16": (2, "bfloat16"), "I32": (4, "int32"), "U32": (4, "uint32"),
          "F32": (4, "float32"), "I64": (8, "int64"), "U64": (8, "uint64"), "F64": (8, "float64")}
_OF_TORCH = {attr: name for name, (_, attr) in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint tensor that is missing its bytes, has the wrong dtype or shape, or holds non-finite scales.
    The message names the file, the tensor, the layer / expert and what was expected."""


def dtype_name(t) -> str:
    """The safetensors name of a torch tensor's dtype (e.g. 'F8_E4M3'), for tensors handed over in memory."""
    name = str(t.dtype).removeprefix("torch.")
    return _OF_TORCH.get(name, name)


def _fmt_shape(s) -> str:
    return "(" + ", ".join(str(int(d)) for d in s) + ("," if len(s) == 1 else "") + ")"


def expect(where: str, name: str, what: str, dtype: str, shape, dtypes, want, hint: str = "") -> None:
    """Raise CheckpointError unless `dtype` is one of `dtypes` and `shape` equals `want` (a tuple, or a tuple of
    acceptable tuples). where: the file (or module); what: the layer / expert and role of the tensor; hint: what to
    do about a wrong dtype."""
    if dtypes is not None and dtype not in dtypes:
        raise CheckpointError(f"{where}: tensor {name!r} ({what}): dtype {dtype}, expected {' or '.join(dtypes)}"
                              f"{hint or '; its bytes are not reinterpreted as another type'}")
    if want is None:
        return
    shape = tuple(int(d) for d in shape)
    options = want if want and isinstance(want[0], tuple) else (want,)
    if shape not in {tuple(o) for o in options}:
        raise CheckpointError(f"{where}: tensor {name!r} ({what}): shape {_fmt_shape(shape)}, expected "
                              f"{' or '.join(_fmt_shape(o) for o in options)}")


def check_tensor(t, where: str, name: str, what: str, dtypes, want) -> None:
    """expect() for a torch tensor already in memory (e.g. a transformers module's parameter)."""
    expect(where, name, what, dtype_name(t), tuple(t.shape), dtypes, want)


# ---- non-finite scales ---------------------------------------------------------------------------------------------
def bad_float(a) -> np.ndarray:
    """Non-finite entries of float scales (a torch tensor of f32 / bf16 / f16 / e8m0, or a numpy float array)."""
    if hasattr(a, "detach"):
        import torch

        t = a.detach().to("cpu")
        return (~torch.isfinite(t.float())).numpy()
    return ~np.isfinite(np.asarray(a, np.float32))


def bad_e4m3(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn's NaN codes (S.1111.111; the format has no Inf)."""
    return (codes & 0x7F) == 0x7F


def bad_e8m0(codes: np.ndarray) -> np.ndarray:
    """e8m0's NaN code 0xFF (MXFP4 block exponents)."""
    return codes == 0xFF


def bad_q4_0_d(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 rows of 18-byte blocks [.., n * 18] uint8: per block, whether its little-endian fp16 d is NaN / Inf
    (exponent bits all ones: bits 2-6 of the block's second byte)."""
    b = blocks.reshape(-1, 18)
    return (b[:, 1] & 0x7C) == 0x7C


def refuse_nonfinite(bad: np.ndarray, where: str, name: str, what: str, allow: bool, kind: str = "scales") -> int:
    """Raise CheckpointError if any of `bad` is set (unless allow); returns how many were set. kind: "scales" or
    "biases"."""
    n = int(np.count_nonzero(bad))
    if n and not allow:
        first = np.unravel_index(int(np.flatnonzero(bad.reshape(-1))[0]), bad.shape)
        harm = "every weight they scale" if kind == "scales" else "every output they are added to"
        raise CheckpointError(f"{where}: tensor {name!r} ({what}): {n} of {bad.size} {kind} are NaN or Inf (first "
                              f"at index {tuple(int(i) for i in first)}); {harm} would be NaN/Inf. Pass "
                              "allow_nonfinite=True to load them anyway")
    return n


__all__ = ["CheckpointError", "DTYPES", "bad_e4m3", "bad_e8m0", "bad_float", "bad_q4_0_d", "check_tensor",
           "dtype_name", "expect", "refuse_nonfinite"]
