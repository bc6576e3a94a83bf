"""A format per layer and per matrix (docs/executor.md "Formats per layer"):
- mixed models (q4_k/q6_k, q4_k and q4_k/q6_k alternating, q8_0/q4_k, fp8_block/bf16 aligned and ragged, q4_0/q8_0,
  three layers of three pairs) against the float64 reference composed per role, every ISA tier forced, both modes
  where the pair has both, batch 1 and 8, each role repacked by its own format's rule (and repack=False);
- a uniform list spec is bit for bit the single-name spec; a mixed model's bits do not depend on its threads;
- numa='split' on a fake 2-node topology: a mixed model cut by the lcm of its formats' units, bit-equal to the
  same slices summed by one group, within tolerance of the reference; replicate is the single pool's bits;
- bad input: modes that disagree, a bank of the wrong format (shape, dtype) naming the layer and the role, a list
  of the wrong length, an unknown name; spec / given_format of a mixed model raise."""
import numpy as np
import pytest
from conftest import ACT, FORMATS, SHAPES, bits, routing, two_real_nodes, workers
from test_decode import REL_TOL

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native, numa_banks

# model: per-layer format spec; (H, I)
MODELS = {
    "q4_k/q6_k": ([("q4_k", "q6_k")] * 2, (512, 256)),
    "q4_k-alternating": (["q4_k", ("q4_k", "q6_k"), "q4_k"], (512, 512)),
    "q8_0/q4_k": ([("q8_0", "q4_k")] * 2, (256, 512)),
    "fp8_block/bf16": ([("fp8_block", "bf16")] * 2, (272, 144)),  # both CPU layouts take these
    "fp8_block/bf16-ragged": ([("fp8_block", "bf16")] * 2, (259, 131)),  # neither layout does: given formats run
    "q4_0/q8_0": ([("q4_0", "q8_0")] * 2, (96, 64)),
    "three-pairs": ([("q4_k", "q6_k"), ("q8_0", "q4_k"), ("q6_k", "q8_0")], (512, 256)),
}


def pair_banks(pair, E, H, I, rng):  # noqa: E741
    """One layer's banks for a (gate_up, down) pair: fresh random banks of each format, its role's half."""
    g, d = cf.get_format(pair[0]), cf.get_format(pair[1])
    a, b = g.random_banks(E, H, I, rng), d.random_banks(E, H, I, rng)
    return {**{n: a[n] for n in g.role_banks("gate_up")}, **{n: b[n] for n in d.role_banks("down")}}


def model(spec, H, I, rng, E=6):  # noqa: E741
    pairs = cf.layer_formats(spec, len(spec))
    return pairs, [pair_banks(p, E, H, I, rng) for p in pairs]


def ref_tol(pair):
    return max(REL_TOL[pair[0]], REL_TOL[pair[1]])


def rel(y, ref):
    return np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_models_every_tier_and_mode_against_the_reference(name, rng, monkeypatch):
    spec, (H, I) = MODELS[name]  # noqa: E741
    pairs, banks = model(spec, H, I, rng)
    modes = sorted(set.intersection(*(set(cf.get_format(n).modes) for p in pairs for n in p)))
    deq = [cf.reference.dequantize(p, b) for p, b in zip(pairs, banks)]  # float64 weights, once
    seen = set()
    for tier in cf.usable_tiers():
        monkeypatch.setenv("CPUMOE_ISA", tier)
        for mode in modes:
            for repack in (None, False):
                ex = ce.CpuMoeExecutor(spec, banks, top_k=4, max_tokens=8, mode=mode, repack=repack, **workers(2))
                want = [tuple(n if repack is False else ce.cpu_layout(n, H, I, mode) for n in p) for p in pairs]
                assert ex.layer_formats == want and ex.given_layer_formats == pairs and ex.mode == mode
                assert ex.mixed and len(ex.kernel_isas) == len({n for p in want for n in p})
                if (tuple(want), ex.isa, mode) in seen:
                    ex.close()
                    continue  # this tier runs the kernels a lower one ran
                seen.add((tuple(want), ex.isa, mode))
                for T in (1, 8):
                    for layer, pair in enumerate(pairs):
                        x = rng.standard_normal((T, H)).astype(np.float32)
                        w, ids = routing(rng, T, 4, 6)
                        y = ex.decode(layer, x, w, ids)
                        ref = cf.reference.moe(pair, banks[layer], x, w, ids, mode=mode, dequantized=deq[layer])
                        err = rel(y, ref)
                        assert err < ref_tol(pair), (tier, mode, repack, T, layer, err)
                ex.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_uniform_list_is_the_single_name_bit_for_bit(fmt, rng):
    spec = cf.get_format(fmt)
    H, I = SHAPES.get(fmt, (spec.k_multiple * 2, spec.k_multiple))  # noqa: E741
    banks = [spec.random_banks(5, H, I, rng) for _ in range(2)]
    kw = dict(top_k=3, max_tokens=8, **workers(2), **ACT.get(fmt, {}))
    one = ce.CpuMoeExecutor(fmt, banks, **kw)
    lists = [ce.CpuMoeExecutor([fmt, fmt], banks, **kw), ce.CpuMoeExecutor([(fmt, fmt)] * 2, banks, **kw)]
    for ex in lists:
        assert not ex.mixed and ex.spec is one.spec and ex.given_format == one.given_format == spec.name
        assert ex.layer_formats == [(one.spec.name,) * 2] * 2 and ex.isa == one.isa and ex.mode == one.mode
    for T in (1, 8):
        for layer in range(2):
            x = rng.standard_normal((T, H)).astype(np.float32)
            w, ids = routing(rng, T, 3, 5)
            y = bits(one.decode(layer, x, w, ids))
            for ex in lists:
                np.testing.assert_array_equal(bits(ex.decode(layer, x, w, ids)), y)
    for ex in [one, *lists]:
        ex.close()


