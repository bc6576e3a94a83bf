"""Synchronous decode: parity with the single-threaded kernels (bit-identical:
same work items, same order) and with the float64 reference, for every format,
thread counts 1..N, batch sizes 1, 3, 8 and max_tokens, duplicated and -1 ids,
several layers."""
import numpy as np
import pytest
from conftest import ACT, FORMATS, bits, make_banks, ran_banks, reference, routing, workers

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native

NCORES = len(ce.resolve_cores()[0])
THREADS = sorted({1, 2, NCORES, NCORES + 1})  # +1: oversubscribed still bit-identical
# rel vs float64: the format's own kernel tolerance (its tests justify it); executor adds nothing
REL_TOL = {"bf16": 6e-3, "fp8_block": 5e-3, "nvfp4": 1e-2, "mxfp4": 1e-2, "ds_fp4": 2e-2, "q4_0": 1e-2,
           "mxfp4_panel": 1e-2, "q4_0_x16": 1e-2, "fp8_block_x16": 5e-3, "nvfp4_x16": 1e-2, "ds_fp4_x16": 2e-2,
           "bf16_x16": 6e-3, "mxfp4_x16": 1e-2, "q8_0": 1e-2, "q4_k": 1e-2, "q6_k": 1e-2, "q4_k_x16": 1e-2,
           "q8_0_x16": 1e-2, "q5_k": 1e-2, "q6_k_x16": 1e-2, "q5_k_x16": 1e-2}


# (format, repack): the default, plus the formats with a CPU layout kept as given (mxfp4's own Triton layout)
CASES = [(f, None) for f in FORMATS] + [(f, False) for f in FORMATS if cf.get_format(f).cpu_layout]


@pytest.mark.parametrize("fmt,repack", CASES, ids=[f + ("-given" if r is False else "") for f, r in CASES])
def test_parity_all_threads_batches_layers(fmt, repack, rng):
    banks, (E, H, I) = make_banks(fmt, rng, layers=3)
    K, max_tokens = 4, 12
    act = ACT.get(fmt, {})
    for threads in THREADS:
        ex = ce.CpuMoeExecutor(fmt, banks, top_k=K, max_tokens=max_tokens, **workers(threads), repack=repack, **act)
        assert ex.threads == threads
        layout = cf.get_format(fmt).cpu_layout
        assert ex.spec.name in ((fmt, layout) if repack is None and layout else (fmt,))
        run = ran_banks(ex, banks)  # the bits to match: the format that runs, single-threaded
        _native.set_team_unit(ex.handle, 0)  # every thread works on these small steps (team sizing: see
        # test_scheduling.py)
        for T in (1, 3, 8, max_tokens):
            for layer in range(3):
                x = rng.standard_normal((T, H)).astype(np.float32)
                w, ids = routing(rng, T, K, E)
                y = ex.decode(layer, x, w, ids)
                want = cf.moe_forward(ex.spec.name, run[layer], x, w, ids, **act)
                np.testing.assert_array_equal(bits(y), bits(want), err_msg=f"threads={threads} T={T} layer={layer}")
                if threads == 1 and T in (1, 8):
                    ref = cf.reference.moe(fmt, banks[layer], x, w, ids, **act)
                    rel = np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max()
                    assert rel < REL_TOL[fmt], (T, layer, rel)


@pytest.mark.parametrize("fmt", FORMATS)
def test_modes_and_forced_tiers(fmt, rng):
    spec = cf.get_format(fmt)
    banks, (E, H, I) = make_banks(fmt, rng, layers=1)
    x = rng.standard_normal((3, H)).astype(np.float32)
    w, ids = routing(rng, 3, 4, E)
    act = ACT.get(fmt, {})
    for mode, tiers in spec.kernel_tiers.items():
        for tier in tiers:
            if tier not in cf.usable_tiers():
                continue
            # the format's own kernel at each tier (repack=False: the auto repack into a CPU layout, which sums in
            # its own fp32 order, is tested below; compared with this format's bits it mismatched only by chance)
            ex = ce.CpuMoeExecutor(fmt, banks, top_k=4, max_tokens=4, mode=mode, isa=tier, repack=False, **act)
            assert ex.isa == cf.Kernel(fmt, E, H, I, mode=mode, isa=tier, **act).name
            want = cf.moe_forward(fmt, banks[0], x, w, ids, mode=mode, isa=tier, **act)
            np.testing.assert_array_equal(bits(ex.decode(0, x, w, ids)), bits(want))


