"""A format per layer and per matrix: MoERunner over (gate_up, down) pairs against the float64 reference, and a
Q4_K_M GGUF (gate / up Q4_K, down Q6_K in the layers of llama.cpp's use_more_bits rule) through from_pretrained
against transformers' own loading of the same 4-layer file.

Tolerances: the runner's steps against reference.py's TOLERANCE for the mode (w4a8: 3e-2). The Q4_K_M file as
test_from_pretrained_gguf.py's uniform files (pretrained_compare.py; TOL 2.5%, SHARE 0.75): the same int8 activations
and routing near-ties; measured (seed 11, avx512vnni): median rel 0.9%, 2 of 32 positions flipped to 6.7% and 9.3%.

The pair tests need cpumoe-formats' layer API (validate_layer, to_layout_role) and an executor that takes a format
per layer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import cpumoe_formats as cf
from moe_engine import MoERunner, layer_formats
from moe_engine.reference import TOLERANCE, reference

E, H, I, K = 6, 256, 512, 2  # noqa: E741
KW = dict(strategy="cpu", device="cpu", threads=2, progress=False)


def test_describe_and_compact():
    q = [("q4_k", "q6_k")] * 2 + [("q4_k", "q4_k")] * 3 + [("q4_k", "q6_k"), ("q8_0", "q8_0")]
    assert layer_formats.describe(q) == "q4_k/q6_k: layers 0-1,5; q4_k: layers 2-4; q8_0: layers 6"
    assert layer_formats.compact(q)[2] == "q4_k" and layer_formats.compact(q)[0] == ("q4_k", "q6_k")
    assert layer_formats.compact([("q4_k", "q4_k")] * 4) == "q4_k" and layer_formats.describe([("q6_k",) * 2]) == "q6_k"
    assert layer_formats.normalize("Q8_0".lower(), 3) == [("q8_0", "q8_0")] * 3


def _pair_banks(pairs, rng):
    """Per layer: the gate_up format's gate_up banks and the down format's down banks, random codes."""
    out = []
    for gu, dn in pairs:
        a, b = cf.get_format(gu).random_banks(E, H, I, rng), cf.get_format(dn).random_banks(E, H, I, rng)
        out.append({**{k: v for k, v in a.items() if k.startswith("gate_up")},
                    **{k: v for k, v in b.items() if k.startswith("down")}})
    return out


def test_runner_serves_pairs_per_layer(rng):
    pairs = [("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q8_0", "q4_k"), ("q6_k", "q6_k")]
    spec = layer_formats.compact(pairs)
    r = MoERunner(spec, _pair_banks(pairs, rng), top_k=K, **KW)  # start-up qualification: every layer vs float64
    assert r.layer_formats == pairs and r.format == spec and r.spec is None
    assert "q4_k/q6_k: layers 1" in r.describe() and (r.E, r.H, r.I) == (E, H, I)
    for layer in range(len(pairs)):
        x = torch.from_numpy(rng.standard_normal((3, H)).astype(np.float32)).to(torch.bfloat16)
        w = torch.from_numpy(rng.random((3, K)).astype(np.float32))
        ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(3)]).astype(np.int32))
        got = r.forward(layer, x, w, ids).float().numpy()
        want = reference(r, layer, x, w, ids)
        assert np.abs(got - want).max() / np.abs(want).max() < TOLERANCE["w4a8"], layer
    r.close()


def test_runner_pair_banks_checked_by_role(rng):
    pairs = [("q4_k", "q4_k"), ("q4_k", "q6_k")]
    banks = _pair_banks(pairs, rng)
    banks[1]["down"] = cf.get_format("q4_k").random_banks(E, H, I, rng)["down"]  # q4_k bytes where q6_k's belong
    with pytest.raises(ValueError, match=r"banks\[1\]: .*q6_k"):
        MoERunner(layer_formats.compact(pairs), banks, top_k=K, qualify=False, **KW)


def test_pairs_without_gpu_kernels_refused_by_name(rng, monkeypatch):
    from moe_engine.gpu.experts import GpuExperts

    monkeypatch.setattr(GpuExperts, "FORMATS", ("bf16", "q4_k"))
    pairs = [("q4_k", "q4_k"), ("q4_k", "q6_k")]
    with pytest.raises(ValueError, match=r"pairs \[\('q4_k', 'q6_k'\)\] of this model \(q4_k: layers 0; "
                                         r"q4_k/q6_k: layers 1\) have no GPU experts kernel"):
        MoERunner(layer_formats.compact(pairs), _pair_banks(pairs, rng), top_k=K, strategy="hybrid",
                  device="cuda" if torch.cuda.is_available() else "cpu", threads=2, progress=False)


def test_q4_k_m_matches_transformers_loading(tmp_path):
    pytest.importorskip("transformers", minversion="5.0")
    pytest.importorskip("gguf")
    from pretrained_compare import compare, gguf_reference

    from moe_engine import from_pretrained
    from moe_engine.tools import synth

    path = tmp_path / "q4_k_m.gguf"
    synth.write("gguf-q4_k_m", path, small=True, layers=4, seed=11, progress=False)
    ref = gguf_reference(path)
    model = from_pretrained(path, **KW)
    off = model.moe_engine
    # use_more_bits at 4 layers: layer 2 ((2 - 0) % 3 == 2) and layer 3 (the last eighth) take Q6_K down experts
    assert off.plan.formats == "q4_k: layers 0-1; q4_k/q6_k: layers 2-3"
    run = off.runner.layer_formats  # the CPU layouts the loader converted each matrix to (q4_k_x16, q6_k_x16 from avx2)
    dn = run[2][1]
    assert {p[0] for p in run} <= {"q4_k", "q4_k_x16"} and dn in ("q6_k", "q6_k_x16") and run[3][1] == dn
    assert run[0][1] == run[0][0] and f"{dn}: layers 2-3" in off.runner.describe()
    compare(model, ref, 2.5e-2, 0.75, continue_with="model")
    off.close()


def test_gpu_experts_one_per_pair_mapped_by_layer(monkeypatch):
    from moe_engine.gpu import by_pair, experts

    made = []

    class Fake:
        def __init__(self, fmt, *, num_layers, **kw):
            self.fmt, self.num_layers, self.calls, self.bytes_per_expert = fmt, num_layers, [], len(made) + 1
            made.append(self)

        def load(self, layer, slot, banks, expert, **kw):
            self.calls.append(("load", layer, slot, expert))

        def forward(self, layer, x, w, slots, out=None):
            self.calls.append(("forward", layer))
            return self.fmt

    monkeypatch.setattr(experts, "GpuExperts", Fake)
    pairs = [("q4_k", "q6_k"), ("q4_k", "q4_k"), ("q4_k", "q4_k"), ("q4_k", "q6_k")]
    g = by_pair.open_gpu_experts(pairs, capacity=2)
    assert [(f.fmt, f.num_layers) for f in made] == [(("q4_k", "q6_k"), 2), ("q4_k", 2)]
    assert g.forward(3, None, None, None) == ("q4_k", "q6_k") and made[0].calls == [("forward", 1)]
    g.load(2, 1, {}, 5)
    assert made[1].calls == [("load", 1, 1, 5)] and g.bytes_per_expert == 2
    made.clear()
    assert isinstance(by_pair.open_gpu_experts([("q8_0", "q8_0")] * 3, capacity=2), Fake) and made[0].fmt == "q8_0"


def test_mix_pairs_and_their_random_banks(rng):
    """q4_k_m / q5_k_m: llama.cpp's use_more_bits layers take Q6_K downs (24 of 48 layers); random_pair_layers gives
    each layer its gate_up format's gate_up banks and its down format's down banks, valid for that pair."""
    from moe_engine.banks import random_pair_layers

    pairs = layer_formats.mix_pairs("q4_k_m", 48)
    assert sum(dn == "q6_k" for _, dn in pairs) == 24 and {gu for gu, _ in pairs} == {"q4_k"}
    assert pairs[0] == ("q4_k", "q6_k") and pairs[6] == ("q4_k", "q4_k") and pairs[8] == ("q4_k", "q6_k")
    assert layer_formats.mix_pairs("q5_k_m", 8)[0] == ("q5_k", "q6_k")
    with pytest.raises(ValueError, match=r"mix 'q4_k_s': expected one of \['q4_k_m', 'q5_k_m'\]"):
        layer_formats.mix_pairs("q4_k_s", 8)
    small = layer_formats.mix_pairs("q4_k_m", 4)
    banks = random_pair_layers(small, E, H, I, seed=3, progress=False)
    for pair, b in zip(small, banks):
        layer_formats.validate_layer(pair, b, E, H, I)
        assert b["gate_up"].any() and b["down"].any()
    assert not np.array_equal(banks[0]["gate_up"], banks[1]["gate_up"])  # each layer's experts in another order