def test_mixed_bits_do_not_depend_on_threads_or_teams(rng):
    spec, (H, I) = MODELS["three-pairs"]  # noqa: E741
    pairs, banks = model(spec, H, I, rng, E=8)
    exs = [ce.CpuMoeExecutor(spec, banks, top_k=4, max_tokens=8, **workers(n)) for n in (1, 2, 3)]
    for T in (1, 5, 8):
        for layer in range(len(pairs)):
            x = rng.standard_normal((T, H)).astype(np.float32)
            w, ids = routing(rng, T, 4, 8)
            want = None
            for ex in exs:
                for unit in (0, 1 << 40):  # every thread; the caller alone
                    _native.set_team_unit(ex.handle, unit)
                    y = bits(ex.decode(layer, x, w, ids))
                    want = y if want is None else want
                    np.testing.assert_array_equal(y, want, err_msg=f"threads={ex.threads} unit={unit} T={T}")
    for ex in exs:
        ex.close()


def test_layer_banks_and_the_ready_line(rng, caplog):
    spec, (H, I) = MODELS["q4_k-alternating"]  # noqa: E741
    pairs, banks = model(spec, H, I, rng)
    with caplog.at_level("INFO", logger="cpumoe_executor"):
        ex = ce.CpuMoeExecutor(spec, banks, top_k=2, **workers(1))
    line = next(r.getMessage() for r in caplog.records if "ready" in r.getMessage())
    assert ("format=q4_k_x16/q4_k_x16 x 2 layers, q4_k_x16/q6_k_x16 x 1 layer (given q4_k/q4_k x 2 layers, q4_k/q6_k "
            "x 1 layer)") in line
    lb = ex.layer_banks(1)  # each role repacked into its own format's layout
    assert list(lb) == ["gate_up", "down"]
    for role, fmt in (("gate_up", "q4_k"), ("down", "q6_k")):
        np.testing.assert_array_equal(lb[role], cf.get_format(fmt).to_layout_role(role, banks[1], fmt + "_x16")[role])
    assert ex.layer_spec(1, "down").name == "q6_k_x16" and ex.layer_spec(1).name == "q4_k_x16"
    with pytest.raises(ValueError, match=r"runs a format per layer and per matrix .*use layer_formats or layer_spec"):
        ex.spec  # noqa: B018
    with pytest.raises(ValueError, match=r"given a format per layer and per matrix .*use given_layer_formats"):
        ex.given_format  # noqa: B018
    with pytest.raises(ValueError, match=r"role='up': expected one of \['gate_up', 'down'\]"):
        ex.layer_spec(0, "up")
    isas = ex.kernel_isas
    assert list(isas) == ["q4_k_x16", "q6_k_x16"] and ex.isa == (isas["q4_k_x16"] if len(set(isas.values())) == 1 else
                                                             ", ".join(f"{k}={v}" for k, v in isas.items()))
    ex.close()
    assert ex.kernel_isas == isas and ex.layer_formats[1] == ("q4_k_x16", "q6_k_x16")  # descriptions stay readable
    with pytest.raises(RuntimeError, match="is closed"):
        ex.layer_banks(1)
    q5 = pair_banks(("q5_k", "q6_k"), 4, H, I, rng)  # Q5_K_M: both roles repacked
    with ce.CpuMoeExecutor([("q5_k", "q6_k")], [q5], top_k=2, **workers(1)) as ex:
        assert ex.layer_formats == [("q5_k_x16", "q6_k_x16")]
        np.testing.assert_array_equal(ex.layer_banks(0)["gate_up"],
                                      cf.get_format("q5_k").to_layout_role("gate_up", q5, "q5_k_x16")["gate_up"])
    q5x = pair_banks(("q5_k_x16", "q6_k"), 4, H, I, rng)  # a format without a CPU layout runs the given array
    with ce.CpuMoeExecutor([("q5_k_x16", "q6_k")], [q5x], top_k=2, **workers(1)) as ex:
        assert ex.layer_banks(0)["gate_up"] is q5x["gate_up"] and ex.layer_formats == [("q5_k_x16", "q6_k_x16")]


