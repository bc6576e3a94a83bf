"""Corrupted checkpoints of every layout in moe_engine.checkpoints.LAYOUTS (a new layout fails
test_every_layout_is_covered until it has a writer and its scale tensors are named here): truncation at five
offsets, every expert tensor of a layer retyped to each other dtype of its width (the bytes unchanged: what a
loader that views before it checks would read as its own codes), each of its dimensions one larger, NaN / Inf in each
kind of scale. Each is refused with a CheckpointError naming the file, the tensor (and layer) and what was expected;
a truncated file already when the store opens, before any bank is allocated. allow_nonfinite=True loads poisoned
scales and counts them.

The checkpoints are the tiny ones of checkpoint_writers.py (E=8, H=I=128, 2 layers), written once per layout."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors")
pytest.importorskip("gguf")

import checkpoint_writers as cw  # noqa: E402
import hf_models as hm  # noqa: E402

from moe_engine import checkpoints  # noqa: E402
from moe_engine.checkpoints import CheckpointError  # noqa: E402
from moe_engine.checkpoints.validation import DTYPES  # noqa: E402

LAYOUTS = checkpoints.LAYOUTS
# each layout's scale tensors (by name suffix) and their encoding; mxfp4's biases are scanned the same way
SCALES = {"fp8_block": {".weight_scale_inv": "F32"}, "mxfp4": {"_scales": "E8M0", "_bias": "BF16"},
          "nvfp4": {".weight_scale": "E4M3", ".weight_scale_2": "F32"}, "gguf_q4_0": {"_exps.weight": "Q4_0 d"}}
# the bytes of a NaN and an Inf in each encoding (little-endian); e4m3fn and e8m0 have no Inf
CODES = {"F32": {"nan": b"\x00\x00\xc0\x7f", "inf": b"\x00\x00\x80\x7f"},
         "BF16": {"nan": b"\xc0\x7f", "inf": b"\x80\x7f"}, "E4M3": {"nan": b"\x7f"}, "E8M0": {"nan": b"\xff"},
         "Q4_0 d": {"nan": b"\x00\x7e", "inf": b"\x00\x7c"}}
# same-width dtypes a wrong checkpoint may hold (safetensors names)
BY_WIDTH = {1: ("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8"), 2: ("BF16", "F16", "I16"), 4: ("F32", "I32")}
GGUF_WRONG = ("Q8_0", "F16")
CUTS = ("header", "metadata", "tensor", "half", "last byte")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """layout -> the path of its clean checkpoint (written on first use)."""
    cache = {}

    def get(layout):
        if layout not in cache:
            d = tmp_path_factory.mktemp(layout)
            cache[layout] = cw.write_layout(layout, hm.build(cw.ARCH_OF[layout]), d)
        return cache[layout]
    return get


def _load(path, layout, **kw):
    return checkpoints.load_experts(path, [0, 1], E=hm.E, H=hm.H, I=hm.I, layout=layout,
                                    model_type="gpt_oss" if layout == "mxfp4" else None, **kw)


def _refused(path, layout, *patterns):
    with pytest.raises(CheckpointError) as e:
        _load(path, layout)
    msg = str(e.value)
    for p in (str(path),) + patterns:
        assert p in msg, (p, msg)
    return msg


def _suffix(name: str, table: dict) -> str:
    hits = [s for s in table if name.endswith(s)]
    assert hits, (name, list(table))
    return max(hits, key=len)


def test_every_layout_is_covered():
    assert set(cw.ARCH_OF) == set(LAYOUTS) == set(SCALES) == set(checkpoints.MODULE_OF)
    assert all(checkpoints.MODULE_OF[lay].DTYPES for lay in LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clean_checkpoint_loads(clean, layout):
    got = _load(clean(layout), layout)
    assert [r["nonfinite_scales"] for r in got.report.values()] == [0, 0]


# ---- truncation ----------------------------------------------------------------------------------------------------
def _cut(path, layout: str, where: str) -> int:
    size = path.stat().st_size
    if layout == "gguf_q4_0":
        idx = cw.gguf_index(path)
        first = min(idx[n][2] for n in cw.expert_tensors(path, layout))
        info = idx[cw.expert_tensors(path, layout)[0]][4]
        return {"header": 6, "metadata": info + 5, "tensor": first + 37, "half": size // 2,
                "last byte": size - 1}[where]
    n, idx = cw.safetensors_index(path)
    b, e = min(idx[k][2:] for k in cw.expert_tensors(path, layout))
    return {"header": 4, "metadata": 8 + n // 2, "tensor": (b + e) // 2, "half": size // 2,
            "last byte": size - 1}[where]


@pytest.mark.parametrize("where", CUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_truncated_file_is_refused_when_opened(clean, tmp_path, layout, where):
    src = clean(layout)
    path = cw.truncated(src, tmp_path / src.name, _cut(src, layout, where))
    with pytest.raises(CheckpointError) as e:
        checkpoints.open_store(path)  # the store refuses it: no tensor read, no bank allocated
    msg = str(e.value)
    assert str(path) in msg and "truncated" in msg, msg
    if where in ("tensor", "last byte"):  # the bytes of a named tensor are missing: which, how many
        assert re.search(r"tensor '[^']+' needs bytes \[\d+, \d+\) \(\d+ bytes\), the file has \d+ bytes", msg), msg
    _refused(path, layout, "truncated")


# ---- dtypes --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_wrong_dtype_is_refused_before_any_view(clean, tmp_path, layout):
    src = clean(layout)
    allowed = checkpoints.MODULE_OF[layout].DTYPES
    names = cw.expert_tensors(src, layout)
    assert names
    cases = 0
    for name in names:
        ok = allowed[_suffix(name, allowed)]
        if layout == "gguf_q4_0":
            import gguf

            q = np.array(next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == name).data)
            values = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_0)
            for wrong in GGUF_WRONG:
                ty = gguf.GGMLQuantizationType[wrong]
                data = values.astype(np.float16) if wrong == "F16" else gguf.quants.quantize(values, ty)
                path = cw.rewrite_gguf(src, tmp_path / f"{wrong}.gguf", name, data, ty)
                _refused(path, layout, repr(name), f"dtype {wrong}, expected Q4_0", f"layer {cw.LAYER}")
                cases += 1
            continue
        dtype = cw.safetensors_index(src)[1][name][0]
        for wrong in BY_WIDTH[DTYPES[dtype][0]]:
            if wrong in ok:
                continue
            path = tmp_path / f"{wrong}.safetensors"
            cw.resave_safetensors(src, path, name, lambda a, w=wrong: a.view(getattr(torch, DTYPES[w][1])))
            _refused(path, layout, repr(name), f"dtype {wrong}, expected {' or '.join(ok)}", f"layer {cw.LAYER}")
            cases += 1
    assert cases >= 2 * len(names) - 2


# ---- shapes --------------------------------------------------------------------------------------------------------
def _grow(a, dim: int):
    """One more slice along dim (the last one repeated); a scalar becomes two values."""
    if a.ndim == 0:
        return a.reshape(1).repeat(2)
    last = a.narrow(dim, a.shape[dim] - 1, 1) if hasattr(a, "narrow") else np.take(a, [-1], axis=dim)
    return torch.cat([a, last], dim) if hasattr(a, "narrow") else np.concatenate([a, last], dim)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shape_off_by_one_is_refused(clean, tmp_path, layout):
    src = clean(layout)
    cases = 0
    for name in cw.expert_tensors(src, layout):
        if layout == "gguf_q4_0":
            import gguf

            r = gguf.GGUFReader(str(src))
            q = np.array(next(t for t in r.tensors if t.name == name).data)  # bytes [E, rows, blocks * 18]
            variants = [q[:-1], _grow(q, 1), np.concatenate([q, q[..., -18:]], 2)]  # E - 1, a row, a block
            for i, data in enumerate(variants):
                path = cw.rewrite_gguf(src, tmp_path / f"s{i}.gguf", name, data, gguf.GGMLQuantizationType.Q4_0)
                _refused(path, layout, repr(name), "shape", "expected")
                cases += 1
            continue
        ndim = len(cw.safetensors_index(src)[1][name][1])
        for dim in range(max(ndim, 1)):
            path = tmp_path / f"d{dim}.safetensors"
            cw.resave_safetensors(src, path, name, lambda a, d=dim: _grow(a, d))
            _refused(path, layout, repr(name), "shape", "expected")
            cases += 1
    assert cases >= len(cw.expert_tensors(src, layout))


# ---- non-finite scales ---------------------------------------------------------------------------------------------
def _poison(src, dst, layout: str, name: str, code: bytes):
    """src with one scale of tensor `name` (the middle one) set to `code`."""
    if layout == "gguf_q4_0":
        _, _, off, nbytes, _ = cw.gguf_index(src)[name]
        return cw.poke(src, dst, off + nbytes // 18 // 2 * 18, code)  # the fp16 d opening the middle block
    _, shape, b, e = cw.safetensors_index(src)[1][name]
    n = int(np.prod(shape)) if shape else 1
    return cw.poke(src, dst, b + n // 2 * ((e - b) // n), code)


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nonfinite_scales_are_refused_unless_allowed(clean, tmp_path, layout, value):
    src = clean(layout)
    cases = 0
    for suffix, enc in SCALES[layout].items():
        code = CODES[enc].get(value)
        if code is None:  # the encoding has no Inf
            continue
        for name in [n for n in cw.expert_tensors(src, layout) if _suffix(n, {**SCALES[layout], ".weight": 0,
                                                                                  "_blocks": 0}) == suffix]:
            path = _poison(src, tmp_path / src.name, layout, name, code)
            _refused(path, layout, repr(name), f"layer {cw.LAYER}", "NaN or Inf", "allow_nonfinite=True")
            got = _load(path, layout, allow_nonfinite=True)
            assert got.report[cw.LAYER]["nonfinite_scales"] == 1 and got.report[0]["nonfinite_scales"] == 0
            cases += 1
    assert cases >= 1
