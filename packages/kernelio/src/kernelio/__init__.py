"""kernelio: GPU kernels that publish a decode step's inputs into the CPU
executor's IO block and combine its output back (protocol v1, docs/protocol.md).

One kernel source (kernels/kernelio.cu) built at package build time into two
images, shipped as package data: a CUDA fatbin (SASS per arch + compute_75
PTX) and, when a HIP toolchain was present, a HIP code-object bundle (one code
object per AMD target). Both are loaded at run time through a gpusync
backend's C ABI; the backend (gpusync_cuda or gpusync_hip capsule) decides
which image: kernelio itself links no GPU runtime and imports on any machine.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

__version__ = "0.2.2"
_HERE = Path(__file__).resolve().parent


def get_include() -> str:
    """Directory holding kernelio/params.h (the kernels' parameter structs)."""
    return str(_HERE / "include")


# backend -> (environment override, packaged image); metadata: kernelio.json, kernelio.hipfb.json
_IMAGES = {"cuda": ("KERNELIO_FATBIN", "kernelio.fatbin"), "hip": ("KERNELIO_HIP_IMAGE", "kernelio.hipfb")}
BACKENDS = tuple(_IMAGES)
_REBUILD = {"cuda": "the package was built without nvcc (KERNELIO_SKIP_FATBIN=1?)",
            "hip": "the package was built without a HIP toolchain; rebuild it with hipcc present and KERNELIO_HIP=1 "
                   "(Debian/Ubuntu: apt-get install hipcc libamdhip64-dev)"}


def backend_of(capsule) -> str:
    """'cuda' or 'hip': the image a gpusync backend capsule loads (from the capsule's name)."""
    from . import _native

    return _native.capsule_backend(capsule)


def _kind(backend) -> str:
    if isinstance(backend, str):
        if backend not in _IMAGES:
            raise ValueError(f"backend={backend!r}; expected one of {list(_IMAGES)} or a gpusync capsule")
        return backend
    return backend_of(backend)


def image_path(backend="cuda") -> Path:
    """The image for `backend` ('cuda', 'hip' or a gpusync capsule): $KERNELIO_FATBIN /
    $KERNELIO_HIP_IMAGE if set (tests load variants), else the packaged one."""
    var, name = _IMAGES[_kind(backend)]
    p = os.environ.get(var)
    return Path(p) if p else _HERE / "kernels" / name


def fatbin_path() -> Path:
    """The CUDA image (image_path('cuda'))."""
    return image_path("cuda")


def image(backend="cuda") -> bytes:
    """The kernel image for `backend`; FileNotFoundError saying how to get one when this build has none."""
    kind = _kind(backend)
    p = image_path(kind)
    if not p.is_file():
        raise FileNotFoundError(f"kernelio: no {kind.upper()} kernel image at {p} ({_REBUILD[kind]})")
    return p.read_bytes()


def build_info(backend="cuda") -> dict:
    """What the build made. cuda: {'sass', 'ptx', 'nvcc', 'refused_by_nvcc'};
    hip: {'targets', 'tried', 'hipcc', 'refused_by_hipcc'}. {} when there is no image."""
    kind = _kind(backend)
    p = image_path(kind)
    meta = p.with_name(p.stem + ".json") if kind == "cuda" else Path(str(p) + ".json")
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


_BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"
_EM_CUDA, _EM_AMDGPU = 190, 224


def hip_bundle_targets(data: bytes) -> list[str]:
    """['gfx90a', 'gfx1030', ...] read from a clang offload bundle's entry table
    (the layout `clang-offload-bundler --list` reads), without any ROCm tool.
    Entries are 'hipv4-amdgcn-amd-amdhsa--<target>'; the host entry is skipped."""
    if data[:24] != _BUNDLE_MAGIC:
        raise ValueError("not a clang offload bundle (magic __CLANG_OFFLOAD_BUNDLE__ absent)")
    (n,) = struct.unpack_from("<Q", data, 24)
    out, off = [], 32
    for _ in range(n):
        _offset, _size, tlen = struct.unpack_from("<QQQ", data, off)
        triple = data[off + 24:off + 24 + tlen].decode()
        off += 24 + tlen
        if "amdgcn" in triple:
            out.append(triple.rsplit("--", 1)[-1] if "--" in triple else triple)
    return out


def image_kind(data: bytes) -> str | None:
    """'cuda' (fatbin, cubin), 'hip' (offload bundle, AMDGPU code object) or None (e.g. PTX text)."""
    if len(data) >= 4 and struct.unpack_from("<I", data, 0)[0] == _FATBIN_MAGIC:
        return "cuda"
    if data[:24] == _BUNDLE_MAGIC:
        return "hip"
    if data[:4] == b"\x7fELF" and len(data) >= 20:
        return {_EM_CUDA: "cuda", _EM_AMDGPU: "hip"}.get(struct.unpack_from("<H", data, 18)[0])
    return None


def _image_for(backend, data: bytes | None) -> bytes:
    """The image `backend` (a capsule) loads: `data`, or the packaged one for its kind. A CUDA image
    given to a HIP backend (or the reverse) is refused by name instead of failing inside module_load."""
    kind = backend_of(backend)
    if data is None:
        return image(kind)
    other = image_kind(data)
    if other is not None and other != kind:
        raise ValueError(f"kernelio: a {other.upper()} kernel image was given to the {kind} backend "
                         f"(pass data=None to use the packaged {_IMAGES[kind][1]})")
    return data


def probe(backend, device, data: bytes | None = None, timeout_s: float = 10.0, wait: bool = False) -> str:
    """Self-test both kernels on scratch pinned memory through `backend` (a
    gpusync capsule: its kind picks the image) on `device` (the backend's Device,
    or its handle). wait=True also tests combine's in-kernel wait. '' means
    passed; otherwise why not (a missing image for this backend included): the
    caller falls back to the copy path."""
    from . import _native

    try:
        return _native.probe(backend, device, _image_for(backend, data), timeout_s, wait)
    except Exception as e:  # noqa: BLE001 - a probe reports, it does not raise
        return f"kernelio probe failed: {e}"


WAITS = ("poll", "memop")


def wait_override() -> str | None:
    """$KERNELIO_WAIT ('poll' or 'memop') when set: forces how combine's caller waits for done."""
    v = os.environ.get("KERNELIO_WAIT", "").strip()
    if v and v not in WAITS:
        raise ValueError(f"KERNELIO_WAIT={v!r}; expected one of {list(WAITS)} (or unset: chosen by the probe)")
    return v or None


def probe_wait(backend, device, data: bytes | None = None, timeout_s: float = 10.0) -> tuple[str | None, str]:
    """The start-up probe and the choice of wait it implies: (wait, report).
    wait 'poll': combine(wait=True) waits in the kernel (its stages passed too);
    'memop': the caller waits with a stream memop before combine(wait=False);
    None: the kernels failed (report says why). KERNELIO_WAIT forces one variant:
    only that one is probed."""
    forced = wait_override()
    msg = probe(backend, device, data, timeout_s, wait=forced != "memop")
    if not msg:
        return forced or "poll", f"KERNELIO_WAIT={forced}" if forced else "in-kernel wait probed"
    if forced:
        return None, msg
    plain = probe(backend, device, data, timeout_s, wait=False)  # did only the in-kernel wait fail?
    return (None, plain) if plain else ("memop", f"in-kernel wait failed its probe ({msg})")


def open_kernels(backend, device, io: dict, data: bytes | None = None):
    """Load the kernels for one IO block through `backend` (a gpusync capsule; the
    fatbin for gpusync_cuda, the HIP bundle for gpusync_hip) on `device` (the
    backend's Device object, kept alive as long as the kernels). io: mapped
    device addresses x, ids, w, y, ready, done and the shapes H, K, max_tokens.
    FileNotFoundError when this build has no image for the backend."""
    from . import _native

    return _native.KernelIO(backend, device, _image_for(backend, data), io["x"], io["ids"], io["w"], io["y"],
                            io["ready"], io["done"], io["H"], io["K"], io["max_tokens"])


__all__ = ["BACKENDS", "backend_of", "build_info", "fatbin_entries", "fatbin_path", "get_include", "hip_bundle_targets",
           "image", "image_kind", "image_path", "open_kernels", "probe", "probe_wait", "wait_override", "WAITS"]
