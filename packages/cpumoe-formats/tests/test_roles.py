"""One role of a format (roles.py) and a model's formats per layer (layers.py), over the whole registry:
- every bank has a role, gate_up banks first; role_dims reads (E, H, I) off either role's banks alone, ragged
  shapes included;
- validate_role, dequantize_role, biases_role and to_layout_role are the whole-layer functions' role halves, bit
  for bit (to_layout_role down every format's CPU-layout chain);
- the reference of a (gate_up, down) pair of one format and its CPU layout (the same math) is the format's own,
  exactly;
- layer_formats / model_mode / validate_layer normalise, choose and refuse with errors naming the layer."""
from __future__ import annotations

import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats.numerics import BF16

FORMATS = list(cf.FORMATS)


def shapes(spec):
    """(H, I) cases for a format: two aligned ones and, where the format allows, ragged ones."""
    m = spec.k_multiple
    out = [(2 * m, m), (3 * m, 2 * m)] if m >= 32 else [(96, 64), (160, 48)]
    if m == 1:
        out.append((259, 131) if spec.name == "fp8_block" else (37, 53))
    if spec.name.startswith("mxfp4"):
        out.append((96, 64))  # 1.5 panels of 64 columns
    return out


def pick(spec, role, banks):
    return {n: banks[n] for n in spec.role_banks(role)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_bank_has_a_role_and_role_dims_reads_the_layer(fmt, rng):
    spec = cf.get_format(fmt)
    gu, dn = spec.role_banks("gate_up"), spec.role_banks("down")
    assert gu and dn and gu + dn == spec.bank_names
    assert spec.role_slots("gate_up") + spec.role_slots("down") == tuple(range(len(spec.banks)))
    for H, I in shapes(spec):  # noqa: E741
        banks = spec.random_banks(3, H, I, rng)
        for role in cf.ROLES:
            arrays, dims = spec.validate_role(role, pick(spec, role, banks))
            assert dims == (3, H, I), (role, H, I)
            assert [a is banks[n] for a, n in zip(arrays, spec.role_banks(role))] == [True] * len(arrays)
            assert spec.role_bytes_per_expert(role, H, I) > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_role_halves_are_the_whole_layers(fmt, rng):
    spec = cf.get_format(fmt)
    H, I = shapes(spec)[-1]  # noqa: E741
    banks = spec.random_banks(3, H, I, rng)
    gu, dn = spec.dequantize(banks)
    np.testing.assert_array_equal(spec.dequantize_role("gate_up", pick(spec, "gate_up", banks)), gu)
    np.testing.assert_array_equal(spec.dequantize_role("down", pick(spec, "down", banks)), dn)
    bgu, bdn = spec.biases(banks)
    for role, want in (("gate_up", bgu), ("down", bdn)):
        got = spec.biases_role(role, pick(spec, role, banks))
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(got, want)


LAYOUT_CHAINS = [(f, s.cpu_layout) for f, s in cf.FORMATS.items() if s.cpu_layout]


@pytest.mark.parametrize("fmt,layout", LAYOUT_CHAINS)
def test_to_layout_role_is_to_layouts_role_banks(fmt, layout, rng):
    spec, lay = cf.get_format(fmt), cf.get_format(fmt).cpu_layout
    H, I = next((h, i) for h, i in shapes(spec)[::-1] if _takes(cf.get_format(lay), h, i))  # noqa: E741
    banks = spec.random_banks(11, H, I, rng)  # 11 experts: two chunks of 8 (roles.py's _CHUNK), one partial
    whole = spec.to_layout(banks, lay, threads=2)
    for role in cf.ROLES:
        got = spec.to_layout_role(role, pick(spec, role, banks), lay, threads=2)
        assert list(got) == list(cf.get_format(lay).role_banks(role))
        for n, a in got.items():
            np.testing.assert_array_equal(a.view(np.uint8), np.asarray(whole[n]).view(np.uint8), err_msg=n)


def _takes(spec, H, I):  # noqa: E741
    try:
        spec.check_dims(H, I)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("fmt,layout", [(f, lay) for f, lay in LAYOUT_CHAINS if f in ("q4_k", "q8_0", "q4_0")])
def test_reference_of_a_format_and_its_layout_is_the_formats(fmt, layout, rng):
    spec = cf.get_format(fmt)
    E, H, I = 4, 2 * spec.k_multiple, 2 * spec.k_multiple  # noqa: E741
    banks = spec.random_banks(E, H, I, rng)
    down = spec.to_layout_role("down", pick(spec, "down", banks), layout)
    pair = {**pick(spec, "gate_up", banks), **down}
    x = rng.standard_normal((3, H)).astype(np.float32).astype(BF16)
    w = rng.random((3, 2), dtype=np.float32)
    ids = rng.integers(0, E, (3, 2)).astype(np.int32)
    want = cf.reference.moe(fmt, banks, x, w, ids)
    np.testing.assert_array_equal(cf.reference.moe((fmt, layout), pair, x, w, ids), want)


def test_layer_formats_normalises_and_names_the_layer():
    assert cf.layer_formats("q4_k", 2) == [("q4_k", "q4_k")] * 2
    assert cf.layer_formats(["q4_k", ("q4_k", "q6_k"), ["q4_k_cpu", "Q6_K".lower()]], 3) == [
        ("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q4_k_x16", "q6_k")]
    assert cf.is_uniform(cf.layer_formats(["q8_0", ("q8_0", "q8_0")], 2))
    assert not cf.is_uniform(cf.layer_formats(["q8_0", "q4_k"], 2))
    with pytest.raises(ValueError, match=r"format lists 1 layers, expected one entry per layer \(num_layers=2\)"):
        cf.layer_formats(["q4_k"], 2)
    with pytest.raises(ValueError, match=r"layer 1 down format: format='q2_k' is not a known weight format"):
        cf.layer_formats(["q4_k", ("q4_k", "q2_k")], 2)
    with pytest.raises(TypeError, match=r"format\[0\] = \('q4_k',\): expected a format name or a"):
        cf.layer_formats([("q4_k",)], 1)
    with pytest.raises(TypeError, match=r"got tuple; a pair for every layer is \[pair\] \* num_layers"):
        cf.layer_formats(("q4_k", "q6_k"), 2)


def test_model_mode_prefers_the_uniform_default_and_names_a_mismatch():
    assert cf.model_mode([("q4_k", "q6_k")]) == "w4a8"
    assert cf.model_mode([("fp8_block", "bf16")]) == "native"
    assert cf.model_mode([("q4_k", "q4_k"), ("q4_k", "bf16")]) == "native"  # bf16 has native only
    assert cf.model_mode([("nvfp4", "q4_0")]) == "native"  # nvfp4's default, q4_0 has both
    with pytest.raises(ValueError, match=r"layer 0: gate_up format 'fp8_block' \(modes \['native'\]\) and down "
                                         r"format 'q4_0_x16' \(modes \['w4a8'\]\) share no activation mode"):
        cf.model_mode([("fp8_block", "q4_0_x16")])
    with pytest.raises(ValueError, match=r"mode='w4a8': layer 1: gate_up format 'q4_k' .* down format 'bf16'"):
        cf.model_mode([("q4_k", "q6_k"), ("q4_k", "bf16")], "w4a8")
    with pytest.raises(ValueError, match=r"layer 1: .* share no activation mode with the layers before it"):
        cf.model_mode([("q4_0_x16", "q4_0_x16"), ("bf16", "bf16")])


def test_validate_layer_names_the_role_and_the_bank(rng):
    q4k, q6k = cf.get_format("q4_k"), cf.get_format("q6_k")
    a, b = q4k.random_banks(2, 512, 256, rng), q6k.random_banks(2, 512, 256, rng)
    (gu, dn), dims = cf.validate_layer(("q4_k", "q6_k"), {"gate_up": a["gate_up"], "down": b["down"]})
    assert dims == (2, 512, 256) and gu[0] is a["gate_up"] and dn[0] is b["down"]
    with pytest.raises(ValueError, match=r"q6_k down bank 'down': shape \(2, 512, 144\) dtype uint8, expected shape "
                                         r"\(2, 512, 210\)"):
        cf.validate_layer(("q4_k", "q6_k"), {"gate_up": a["gate_up"], "down": a["down"]})  # q4_k's down bytes
    with pytest.raises(TypeError, match=r"q6_k down bank 'down': dtype int8, expected uint8"):
        cf.validate_layer(("q4_k", "q6_k"), {"gate_up": a["gate_up"], "down": b["down"].view(np.int8)})
    with pytest.raises(ValueError, match=r"format 'q6_k' needs down banks \['down'\]; missing \['down'\]"):
        cf.validate_layer(("q4_k", "q6_k"), {"gate_up": a["gate_up"]})
    with pytest.raises(ValueError, match=r"unexpected \['down_scale'\]"):
        cf.validate_layer(("q4_k", "q6_k"), {**a, "down": b["down"], "down_scale": b["down"]})
    c = q6k.random_banks(2, 512, 512, rng)  # down of another I
    with pytest.raises(ValueError, match=r"q6_k down banks have I=512, expected I=256 .* share E, H and I"):
        cf.validate_layer(("q4_k", "q6_k"), {"gate_up": a["gate_up"], "down": c["down"]})