def test_numa_split_of_a_mixed_model(rng, tmp_path):
    root = two_real_nodes(tmp_path)
    spec = [("q4_k", "q6_k"), ("q8_0", "q4_k")]
    H, I = 512, 512  # noqa: E741 - two 256-row slices: q8_0's 32 and the K-quants' 256 -> 256
    pairs, banks = model(spec, H, I, rng)
    assert numa_banks.model_cut_unit([cf.get_format(n) for n in ("q8_0", "q4_k_x16", "q6_k_x16")], I) == 256
    kw = dict(top_k=4, max_tokens=8)
    with ce.CpuMoeExecutor(spec, banks, threads=2, numa="off", **kw) as off, \
            ce.CpuMoeExecutor(spec, banks, sysfs_root=root, **kw) as sp, \
            ce.CpuMoeExecutor(spec, banks, sysfs_root=root, numa="replicate", **kw) as rep:
        assert sp.numa == "split" and sp.numa_plan.bounds == (0, 256, 512) and sp.layer_formats == off.layer_formats
        with ce.CpuMoeExecutor(spec, banks, numa=sp.numa_plan.on_one_group(), **kw) as one:
            for T in (1, 8):
                for layer, pair in enumerate(pairs):
                    x = rng.standard_normal((T, H)).astype(np.float32)
                    w, ids = routing(rng, T, 4, 6)
                    y = off.decode(layer, x, w, ids)
                    np.testing.assert_array_equal(bits(rep.decode(layer, x, w, ids)), bits(y))
                    ys = sp.decode(layer, x, w, ids)
                    np.testing.assert_array_equal(bits(ys), bits(one.decode(layer, x, w, ids)))
                    assert rel(ys, cf.reference.moe(pair, banks[layer], x, w, ids)) < ref_tol(pair)
        for layer in range(2):  # the slices joined back are the layer's run banks
            for n, a in off.layer_banks(layer).items():
                np.testing.assert_array_equal(sp.layer_banks(layer)[n], a, err_msg=f"layer {layer} {n}")


def test_bad_input_names_the_layer_the_formats_and_the_role(rng):
    q4k, q6k = cf.get_format("q4_k"), cf.get_format("q6_k")
    a, b = q4k.random_banks(4, 512, 256, rng), q6k.random_banks(4, 512, 256, rng)
    good = {"gate_up": a["gate_up"], "down": b["down"]}
    kw = dict(top_k=2, **workers(1))
    with pytest.raises(ValueError, match=r"layer 1: gate_up format 'fp8_block' \(modes \['native'\]\) and down "
                                         r"format 'q4_0_x16' \(modes \['w4a8'\]\) share no activation mode"):
        fp8, q40 = cf.get_format("fp8_block"), cf.get_format("q4_0_x16")
        bad = pair_banks(("fp8_block", "q4_0_x16"), 4, 512, 256, rng)
        ce.CpuMoeExecutor([("q4_k", "q6_k"), (fp8.name, q40.name)], [good, bad], **kw)
    with pytest.raises(ValueError, match=r"mode='native': layer 0: gate_up format 'q4_k_x16' .* expected a mode both"):
        ce.CpuMoeExecutor([("q4_k_x16", "q6_k")], [{"gate_up": q4k.to_layout_role("gate_up", a, "q4_k_x16")[
            "gate_up"], "down": b["down"]}], mode="native", **kw)
    with pytest.raises(ValueError, match=r"layer 1: q6_k down bank 'down': shape \(4, 512, 144\) dtype uint8, "
                                         r"expected shape \(4, 512, 210\)"):
        ce.CpuMoeExecutor([("q4_k", "q6_k")] * 2, [good, {"gate_up": a["gate_up"], "down": a["down"]}], **kw)
    with pytest.raises(TypeError, match=r"layer 0: q4_k gate_up bank 'gate_up': dtype int8, expected uint8"):
        ce.CpuMoeExecutor([("q4_k", "q6_k")], [{"gate_up": a["gate_up"].view(np.int8), "down": b["down"]}], **kw)
    with pytest.raises(ValueError, match=r"format lists 1 layers, expected one entry per layer \(num_layers=2\)"):
        ce.CpuMoeExecutor([("q4_k", "q6_k")], [good, good], **kw)
    with pytest.raises(ValueError, match=r"layer 0 down format: format='q2_k' is not a known weight format"):
        ce.CpuMoeExecutor([("q4_k", "q2_k")], [good], **kw)
    with pytest.raises(ValueError, match=r"layer 1: q6_k down banks have E=3, expected E=4"):
        c = q6k.random_banks(3, 512, 256, rng)
        ce.CpuMoeExecutor([("q4_k", "q6_k")] * 2, [good, {"gate_up": a["gate_up"], "down": c["down"]}], **kw)
    with pytest.raises(ValueError,
                       match=r"repack=True: none of the formats \['q5_k_x16', 'q4_k_x16'\] has a CPU layout"):
        ce.CpuMoeExecutor([("q5_k_x16", "q4_k_x16")], [pair_banks(("q5_k_x16", "q4_k_x16"), 4, 512, 256, rng)],
                          repack=True, **kw)
