"""moe_engine.tools.synth: the synthetic checkpoints read back with their users' readers (gguf's GGUFReader,
safetensors, transformers' own loading of GGUF, bf16, FP8 block and MXFP4), and hold the weights the writer meant.

Small variants with 2 decoder layers (the Q4_K_M and Q5_K_M files 8, so that llama.cpp's use_more_bits rule picks
both kinds of layer). Exactness: the GGUF experts transformers loads equal gguf's own dequantization of what the writer
quantized, bit for bit; bf16 tensors equal the seeded float32 weights rounded to bf16; FP8 and MXFP4 experts equal
the codes times the block scales, computed here independently, within one bf16 rounding (transformers dequantizes
them to bf16 on a CPU)."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
gguf = pytest.importorskip("gguf")
pytest.importorskip("safetensors")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from moe_engine.tools import synth  # noqa: E402
from moe_engine.tools.synth import weights  # noqa: E402

LAYERS = 2
MIXED = {"gguf-q4_k_m": T.Q4_K, "gguf-q5_k_m": T.Q5_K}  # the Q*_K_M kinds (8 layers) -> their gate / up type
BF16_REL = 2.0 ** -8  # one bf16 rounding (8 significant bits)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """kind -> path, written once for the module."""
    root = tmp_path_factory.mktemp("synth")
    out = {}
    for kind in synth.KINDS:
        p = root / (f"{kind}.gguf" if kind.startswith("gguf") else kind)
        layers = 8 if kind in MIXED else LAYERS
        # 4 MB shards: the fp8 and bf16 directories span several shards and an index, as shipped repositories do
        synth.write(kind, p, small=True, layers=layers, seed=7, shard_bytes=4 << 20, progress=False)
        out[kind] = p
    return out


def _load(path, **kw):
    if str(path).endswith(".gguf"):
        m, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                       output_loading_info=True, **kw)
    else:
        m, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, output_loading_info=True,
                                                       **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return m


def _forward_finite(m, vocab):
    ids = torch.tensor([[3, 301, 17, vocab - 1, 42, 7]])
    with torch.no_grad():
        logits = m(ids).logits
    assert logits.shape == (1, 6, vocab) and torch.isfinite(logits).all()
    assert 0.05 < logits.float().std() < 5  # H=256, lm_head N(0, 0.02): ~0.3


# ---- the rule and the blocks ---------------------------------------------------------------------------------------
def test_use_more_bits_is_llama_cpp_rule_at_48_layers():
    # src/llama-quant.cpp at 48 layers: first eighth 0-5, last eighth 42-47, and (i - 6) % 3 == 2 in between
    want = set(range(6)) | set(range(42, 48)) | set(range(8, 42, 3))
    assert {i for i in range(48) if synth.use_more_bits(i, 48)} == want and len(want) == 24


@pytest.mark.parametrize("maker,qtype", [(weights.q4_k_blocks, T.Q4_K), (weights.q5_k_blocks, T.Q5_K),
                                         (weights.q6_k_blocks, T.Q6_K)])
def test_k_quant_blocks_decode_finite_at_the_written_magnitude(maker, qtype):
    g = np.random.default_rng(1)
    b = maker(g, 96, 768)
    assert b.shape == (96, 768 // 256 * gguf.GGML_QUANT_SIZES[qtype][1]) and b.dtype == np.uint8
    x = dequantize(b, qtype)
    assert x.shape == (96, 768) and np.isfinite(x).all()
    assert 0.018 < x.std() < 0.022 and abs(x.mean()) < 0.002
    # every code byte value occurs (all 6-bit scales and mins, all 4/5/6-bit codes), and d is positive and finite
    blocks = b.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    codes, d = (blocks[:, :208], blocks[:, 208:210]) if qtype == T.Q6_K else (blocks[:, 4:], blocks[:, 0:2])
    assert len(np.unique(codes)) == 256
    d = np.ascontiguousarray(d).view(np.float16)
    assert np.isfinite(d).all() and (d > 0).all()
    if qtype != T.Q6_K:  # dmin centres the values: Q4_K 7.5 d, Q5_K 15.5 d (E[scale * q] over E[min])
        dmin = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float64)
        np.testing.assert_allclose(dmin, (7.5 if qtype == T.Q4_K else 15.5) * d, rtol=2e-3, atol=6e-8)


def test_fp8_random_codes_decode_at_the_written_magnitude():
    """weights.fp8_block_codes (the full-size FP8 file's fast path): ~N(0, 0.02^2) once scaled, no NaN code, the
    same bytes for the same (seed, name), the scale shape fp8_block gives."""
    import ml_dtypes

    from moe_engine.tools.synth import weights

    c, sc = weights.fp8_block_codes(3, "w", (300, 200))
    assert c.dtype == ml_dtypes.float8_e4m3fn and c.shape == (300, 200) and sc.shape == (3, 2)
    u = c.view(np.uint8)
    assert not ((u & 0x7F) == 0x7F).any()
    x = c.astype(np.float32) * sc[0, 0]
    assert np.isfinite(x).all() and 0.018 < x.std() < 0.022 and abs(x.mean()) < 0.002
    assert weights.fp8_block(np.zeros((300, 200), np.float32))[1].shape == sc.shape
    assert np.array_equal(weights.fp8_block_codes(3, "w", (300, 200))[0].view(np.uint8), u)


def test_bad_input_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="kind='gguf-q2_k'"):
        synth.write("gguf-q2_k", tmp_path / "x.gguf", small=True)
    with pytest.raises(ValueError, match="multiple of 256"):
        weights.q5_k_blocks(np.random.default_rng(0), 4, 200)
    with pytest.raises(ValueError, match="layers=0"):
        synth.write("bf16", tmp_path / "x", small=True, layers=0)
    with pytest.raises(ValueError, match="multiple of 256"):
        weights.q4_k_blocks(np.random.default_rng(0), 4, 200)
    with pytest.raises(ValueError, match="multiple of 32"):
        weights.mxfp4(np.zeros((4, 40), np.float32))
    assert not list(tmp_path.iterdir())  # nothing written before the error


# ---- GGUF -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gguf-q4_0", "gguf-q8_0", "gguf-q4_k_m", "gguf-q5_k_m", "gguf-q5_k"])
def test_gguf_reader_reads_back_every_tensor(files, kind):
    layers = 8 if kind in MIXED else LAYERS
    r = synth.check(kind, files[kind], small=True, layers=layers)
    s = synth.get_shape("qwen3moe", True, layers)
    assert r["tensors"] == 3 + 12 * layers
    reader = gguf.GGUFReader(str(files[kind]))
    t = {x.name: x for x in reader.tensors}
    assert t["token_embd.weight"].tensor_type == T.BF16 and t["blk.0.attn_norm.weight"].tensor_type == T.F32
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type == T.F32
    assert reader.fields["qwen3moe.expert_feed_forward_length"].contents() == s.moe_inter
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == s.vocab
    file_type = {"gguf-q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "gguf-q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "gguf-q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "gguf-q5_k_m": gguf.LlamaFileType.MOSTLY_Q5_K_M,
                 "gguf-q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_S}[kind]
    assert reader.fields["general.file_type"].contents() == file_type
    if kind in MIXED:  # layers 0, 3, 6, 7 of 8 take Q6_K down experts; gate and up are Q4_K / Q5_K everywhere
        base = MIXED[kind]
        downs = [t[f"blk.{n}.ffn_down_exps.weight"].tensor_type for n in range(layers)]
        assert [n for n, q in enumerate(downs) if q == T.Q6_K] == [0, 3, 6, 7]
        assert {q for n, q in enumerate(downs) if n not in (0, 3, 6, 7)} == {base}
        assert {t[f"blk.{n}.ffn_{p}_exps.weight"].tensor_type for n in range(layers) for p in ("gate", "up")} \
            == {base}
    if kind == "gguf-q5_k":
        assert r["types"][T.Q5_K.name] == 3 * layers and T.Q6_K.name not in r["types"]


@pytest.mark.parametrize("kind", ["gguf-q4_0", "gguf-q8_0", "gguf-q4_k_m", "gguf-q5_k_m", "gguf-q5_k"])
def test_transformers_loads_gguf(files, kind):
    path = files[kind]
    m = _load(path)
    s = synth.get_shape("qwen3moe", True, 8 if kind in MIXED else LAYERS)
    _forward_finite(m, s.vocab)
    gu = m.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()  # [E, 2I, H]: gate rows, then up rows
    dn = m.model.layers[1].mlp.experts.down_proj.detach().numpy()  # [E, H, I]
    assert gu.shape == (s.experts, 2 * s.moe_inter, s.hidden) and dn.shape == (s.experts, s.hidden, s.moe_inter)
    for e in (0, s.experts - 1):
        up_key = f"model.layers.1.mlp.experts.{e}.up_proj.weight"
        if kind in MIXED or kind == "gguf-q5_k":  # random blocks, drawn from the tensor's own generator
            qt, draw = (T.Q4_K, weights.q4_k_blocks) if kind == "gguf-q4_k_m" else (T.Q5_K, weights.q5_k_blocks)
            want = dequantize(draw(weights.rng(7, up_key), s.moe_inter, s.hidden), qt)
        else:
            qt = T.Q4_0 if kind == "gguf-q4_0" else T.Q8_0
            want = dequantize(quantize(weights.normal(7, up_key, (s.moe_inter, s.hidden)), qt), qt)
        np.testing.assert_array_equal(gu[e, s.moe_inter:], want)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok("the cat sat").input_ids
    assert tok.decode(ids) == "the cat sat" and len(ids) < len("the cat sat")  # merges apply


# ---- Hugging Face directories ---------------------------------------------------------------------------------------
def test_transformers_loads_bf16(files):
    path = files["bf16"]
    assert len(list(path.glob("model-*.safetensors"))) > 1
    m = _load(path)
    s = synth.get_shape("qwen3moe", True, LAYERS)
    _forward_finite(m, s.vocab)
    want = weights.normal(7, "model.layers.0.mlp.experts.3.gate_proj.weight", (s.moe_inter, s.hidden))
    got = m.model.layers[0].mlp.experts.gate_up_proj[3, :s.moe_inter].detach().float().numpy()
    np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16).astype(np.float32))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and "quantization_config" not in cfg
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.decode(tok("the cat sat").input_ids) == "the cat sat"


def test_transformers_loads_fp8_block(files):
    from safetensors import safe_open

    path = files["fp8"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    from transformers import FineGrainedFP8Config

    m = _load(path, quantization_config=FineGrainedFP8Config(dequantize=True))  # no GPU FP8 kernels needed
    s = synth.get_shape("qwen3moe", True, LAYERS)
    _forward_finite(m, s.vocab)
    idx = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.1.mlp.experts.5.down_proj.weight"
    with safe_open(str(path / idx[key]), framework="pt") as f:
        codes, inv = f.get_tensor(key), f.get_tensor(key + "_scale_inv")
        assert codes.dtype == torch.float8_e4m3fn and inv.dtype == torch.float32
        assert inv.shape == (-(-s.hidden // 128), -(-s.moe_inter // 128))
    with safe_open(str(path / idx["model.layers.1.mlp.gate.weight"]), framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16  # the router stays bf16
    want = codes.double() * inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    got = m.model.layers[1].mlp.experts.down_proj[5].detach().double()
    assert ((got - want).abs() <= BF16_REL * want.abs()).all()
    # the codes are the seeded weights to e4m3 precision (3 mantissa bits: relative error <= 2^-4, plus the
    # block's smallest values below e4m3's normal range)
    w = torch.from_numpy(weights.normal(7, key, (s.hidden, s.moe_inter))).double()
    assert ((want - w).abs() <= 2.0 ** -4 * w.abs() + 2.0 ** -9 * inv.max()).all()


def test_transformers_loads_gpt_oss_mxfp4(files):
    from safetensors import safe_open

    path = files["mxfp4"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    from transformers import Mxfp4Config

    # dequantize=True: with triton importable, transformers 5.25 would otherwise fetch gpt-oss kernels from the hub
    m = _load(path, quantization_config=Mxfp4Config(dequantize=True))
    s = synth.get_shape("gpt-oss", True, LAYERS)
    _forward_finite(m, s.vocab)
    idx = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    p = "model.layers.1.mlp.experts.down_proj"
    with safe_open(str(path / idx[p + "_blocks"]), framework="pt") as f:
        blocks, scales = f.get_tensor(p + "_blocks"), f.get_tensor(p + "_scales")
    assert blocks.shape == (s.experts, s.hidden, s.moe_inter // 32, 16) and blocks.dtype == torch.uint8
    assert scales.shape == (s.experts, s.hidden, s.moe_inter // 32)
    # independent decode: low nibble = even element; E2M1 magnitudes, bit 3 the sign; times 2^(scale - 127)
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    b = blocks[3].long()
    codes = torch.stack([b & 15, b >> 4], -1).reshape(s.hidden, s.moe_inter // 32, 32)
    want = (lut[codes] * torch.exp2(scales[3].double() - 127)[..., None]).reshape(s.hidden, s.moe_inter)
    # transformers keeps gpt-oss's down as [E, I, H] (convert_moe_packed_tensors transposes the stored [E, H, I])
    got = m.model.layers[1].mlp.experts.down_proj[3].detach().double().T
    assert ((got - want).abs() <= BF16_REL * want.abs()).all()
    # and they are the seeded weights to MXFP4 precision: relative RMS error of E2M1 with a power-of-two scale on
    # N(0, 1) data ~0.1; a swapped nibble order or a wrong scale would give ~1.4 or more
    w = torch.from_numpy(weights.normal(7, p + ".3", (s.hidden, s.moe_inter))).double()
    assert (want - w).norm() / w.norm() < 0.2
    assert m.model.layers[0].self_attn.sinks.shape == (s.heads,)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = synth.write("gguf-q4_0", tmp_path / "a.gguf", small=True, layers=1, seed=3, progress=False)
    b = synth.write("gguf-q4_0", tmp_path / "b.gguf", small=True, layers=1, seed=3, progress=False)
    c = synth.write("gguf-q4_0", tmp_path / "c.gguf", small=True, layers=1, seed=4, progress=False)
    ra, rb, rc = (open(x["path"], "rb").read() for x in (a, b, c))
    assert ra == rb and ra != rc and len(ra) == len(rc)


def test_writer_imports_no_torch():
    # the writer runs on hosts without torch (carried wheels): moe_engine's __init__ must stay lazy for it
    import subprocess
    import sys

    code = "import sys, moe_engine.tools.synth; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