def test_apply_router_weight_on_input(rng):
    banks, (E, H, I) = make_banks("bf16", rng)
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=3, apply_router_weight_on_input=True)
    x = rng.standard_normal((2, H)).astype(np.float32)
    w, ids = routing(rng, 2, 3, E)
    want = reference(ex, banks, 1, x, w, ids, apply_router_weight_on_input=True)
    np.testing.assert_array_equal(bits(ex.decode(1, x, w, ids)), bits(want))


def test_all_routes_skipped_gives_zeros_without_waking_the_pool(rng):
    banks, (E, H, I) = make_banks("bf16", rng)
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=4)
    runs = ex._x.pool_runs
    out = np.full((3, H), 7, np.uint16).view(cf.numerics.BF16)
    y = ex.decode(0, rng.standard_normal((3, H)).astype(np.float32), np.ones((3, 2), np.float32),
                  np.full((3, 2), -1, np.int32), out=out)
    assert y is out and not bits(y).any()
    assert ex._x.pool_runs == runs


def test_work_counts_each_steps_distinct_experts_and_time(rng):
    """work(): the distinct experts of every step that ran the pool (a shared expert once, -1 routes none) and a
    positive time; an all-skipped step adds neither. A caller's live rate rests on it (moe_engine's split='auto')."""
    banks, (E, H, I) = make_banks("bf16", rng)
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=3, max_tokens=4)
    assert ex.work() == (0.0, 0)
    x = rng.standard_normal((3, H)).astype(np.float32)
    w = np.ones((3, 3), np.float32)
    ids = np.array([[0, 1, 2], [2, 1, -1], [3, 0, 1]], np.int32)  # experts 0-3: 4 distinct of 8 routes
    ex.decode(0, x, w, ids)
    s1, n1 = ex.work()
    assert n1 == 4 and s1 > 0
    ex.decode(1, x[:1], w[:1], np.array([[E - 1, -1, -1]], np.int32))
    s2, n2 = ex.work()
    assert n2 == 5 and s2 > s1
    ex.decode(0, x, w, np.full((3, 3), -1, np.int32))
    assert ex.work() == (s2, n2)
    ex.close()
    with pytest.raises(RuntimeError):
        ex.work()


@pytest.mark.parametrize("fmt", [f for f in ("bf16", "nvfp4") if f in FORMATS])
def test_a_token_with_every_route_skipped_among_routed_ones(fmt, rng):
    """Its y row is zeros (written, not left: the output is poisoned first); the others' rows are the kernels'."""
    banks, (E, H, I) = make_banks(fmt, rng)
    act = ACT.get(fmt, {})
    for threads in THREADS:
        ex = ce.CpuMoeExecutor(fmt, banks, top_k=3, max_tokens=5, **workers(threads), **act)
        _native.set_team_unit(ex.handle, 0)
        x = rng.standard_normal((5, H)).astype(np.float32)
        w, ids = routing(rng, 5, 3, E)
        ids[1, :] = -1
        ids[3, :] = ids[0, 0]  # a token whose three routes share one expert (one group, three route slots)
        out = np.full((5, H), 0x7FC1, np.uint16).view(cf.numerics.BF16)
        y = ex.decode(0, x, w, ids, out=out)
        want = reference(ex, banks, 0, x, w, ids, **act)
        assert not bits(y)[1].any()
        np.testing.assert_array_equal(bits(y), bits(want), err_msg=f"threads={threads}")


