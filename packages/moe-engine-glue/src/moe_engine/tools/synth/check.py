"""Read a written checkpoint back with the readers its users have (gguf's GGUFReader, safetensors' safe_open) and
check it against what the writer declared: every tensor's name, type and shape, and the first and last layers'
expert values finite at the magnitude written (std within 0.5x-2x of 0.02)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import gguf_file, hf_dir, weights
from .shapes import Shape


def _magnitude(name: str, x: np.ndarray) -> float:
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: non-finite values")
    sd = float(np.std(x, dtype=np.float64))
    if not 0.5 * weights.STD <= sd <= 2 * weights.STD:
        raise ValueError(f"{name}: std {sd:.4g}, expected ~{weights.STD}")
    return sd


def check_gguf(path, s: Shape, experts: str) -> dict:
    """{'tensors': count, 'types': {type name: count}, 'expert_std': {tensor: std}}; raises ValueError on a
    mismatch."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(str(path))
    got = {t.name: t for t in r.tensors}
    want = gguf_file.plan(s, experts, seed=0)
    if [n for n, *_ in want] != [t.name for t in r.tensors]:
        raise ValueError(f"{path}: tensor names differ from the plan ({len(got)} read, {len(want)} planned)")
    types: dict[str, int] = {}
    for name, shape, qtype, _ in want:
        t = got[name]
        if t.tensor_type != qtype or tuple(t.data.shape) != tuple(shape):
            raise ValueError(f"{name}: read {t.tensor_type.name} {tuple(t.data.shape)}, wrote {qtype.name} {shape}")
        types[qtype.name] = types.get(qtype.name, 0) + 1
    std = {}
    for n in sorted({0, s.layers - 1}):
        for proj in ("gate", "down"):
            t = got[f"blk.{n}.ffn_{proj}_exps.weight"]
            std[t.name] = _magnitude(t.name, dequantize(np.asarray(t.data[:2]), t.tensor_type))
    return {"tensors": len(got), "types": types, "expert_std": std}


_ST_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F32": "float32", "U8": "uint8"}


def _raw(path: Path, name: str) -> np.ndarray:
    """A tensor of a safetensors file read from its header's offsets (safetensors' numpy reader has no fp8)."""
    import ml_dtypes

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(n))[name]
    dt = np.dtype(getattr(ml_dtypes, _ST_DTYPES[info["dtype"]], None) or _ST_DTYPES[info["dtype"]])
    a, b = info["data_offsets"]
    return np.fromfile(path, np.uint8, count=b - a, offset=8 + n + a).view(dt).reshape(info["shape"])


def check_hf(out_dir, s: Shape, layout: str) -> dict:
    """{'tensors': count, 'dtypes': {dtype: count}, 'expert_std': {tensor: std}}; raises ValueError on a mismatch."""
    from safetensors import safe_open

    out_dir = Path(out_dir)
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    want = {name: (dt, tuple(shape)) for _, decl, _ in hf_dir._items(s, layout, 0) for name, dt, shape in decl}
    if set(index) != set(want):
        raise ValueError(f"{out_dir}: index names differ from the plan (e.g. {sorted(set(index) ^ set(want))[:3]})")
    dtypes: dict[str, int] = {}
    by_file: dict[str, list[str]] = {}
    for k, f in index.items():
        by_file.setdefault(f, []).append(k)
    layers = sorted({0, s.layers - 1})
    if s.arch == "gpt-oss":
        probe = [f"model.layers.{n}.mlp.experts.down_proj" for n in layers]
    else:
        probe = [f"model.layers.{n}.mlp.experts.0.down_proj.weight" for n in layers]
    std = {}
    for f, names in by_file.items():
        with safe_open(str(out_dir / f), framework="numpy") as h:
            for k in names:
                sl = h.get_slice(k)
                dt, shape = want[k]
                if tuple(sl.get_shape()) != shape:
                    raise ValueError(f"{k}: read shape {tuple(sl.get_shape())}, wrote {shape}")
                dtypes[sl.get_dtype()] = dtypes.get(sl.get_dtype(), 0) + 1
            for p in probe:
                if p + "_blocks" in names:  # mxfp4: decode expert 0 with the E2M1 table and e8m0 scales
                    b = _raw(out_dir / f, p + "_blocks")[0]
                    sc = _raw(out_dir / f, p + "_scales")[0].astype(np.int32)
                    codes = np.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], 32)
                    lut = np.concatenate([weights.E2M1, -weights.E2M1])
                    std[p] = _magnitude(p, lut[codes] * np.exp2(sc - 127.0)[..., None])
                elif p in names:
                    w = _raw(out_dir / f, p).astype(np.float32)
                    if layout == "fp8":
                        inv = _raw(out_dir / f, p + "_scale_inv")
                        w = w * np.repeat(np.repeat(inv, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
                    std[p] = _magnitude(p, w)
    return {"tensors": len(index), "dtypes": dtypes, "expert_std": std}
