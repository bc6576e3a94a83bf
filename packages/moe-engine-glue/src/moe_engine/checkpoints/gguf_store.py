"""Read tensors by name from a GGUF file (llama.cpp), memory-mapped through the `gguf` package's reader.

The store first walks the file's header itself (magic, version, key/values, tensor infos: the GGUF specification,
not the reader's internals) with every read bounds-checked, so a truncated file is refused naming what is cut: the
header, or the first tensor whose bytes run past the end, with the bytes it needs against the file's size. (gguf's
reader would fail with "cannot reshape array of size 9215 into shape (4,64,36)".) get_rows() checks a tensor's GGML
type and dims against what the loader expects before its bytes are viewed (validation.py)."""
from __future__ import annotations

import mmap
import os
import struct

from .validation import CheckpointError, expect

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # GGUF's, unless general.alignment says otherwise
# GGUF metadata value types -> struct code (8 = string, 9 = array, handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Cursor:
    def __init__(self, buf, size: int, path: str, order: str = "<"):
        self.buf, self.size, self.path, self.order, self.at = buf, size, path, order, 0
        self.part = "the header"

    def take(self, code: str):
        n = struct.calcsize(code)
        if self.at + n > self.size:
            raise CheckpointError(f"{self.path}: truncated inside {self.part}: it needs bytes [{self.at}, "
                                  f"{self.at + n}), the file has {self.size} bytes")
        (v,) = struct.unpack_from(self.order + code, self.buf, self.at)
        self.at += n
        return v

    def string(self) -> bytes:
        n = self.take("Q")
        if self.at + n > self.size:
            raise CheckpointError(f"{self.path}: truncated inside {self.part}: a {n}-byte string needs bytes "
                                  f"[{self.at}, {self.at + n}), the file has {self.size} bytes")
        s = bytes(self.buf[self.at:self.at + n])
        self.at += n
        return s

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = self.take("I"), self.take("Q")
            if itype in _SCALAR:  # a numeric array: skipped in one step
                n = struct.calcsize(_SCALAR[itype]) * count
                if self.at + n > self.size:
                    raise CheckpointError(f"{self.path}: truncated inside {self.part}: an array of {count} needs "
                                          f"bytes [{self.at}, {self.at + n}), the file has {self.size} bytes")
                self.at += n
                return None
            for _ in range(count):
                self.value(itype)
            return None
        if vtype not in _SCALAR:
            raise CheckpointError(f"{self.path}: {self.part}: unknown GGUF value type {vtype} at byte {self.at}")
        return self.take(_SCALAR[vtype])


def scan_header(path: str) -> dict:
    """{tensor name: (GGML type name, dims (ggml order), absolute byte offset, byte size)}, checked against the file
    size. Raises CheckpointError naming the file and the part or tensor on a truncated or malformed file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = os.path.getsize(path)
    if size < 8:
        raise CheckpointError(f"{path}: truncated: {size} bytes, shorter than GGUF's magic and version (8 bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {MAGIC!r})")
        c = _Cursor(buf, size, path)
        c.at = 4
        version = c.take("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            c.order, c.at = ">", 4
            version = c.take("I")
        c.part = "the header (tensor and key/value counts)"
        n_tensors, n_kv = c.take("Q"), c.take("Q")
        alignment = DEFAULT_ALIGNMENT
        for i in range(n_kv):
            c.part = f"key/value {i} of {n_kv} (metadata)"
            key = c.string()
            vtype = c.take("I")
            v = c.value(vtype)
            if key == b"general.alignment" and isinstance(v, int):
                alignment = v
        infos = []
        for i in range(n_tensors):
            c.part = f"tensor info {i} of {n_tensors}"
            name = c.string().decode("utf-8", "replace")
            c.part = f"tensor info {i} of {n_tensors} ({name!r})"
            dims = tuple(c.take("Q") for _ in range(c.take("I")))
            ttype, offset = c.take("I"), c.take("Q")
            infos.append((name, dims, ttype, offset))
    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: general.alignment={alignment}, expected a power of two")
    start = -(-c.at // alignment) * alignment
    out = {}
    for name, dims, ttype, offset in infos:
        try:
            qt = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise CheckpointError(f"{path}: tensor {name!r}: unknown GGML type id {ttype}") from None
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * type_size
        out[name] = (qt.name, dims, start + offset, nbytes)
    over = [(v[2], k) for k, v in out.items() if v[2] + v[3] > size]
    if over:
        b, name = min(over)
        need = out[name][3]
        raise CheckpointError(f"{path}: truncated: tensor {name!r} needs bytes [{b}, {b + need}) ({need} bytes), the "
                              f"file has {size} bytes ({max(0, size - b)} of them)")
    return out


class GgufStore:
    """One GGUF file's tensors and metadata. Thread contract: one thread at a time."""

    def __init__(self, path):
        from gguf import GGUFReader

        self.path = os.fspath(path)
        self.info = scan_header(self.path)  # before the reader, which assumes a whole file
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, IndexError, KeyError) as e:
            raise CheckpointError(f"{self.path}: gguf cannot read this file: {type(e).__name__}: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def keys(self):
        return self.tensors.keys()

    def field(self, name: str):
        f = self.reader.fields.get(name)
        return None if f is None else f.contents()

    def moe_layers(self) -> list[int]:
        """The block indices that hold routed-expert tensors (naming.GGUF)."""
        from .naming import GGUF

        pre, post = GGUF[0].split("{n}")
        return sorted(int(k[len(pre):-len(post)]) for k in self.tensors if k.startswith(pre) and k.endswith(post))

    def get_rows(self, name: str, types, dims, what: str = "", hint: str = ""):
        """The tensor's data as the reader maps it (quantized types: bytes [.., rows, row bytes]), after its GGML type
        is checked to be one of `types` (names, e.g. ("Q4_0",)) and its dims (ggml order: row length first) to be
        `dims`."""
        info = self.info.get(name)
        if info is None or name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        expect(self.path, name, what or "expert tensor", info[0], info[1], types, dims, hint)
        return self.tensors[name].data

    def close(self) -> None:
        self.reader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