def test_errors_name_the_argument(rng):
    banks, (E, H, I) = make_banks("bf16", rng)
    with pytest.raises(ValueError, match="top_k=65"):
        ce.CpuMoeExecutor("bf16", banks, top_k=65)
    with pytest.raises(ValueError, match="max_tokens=0"):
        ce.CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=0)
    with pytest.raises(TypeError, match="one mapping of bank name"):
        ce.CpuMoeExecutor("bf16", banks[0], top_k=2)
    with pytest.raises(ValueError, match="layer 1: .*expected E=6"):
        ce.CpuMoeExecutor("bf16", [banks[0], cf.get_format("bf16").random_banks(5, H, I, rng)], top_k=2)
    with pytest.raises(ValueError, match="format='fp4'"):
        ce.CpuMoeExecutor("fp4", banks, top_k=2)
    with pytest.raises(ValueError, match="threads=0"):
        ce.CpuMoeExecutor("bf16", banks, top_k=2, threads=0)
    with pytest.raises(ValueError, match="core_ids="):
        ce.CpuMoeExecutor("bf16", banks, top_k=2, core_ids=[100000])
    with pytest.raises(ValueError, match="isa='avx9'"):
        ce.CpuMoeExecutor("bf16", banks, top_k=2, isa="avx9")
    with pytest.raises(ValueError, match="repack=True: bf16_x16: H and I must be multiples of 16"):
        ce.CpuMoeExecutor("bf16", banks, top_k=2, repack=True)  # I = 40
    with pytest.raises(ValueError, match="repack=True: format 'bf16_x16' has no CPU layout"):
        ce.CpuMoeExecutor("bf16_x16", make_banks("bf16_x16", rng)[0], top_k=2, repack=True)
    with pytest.raises(ValueError, match="repack='yes' must be None"):
        ce.CpuMoeExecutor("bf16", banks, top_k=2, repack="yes")
    for fmt in ("mxfp4", "ds_fp4", "mxfp4_panel", "ds_fp4_x16"):
        if fmt in FORMATS:
            b, _ = make_banks(fmt, rng, layers=1)
            with pytest.raises(ValueError, match="apply_router_weight_on_input"):
                ce.CpuMoeExecutor(fmt, b, top_k=2, apply_router_weight_on_input=True, **ACT[fmt])
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=4)
    x = rng.standard_normal((5, H)).astype(np.float32)
    w, ids = routing(rng, 5, 2, E)
    with pytest.raises(ValueError, match=r"batch size 5 .*max_tokens=4"):
        ex.decode(0, x, w, ids)
    with pytest.raises(ValueError, match="layer=2"):
        ex.decode(2, x[:2], w[:2], ids[:2])
    with pytest.raises(ValueError, match="expected top_k=2"):
        ex.decode(0, x[:2], np.ones((2, 3), np.float32), np.zeros((2, 3), np.int32))
    for bad in (E, -2, 1 << 20):
        ids2 = ids[:2].copy()
        ids2[1, 0] = bad
        with pytest.raises(ValueError, match=rf"topk_ids\[1, 0\] = {bad} is not in \[-1, {E}\)"):
            ex.decode(0, x[:2], w[:2], ids2)


def test_threads_and_cores_are_reported(rng):
    banks, _ = make_banks("bf16", rng)
    cores, why = ce.resolve_cores()
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=2)
    assert ex.core_ids == cores and ex.threads == len(cores) and why
    ex2 = ce.CpuMoeExecutor("bf16", banks, top_k=2, core_ids=[cores[0]])
    assert ex2.threads == 1 and ex2.core_ids == [cores[0]]


def test_ready_log_and_format_hint(rng, caplog):
    """The ready line names the format and kernel; a format with a CPU layout is repacked by default (progress and
    the ready line say so); kept as given (repack=False) it logs its hint."""
    import logging

    for fmt, repack, ran, hinted in (("mxfp4", None, "mxfp4_panel (repacked from mxfp4)", False),
                                     ("mxfp4", False, "mxfp4", True), ("mxfp4_panel", None, "mxfp4_panel", False)):
        banks, _ = make_banks(fmt, rng, layers=3)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cpumoe_executor"):
            ex = ce.CpuMoeExecutor(fmt, banks, top_k=2, threads=1, repack=repack, **ACT[fmt])
            ex.close()
        text = caplog.text
        assert f"format={ran} isa=" in text, text
        assert ("repack_mxfp4_panels" in text) == hinted, text
        assert ("repacked mxfp4 -> mxfp4_panel, layer 3/3" in text) == (repack is None and fmt == "mxfp4"), text
        assert ex.given_format == fmt


