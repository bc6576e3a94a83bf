"""Read tensors by name from a safetensors checkpoint: one file, or a directory (its model.safetensors.index.json,
else every *.safetensors in it). Tensors are read one at a time (memory-mapped), as torch tensors on the CPU.

Each file's header (an 8-byte length, then JSON: per tensor its dtype, shape and byte range) is read and checked when
the store opens: a file shorter than its header says is refused naming the first tensor whose bytes are missing and
how many bytes it expected against how many the file has; a header whose byte ranges disagree with its dtypes and
shapes, or that is not JSON, is refused too. get() checks a tensor's dtype and shape against what the loader expects
from the header alone, before any byte is read (validation.py)."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from .validation import DTYPES, CheckpointError, expect

MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def read_header(path: Path) -> dict:
    """{tensor name: (dtype, shape, (begin, end) absolute byte offsets)} of one safetensors file, checked against the
    file's size. Raises CheckpointError naming the file (and the tensor) on a truncated or inconsistent file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header length "
                                  "(a safetensors file starts with one)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise CheckpointError(f"{path}: not a safetensors file: its header length reads {n} bytes (at most "
                                  f"{MAX_HEADER})")
        if size < 8 + n:
            raise CheckpointError(f"{path}: truncated inside its header: the header needs bytes [8, {8 + n}), the "
                                  f"file has {size} bytes")
        raw = f.read(n)
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    out, start, end_max = {}, 8 + n, 0
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r}: header entry {info!r} lacks dtype / shape / "
                                  "data_offsets") from None
        if dtype in DTYPES:
            count = 1
            for d in shape:
                count *= d
            if e - b != count * DTYPES[dtype][0] or b < 0:
                raise CheckpointError(f"{path}: tensor {name!r}: the header gives {dtype} {list(shape)} "
                                      f"({count * DTYPES[dtype][0]} bytes) but the byte range [{b}, {e}) "
                                      f"({e - b} bytes)")
        out[name] = (dtype, shape, (start + b, start + e))
        end_max = max(end_max, start + e)
    if size < end_max:
        short = min((r for r in out.items() if r[1][2][1] > size), key=lambda r: r[1][2][0])
        name, (_, _, (b, e)) = short
        raise CheckpointError(f"{path}: truncated: tensor {name!r} needs bytes [{b}, {e}) ({e - b} bytes), the file "
                              f"has {size} bytes ({max(0, size - b)} of them); {end_max - size} bytes are missing in "
                              "all")
    if size > end_max:
        raise CheckpointError(f"{path}: {size - end_max} bytes after the last tensor's (the header covers {end_max} "
                              f"of {size} bytes): not a safetensors file as written")
    return out


class SafetensorsStore:
    """Tensors of one checkpoint by name. Thread contract: one thread at a time (the open file handles are shared)."""

    def __init__(self, path):
        from safetensors import safe_open

        self._open = safe_open
        p = Path(os.fspath(path))
        self._meta: dict[str, tuple] = {}  # name -> (file, dtype, shape)
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.is_file():
                try:
                    wm = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError) as e:
                    raise CheckpointError(f"{index}: not a safetensors index (no 'weight_map': {e})") from None
                headers = {f: read_header(p / f) for f in sorted(set(wm.values()))}
                for k, f in wm.items():
                    if k not in headers[f]:
                        raise CheckpointError(f"{index}: tensor {k!r} is mapped to {f}, whose header lacks it")
                    self._meta[k] = (p / f, *headers[f][k][:2])
            else:
                files = sorted(p.glob("*.safetensors"))
                if not files:
                    raise FileNotFoundError(f"{p}: no *.safetensors files (and no model.safetensors.index.json)")
                for f in files:
                    self._meta.update({k: (f, *v[:2]) for k, v in read_header(f).items()})
        elif p.is_file():
            self._meta = {k: (p, *v[:2]) for k, v in read_header(p).items()}
        else:
            raise FileNotFoundError(f"checkpoint {p}: no such file or directory")
        self.path = p
        self._handles: dict[Path, object] = {}

    def keys(self):
        return self._meta.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def meta(self, name: str) -> tuple:
        """(file, dtype, shape) of `name` from its file's header (no bytes read)."""
        m = self._meta.get(name)
        if m is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return m

    def get(self, name: str, dtypes=None, shape=None, what: str = ""):
        """The tensor `name` (torch, CPU, the checkpoint's dtype), after its header's dtype is checked to be one of
        `dtypes` (safetensors names, e.g. ("F8_E4M3",)) and its shape to be `shape` (or one of a tuple of shapes).
        what: the layer / expert and role, for the error."""
        f, dtype, shp = self.meta(name)
        expect(str(f), name, what or "expert tensor", dtype, shp, dtypes, shape)
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = self._open(str(f), framework="pt").__enter__()
        return h.get_tensor(name)

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
