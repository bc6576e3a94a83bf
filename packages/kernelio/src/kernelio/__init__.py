"""kernelio: GPU kernels that publish a decode step's inputs into the CPU
executor's IO block and combine its output back (protocol v1, docs/protocol.md).

One kernel source (kernels/kernelio.cu) built at package build time into a
fatbin (SASS per arch + compute_75 PTX), shipped as package data and loaded at
run time through a gpusync backend's C ABI (gpusync-cuda's dlopen'd driver):
kernelio itself links no GPU runtime and imports on any machine.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

__version__ = "0.1.0"
_HERE = Path(__file__).resolve().parent


def get_include() -> str:
    """Directory holding kernelio/params.h (the kernels' parameter structs)."""
    return str(_HERE / "include")


def fatbin_path() -> Path:
    """The CUDA image: $KERNELIO_FATBIN if set (tests load variants), else the packaged one."""
    p = os.environ.get("KERNELIO_FATBIN")
    return Path(p) if p else _HERE / "kernels" / "kernelio.fatbin"


def image() -> bytes:
    p = fatbin_path()
    if not p.is_file():
        raise FileNotFoundError(f"kernelio: no kernel image at {p} (the package was built without nvcc?)")
    return p.read_bytes()


def build_info() -> dict:
    """What the build made: {'sass': [...], 'ptx': [...], 'nvcc': ..., 'refused_by_nvcc': [...]}."""
    p = fatbin_path()
    meta = p.with_name(p.stem + ".json")
    return json.loads(meta.read_text()) if meta.is_file() else {}


_FATBIN_MAGIC = 0xBA55ED50


def fatbin_entries(data: bytes) -> list[tuple[str, str]]:
    """[('sass', 'sm_90'), ('ptx', 'compute_75'), ...] read from a fatbin's entry
    headers (the layout cuobjdump reads), without any CUDA tool."""
    magic, _ver, hsize, size = struct.unpack_from("<IHHQ", data, 0)
    if magic != _FATBIN_MAGIC:
        raise ValueError(f"not a fatbin (magic {magic:#x})")
    out, off = [], hsize
    while off < hsize + size:
        kind, _v, ehs, padded = struct.unpack_from("<HHIQ", data, off)
        arch = struct.unpack_from("<I", data, off + 28)[0]
        if kind == 1:
            out.append(("ptx", f"compute_{arch}"))
        elif kind == 2:
            out.append(("sass", f"sm_{arch}"))
        off += ehs + padded
    return out


def probe(backend, device, data: bytes | None = None, timeout_s: float = 10.0) -> str:
    """Self-test both kernels on scratch pinned memory through `backend` (a
    gpusync capsule) on `device` (the backend's Device, or its handle). '' means passed."""
    from . import _native

    try:
        return _native.probe(backend, device, image() if data is None else data, timeout_s)
    except Exception as e:  # noqa: BLE001 - a probe reports, it does not raise
        return f"kernelio probe failed: {e}"


def open_kernels(backend, device, io: dict, data: bytes | None = None):
    """Load the kernels for one IO block through `backend` on `device` (the
    backend's Device object, kept alive as long as the kernels). io: mapped
    device addresses x, ids, w, y, ready, done and the shapes H, K, max_tokens."""
    from . import _native

    return _native.KernelIO(backend, device, image() if data is None else data, io["x"], io["ids"], io["w"],
                            io["y"], io["ready"], io["done"], io["H"], io["K"], io["max_tokens"])


__all__ = ["build_info", "fatbin_entries", "fatbin_path", "get_include", "image", "open_kernels", "probe"]
