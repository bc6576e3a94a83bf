"""GGUF experts read as shipped (Q8_0, Q4_K, Q5_K, Q6_K one type per file, and a Q5_K_M file's Q5_K / Q6_K mix; Q4_0
is in test_from_pretrained.py, Q4_K_M in test_layer_formats.py): from_pretrained against transformers' own loading of
the same 4-layer file (transformers dequantizes the K-quants with gguf-py), and the refusals of expert types
moe_engine does not serve, before anything heavy is read.

Tolerances (pretrained_compare.py says how positions are compared), measured on these files (seed 11, random
codes) in each format's default w4a8 mode on avx512vnni: median rel 0.9% (Q8_0), 1.0% (Q4_K), 0.9% (Q5_K), 1.4%
(Q6_K), 1.0% (Q5_K_M). The int8 activations alone cost ~1.8% per layer (one layer's experts against transformers' own
experts module on the same inputs: 0.3% in native mode), so TOL = 2.5% as for Q4_0. Routing flips (a whole expert at
one position; E = 16, top-4, over 4 layers: twice the 2-layer files' chances) took 1 of 32 positions to 8.1% (Q8_0),
1 to 12.5% (Q4_K), 1 to 6.3% (Q5_K), 5 to 4.7-9.9% (Q6_K), 2 to 4.8% and 7.9% (Q5_K_M), so SHARE = 0.75 (at most 8
positions past TOL, each under FLIP_TOL). A wrong block or row order moves every position: gate and up swapped put
all 32 past 6.6%, each layer's down experts shifted by one past 44%; Q5_K's fifth bits cleared put the worst 6 past
155%, moved one sub-block on past 39% (Q5_K and Q5_K_M alike).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers", minversion="5.0")
gguf = pytest.importorskip("gguf")

from pretrained_compare import compare, gguf_reference  # noqa: E402

from moe_engine import from_pretrained  # noqa: E402
from moe_engine.integrations.transformers import load, sources  # noqa: E402
from moe_engine.tools import synth  # noqa: E402
from moe_engine.tools.synth import gguf_file  # noqa: E402

TOL, SHARE = 2.5e-2, 0.75
KW = dict(strategy="cpu", device="cpu", threads=2, progress=False)
KINDS = {"gguf-q8_0": "q8_0", "gguf-q4_k": "q4_k", "gguf-q5_k": "q5_k", "gguf-q6_k": "q6_k"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for kind in (*KINDS, "gguf-q5_k_m"):
        out[kind] = root / f"{kind}.gguf"
        synth.write(kind, out[kind], small=True, layers=4, seed=11, progress=False, random_codes=True)
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_uniform_type_matches_transformers_loading(files, kind):
    fmt = KINDS[kind]
    ref = gguf_reference(files[kind])
    model = from_pretrained(files[kind], **KW)
    off = model.moe_engine
    assert off.plan.formats == fmt
    run = off.runner.format  # the file's format, or its CPU layout (q8_0_x16, q4_k_x16, q5_k_x16, q6_k_x16) where
    # the executor runs one
    assert run in (fmt, f"{fmt}_x16") and off.runner.layer_formats == [(run, run)] * 4
    compare(model, ref, TOL, SHARE, continue_with="model")
    off.close()


def test_q5_k_m_matches_transformers_loading(files):
    model = from_pretrained(files["gguf-q5_k_m"], **KW)
    off = model.moe_engine
    # use_more_bits at 4 layers: layer 2 ((2 - 0) % 3 == 2) and layer 3 (the last eighth) take Q6_K down experts
    assert off.plan.formats == "q5_k: layers 0-1; q5_k/q6_k: layers 2-3"
    gu, dn = off.runner.layer_formats[2]  # q5_k's and q6_k's CPU layouts from avx2
    assert gu in ("q5_k", "q5_k_x16") and dn in ("q6_k", "q6_k_x16")
    assert off.runner.layer_formats == [(gu, gu)] * 2 + [(gu, dn)] * 2
    compare(model, gguf_reference(files["gguf-q5_k_m"]), TOL, SHARE, continue_with="model")
    off.close()


def _write_with_types(path, types: dict):
    """A 4-layer Q4_K file whose named expert tensors have other GGML types, their bytes random (only the index is
    read before the refusal)."""
    plan = gguf_file.plan

    def patched(s, experts, seed, random_codes=False):
        out = []
        for name, shape, qtype, make in plan(s, experts, seed, random_codes):
            if name in types:
                qtype = types[name]
                blk, size = gguf.GGML_QUANT_SIZES[qtype]
                E, rows, row_bytes = shape
                cols = row_bytes // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K][1] * 256
                shape = (E, rows, cols // blk * size)
                make = _random_bytes(shape)
            out.append((name, shape, qtype, make))
        return out

    gguf_file.plan = patched
    try:
        synth.write("gguf-q4_k", path, small=True, layers=4, seed=11, progress=False)
    finally:
        gguf_file.plan = plan


def _random_bytes(shape):
    return lambda: np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)


def test_unsupported_types_refused_before_loading(tmp_path, monkeypatch):
    T = gguf.GGMLQuantizationType

    def heavy(*a, **k):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr(load.skeleton, "load", heavy)
    monkeypatch.setattr(sources.GgufSource, "expert_banks", heavy)
    served = sorted(sources.expert_types())
    assert {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"} <= set(served) and "Q2_K" not in served
    for name, qtype in (("blk.1.ffn_down_exps.weight", T.Q2_K), ("blk.2.ffn_gate_exps.weight", T.Q5_0),
                        ("blk.3.ffn_up_exps.weight", T.IQ4_NL)):
        path = tmp_path / f"{qtype.name}.gguf"
        _write_with_types(path, {name: qtype})
        with pytest.raises(ValueError, match=rf"expert tensor {name} is {qtype.name}; moe_engine serves GGUF "
                                             rf"experts in {served}".replace("[", r"\[").replace("]", r"\]")):
            from_pretrained(path, **KW)
    path = tmp_path / "gate-up.gguf"
    _write_with_types(path, {"blk.2.ffn_up_exps.weight": T.Q6_K})
    with pytest.raises(ValueError, match=r"layer 2: blk\.2\.ffn_gate_exps\.weight is Q4_K but blk\.2\.ffn_up_exps"
                                         r"\.weight is Q6_K; gate and up experts must share a type"):
        from_pretrained(path, **KW)


def test_format_may_only_repeat_the_files(files):
    with pytest.raises(ValueError, match=r"format='q4_0', but .* ships its experts as q6_k; omit format="):
        from_pretrained(files["gguf-q6_k"], format="q4_0", **KW)


def test_type_map_follows_the_registry(monkeypatch):
    import cpumoe_formats as cf

    assert sources.expert_types()["Q6_K"] == "q6_k"
    assert ("Q5_K" in sources.expert_types()) == ("q5_k" in cf.FORMATS)
    monkeypatch.delitem(cf.FORMATS, "q6_k")
    assert "Q6_K" not in sources.expert_types()


def test_header_is_parsed_once(files, monkeypatch):
    """from_pretrained parses a GGUF header once: its own reader (a plain view of gguf's mapping) serves
    transformers' config and tokenizer loading of the same file, which would otherwise parse it twice more."""
    from gguf import gguf_reader

    parses = []
    init = gguf_reader.GGUFReader.__init__

    def counting(self, path, *a, **k):
        parses.append(str(path))
        init(self, path, *a, **k)

    monkeypatch.setattr(gguf_reader.GGUFReader, "__init__", counting)
    model = from_pretrained(files["gguf-q8_0"], **KW)
    try:
        assert model.moe_engine.tokenizer is not None and model.config.model_type == "qwen3_moe"
        assert parses == [str(files["gguf-q8_0"])], parses
        assert gguf.GGUFReader is gguf_reader.GGUFReader  # the swap is undone
    finally:
        model.moe_engine.close()


def test_plain_reader_and_stored_dtypes(files):
    """The plain-view reader gives gguf's own fields and tensors; F32 / BF16 tensors come back as stored (their
    bits unchanged, no float32 round trip); a quantized one (the synth files' non-expert tensors are all F32 /
    BF16, so an expert tensor stands in) is gguf's own dequantize, as float32."""
    import torch

    from moe_engine.loading.gguf_tensors import GgufTensors

    path = files["gguf-q4_k"]
    stock = gguf.GGUFReader(path)
    with GgufTensors(path) as f:
        plain = f._reader
        assert {k: v.contents() for k, v in plain.fields.items()} == {k: v.contents() for k, v in stock.fields.items()}
        assert [(t.name, int(t.data_offset), int(t.n_bytes)) for t in plain.tensors] == \
               [(t.name, int(t.data_offset), int(t.n_bytes)) for t in stock.tensors]
        by_type = {}
        for t in stock.tensors:
            by_type.setdefault(t.tensor_type.name, t)
        for typ, want in (("F32", torch.float32), ("BF16", torch.bfloat16)):
            t = by_type[typ]
            got = f.read_float(t.name)
            assert got.dtype == want and tuple(got.shape) == tuple(int(d) for d in reversed(t.shape))
            stored = np.asarray(t.data).reshape(-1).view(np.uint8)
            assert np.array_equal(got.reshape(-1).view(torch.uint8).numpy(), stored), typ
        # a quantized tensor (the experts' Q4_K here) read as a non-expert one: gguf's dequantize, float32
        q = next(t for t in stock.tensors if t.tensor_type.name == "Q4_K")
        got = f.read_float(q.name)
        assert got.dtype == np.float32
        assert np.array_equal(got, gguf.quants.dequantize(q.data, q.tensor_type).reshape(got.shape))
