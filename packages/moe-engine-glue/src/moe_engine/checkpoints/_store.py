"""Read tensors by name from a safetensors checkpoint: one file, or a directory (its model.safetensors.index.json,
else every *.safetensors in it). Tensors are read one at a time (memory-mapped), as torch tensors on the CPU."""
from __future__ import annotations

import json
import os
from pathlib import Path


class SafetensorsStore:
    def __init__(self, path):
        from safetensors import safe_open

        self._open = safe_open
        p = Path(os.fspath(path))
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.is_file():
                wm = json.loads(index.read_text())["weight_map"]
                self._where = {k: p / f for k, f in wm.items()}
            else:
                files = sorted(p.glob("*.safetensors"))
                if not files:
                    raise FileNotFoundError(f"{p}: no *.safetensors files (and no model.safetensors.index.json)")
                self._where = {}
                for f in files:
                    with safe_open(str(f), framework="pt") as h:
                        self._where.update({k: f for k in h.keys()})
        elif p.is_file():
            with safe_open(str(p), framework="pt") as h:
                self._where = {k: p for k in h.keys()}
        else:
            raise FileNotFoundError(f"checkpoint {p}: no such file or directory")
        self.path = p
        self._handles: dict[Path, object] = {}

    def keys(self):
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str):
        """The tensor `name` (torch, CPU, the checkpoint's dtype)."""
        f = self._where.get(name)
        if f is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
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