def test_repack_holds_its_own_copy(rng):
    """After the repack the executor no longer reads the given arrays: overwriting them changes nothing."""
    banks, (E, H, I) = make_banks("mxfp4", rng, layers=1)
    ex = ce.CpuMoeExecutor("mxfp4", banks, top_k=2, threads=2, **ACT["mxfp4"])
    x = rng.standard_normal((3, H)).astype(np.float32)
    w, ids = routing(rng, 3, 2, E)
    want = cf.moe_forward("mxfp4", banks[0], x, w, ids, **ACT["mxfp4"])
    for a in banks[0].values():
        a.view(np.uint8)[...] = 0x7F
    np.testing.assert_array_equal(bits(ex.decode(0, x, w, ids)), bits(want))


def test_auto_repack_needs_the_layouts_kernel(rng):
    """q4_0's CPU layout (q4_0_x16) is auto only from avx2 (cpu_layout_min_tier): below (a scalar cap) and for the
    native mode (which the layout lacks) q4_0 stays; repack=True forces it, and raises for a mode it lacks."""
    banks, (E, H, I) = make_banks("q4_0", rng, layers=1)
    ex = ce.CpuMoeExecutor("q4_0", banks, top_k=2, threads=1, isa="scalar")
    assert ex.spec.name == "q4_0"
    ex = ce.CpuMoeExecutor("q4_0", banks, top_k=2, threads=1, mode="native")
    assert ex.spec.name == "q4_0"
    with pytest.raises(ValueError, match="repack=True: format 'q4_0_x16'.*no mode 'native'"):
        ce.CpuMoeExecutor("q4_0", banks, top_k=2, threads=1, mode="native", repack=True)
    ex = ce.CpuMoeExecutor("q4_0", banks, top_k=2, threads=1, repack=True, isa="scalar")  # forced
    assert ex.spec.name == "q4_0_x16" and ex.isa == "scalar+w4a8"
    ex = ce.CpuMoeExecutor("q4_0", banks, top_k=2, threads=1)
    tier = lambda f: cf.TIERS.index(cf.selected_tier(f).split("+")[0])  # noqa: E731  (this CPU, CPUMOE_ISA's cap)
    auto = tier("q4_0_x16") >= max(tier("q4_0"), cf.TIERS.index("avx2"))
    assert ex.spec.name == ("q4_0_x16" if auto else "q4_0") and ex.given_format == "q4_0"


def test_auto_repack_needs_the_layouts_shapes(rng):
    """fp8_block takes any H and I, its CPU layout (fp8_block_x16) multiples of 16: ragged banks stay as given (and
    repack=True says why); at a multiple of 16 auto repacks where the layout's kernel is at least fp8_block's own
    and avx2 (cpu_layout_min_tier), and the result is the layout's, bit for bit."""
    banks, (E, H, I) = make_banks("fp8_block", rng, layers=1)
    assert H % 16 and ce.CpuMoeExecutor("fp8_block", banks, top_k=2, threads=1).spec.name == "fp8_block"
    with pytest.raises(ValueError, match="repack=True: fp8_block_x16: H and I must be multiples of 16"):
        ce.CpuMoeExecutor("fp8_block", banks, top_k=2, threads=1, repack=True)
    banks = [cf.get_format("fp8_block").random_banks(4, 272, 144, rng)]
    ex = ce.CpuMoeExecutor("fp8_block", banks, top_k=2, threads=2)
    x16, own = (cf.TIERS.index(cf.selected_tier(f).split("+")[0]) for f in ("fp8_block_x16", "fp8_block"))
    assert ex.spec.name == ("fp8_block_x16" if x16 >= max(own, cf.TIERS.index("avx2")) else "fp8_block")
    x = rng.standard_normal((3, 272)).astype(np.float32)
    w, ids = routing(rng, 3, 2, 4)
    want = cf.moe_forward(ex.spec.name, ran_banks(ex, banks)[0], x, w, ids)
    np.testing.assert_array_equal(bits(ex.decode(0, x, w, ids)), bits(want))


def test_bf16_repacks_only_below_its_tile_kernel(rng):
    """bf16's CPU layout (bf16_x16): auto repacks where bf16 itself runs at avx512f or avx512bf16 (Skylake-SP to
    Ice Lake, Zen 4), not where bf16 has its amx tile kernel (a higher tier) nor at avx2 (cpu_layout_min_tier)."""
    banks = [cf.get_format("bf16").random_banks(4, 96, 48, rng)]
    tier = cf.TIERS.index(cf.selected_tier("bf16").split("+")[0])
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=2, threads=1)
    assert ex.spec.name == ("bf16_x16" if tier in (cf.TIERS.index("avx512f"), cf.TIERS.index("avx512bf16"))
                            else "bf16")
    under_f = ce.CpuMoeExecutor("bf16", banks, top_k=2, threads=1, isa="avx512f")
    assert under_f.spec.name == ("bf16_x16" if tier >= cf.TIERS.index("avx512f") else "bf16")
    assert ce.CpuMoeExecutor("bf16", banks, top_k=2, threads=1, isa="avx2").spec.name == "bf16"
    x = rng.standard_normal((3, 96)).astype(np.float32)
    w, ids = routing(rng, 3, 2, 4)
    want = cf.moe_forward(ex.spec.name, ran_banks(ex, banks)[0], x, w, ids)
    np.testing.assert_array_equal(bits(ex.decode(0, x, w, ids)), bits(want))


def test_nvfp4_auto_repack_is_w4a8_only(rng):
    """nvfp4's CPU layout (nvfp4_x16) has the w4a8 mode only: nvfp4's default (native) keeps nvfp4; w4a8 repacks
    from avx2 (cpu_layout_min_tier), keeps nvfp4 under a scalar cap; the repacked executor matches nvfp4_x16's
    kernel on the repacked banks bit for bit, and nvfp4 w4a8 within nvfp4's tolerance."""
    banks, (E, H, I) = make_banks("nvfp4", rng, layers=1)
    assert ce.CpuMoeExecutor("nvfp4", banks, top_k=2, threads=1).spec.name == "nvfp4"  # native
    assert ce.CpuMoeExecutor("nvfp4", banks, top_k=2, threads=1, mode="w4a8", isa="scalar").spec.name == "nvfp4"
    with pytest.raises(ValueError, match="repack=True: format 'nvfp4_x16'.*no mode 'native'"):
        ce.CpuMoeExecutor("nvfp4", banks, top_k=2, threads=1, repack=True)
    ex = ce.CpuMoeExecutor("nvfp4", banks, top_k=2, threads=2, mode="w4a8")
    simd = cf.selected_tier("nvfp4_x16", "w4a8") != "scalar+w4a8"
    assert ex.spec.name == ("nvfp4_x16" if simd else "nvfp4") and ex.given_format == "nvfp4"
    ex = ce.CpuMoeExecutor("nvfp4", banks, top_k=2, threads=2, mode="w4a8", repack=True)
    assert ex.spec.name == "nvfp4_x16"
    x = rng.standard_normal((5, H)).astype(np.float32)
    w, ids = routing(rng, 5, 2, E)
    y = ex.decode(0, x, w, ids)
    want = cf.moe_forward("nvfp4_x16", ran_banks(ex, banks)[0], x, w, ids, mode="w4a8")
    np.testing.assert_array_equal(bits(y), bits(want))
    yn = cf.moe_forward("nvfp4", banks[0], x, w, ids, mode="w4a8").astype(np.float64)
    assert np.abs(y.astype(np.float64) - yn).max() <= 1e-2 * np.abs(yn).max()


def test_mxfp4_repack_chain(rng, caplog):
    """mxfp4 -> mxfp4_panel (both modes) -> mxfp4_x16 (w4a8 only, auto from avx2): native stops at the panels, w4a8
    goes on where mxfp4_x16's kernel is at least avx2 and the panels' tier; repack=True forces the first step only
    (a scalar cap keeps the panels). Every variant gives mxfp4's own w4a8 bits."""
    import logging

    banks, (E, H, I) = make_banks("mxfp4", rng, layers=2)
    act = ACT["mxfp4"]
    assert ce.CpuMoeExecutor("mxfp4", banks, top_k=2, threads=1, **act).spec.name == "mxfp4_panel"
    tier = lambda f: cf.TIERS.index(cf.selected_tier(f, "w4a8").split("+")[0])  # noqa: E731
    vnni = tier("mxfp4_x16") >= max(tier("mxfp4_panel"), cf.TIERS.index("avx2"))
    x = rng.standard_normal((5, H)).astype(np.float32)
    w, ids = routing(rng, 5, 2, E)
    want = cf.moe_forward("mxfp4", banks[1], x, w, ids, mode="w4a8", **act)
    for fmt, kw, ran in (("mxfp4", {}, "mxfp4_x16" if vnni else "mxfp4_panel"),
                         ("mxfp4", dict(repack=True, isa="scalar"), "mxfp4_panel"),
                         ("mxfp4_panel", dict(repack=True, isa="scalar"), "mxfp4_x16"),
                         ("mxfp4", dict(repack=False), "mxfp4")):
        given = banks if fmt == "mxfp4" else [cf.repack_mxfp4_panels(b) for b in banks]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cpumoe_executor"):
            ex = ce.CpuMoeExecutor(fmt, given, top_k=2, threads=2, mode="w4a8", **kw, **act)
        assert ex.spec.name == ran and ex.given_format == fmt, (fmt, kw)
        assert (f"repacked {fmt} -> {ran}, layer 2/2" in caplog.text) == (ran != fmt), caplog.text
        np.testing.assert_array_equal(bits(ex.decode(1, x, w, ids)), bits(want))
        ex.close()


def test_ds_fp4_auto_repack_is_w4a8_only(rng):
    """ds_fp4's CPU layout (ds_fp4_x16) has only mode w4a8: ds_fp4's default (native) stays ds_fp4; w4a8 runs
    repacked from avx2 (cpu_layout_min_tier) where ds_fp4_x16's tier is at least ds_fp4's own (an AVX512-F CPU
    without VNNI keeps ds_fp4's avx512f kernel), not under a scalar cap; the repacked executor gives the layout's
    own kernel's bits."""
    banks, (E, H, I) = make_banks("ds_fp4", rng, layers=1)
    act = ACT["ds_fp4"]
    assert ce.CpuMoeExecutor("ds_fp4", banks, top_k=2, threads=1, **act).spec.name == "ds_fp4"
    with pytest.raises(ValueError, match="repack=True: format 'ds_fp4_x16'.*no mode 'native'"):
        ce.CpuMoeExecutor("ds_fp4", banks, top_k=2, threads=1, repack=True, **act)
    ex = ce.CpuMoeExecutor("ds_fp4", banks, top_k=2, threads=1, mode="w4a8", isa="scalar", **act)
    assert ex.spec.name == "ds_fp4"
    ex = ce.CpuMoeExecutor("ds_fp4", banks, top_k=2, threads=2, mode="w4a8", **act)
    tier = lambda f: cf.TIERS.index(cf.selected_tier(f, "w4a8").split("+")[0])  # noqa: E731
    vnni = tier("ds_fp4_x16") >= max(tier("ds_fp4"), cf.TIERS.index("avx2"))
    assert ex.spec.name == ("ds_fp4_x16" if vnni else "ds_fp4") and ex.given_format == "ds_fp4"
    x = rng.standard_normal((3, H)).astype(np.float32)
    w, ids = routing(rng, 3, 2, E)
    want = cf.moe_forward(ex.spec.name, banks[0] if not vnni else cf.repack_ds_fp4_x16(banks[0]), x, w, ids,
                          mode="w4a8", **act)
    np.testing.assert_array_equal(bits(ex.decode(0, x, w, ids)), bits(want))
