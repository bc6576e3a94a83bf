"""Run-time tier dispatch: CPUMOE_ISA caps the ladder, unknown values are
errors, and every forced tier gives the name of the kernel that really runs."""
import os
import subprocess
import sys

import pytest
from conftest import USABLE, expected_name

import cpumoe_formats as cf
from cpumoe_formats import _native


def _real_formats():
    return [n for n, s in cf.FORMATS.items() if s.banks]


def test_usable_tiers_are_a_ladder_prefix_of_detected():
    assert "scalar" in USABLE
    assert cf.detected_tier() == max(USABLE, key=cf.TIERS.index)


@pytest.mark.parametrize("fmt", _real_formats())
@pytest.mark.parametrize("forced", cf.TIERS)
def test_forced_tier_reports_what_runs(fmt, forced):
    spec = cf.get_format(fmt)
    for mode in spec.modes:
        want = expected_name(fmt, mode, forced)
        assert cf.selected_tier(fmt, mode=mode, isa=forced) == want


@pytest.mark.parametrize("fmt", _real_formats())
def test_env_cap_matches_isa_argument(fmt, monkeypatch):
    for forced in cf.TIERS:
        monkeypatch.setenv("CPUMOE_ISA", forced)
        assert cf.selected_tier(fmt) == expected_name(fmt, cf.get_format(fmt).default_mode, forced)
    for auto in ("auto", ""):
        monkeypatch.setenv("CPUMOE_ISA", auto)
        assert cf.selected_tier(fmt) == expected_name(fmt, cf.get_format(fmt).default_mode, cf.TIERS[-1], auto=True)


@pytest.mark.parametrize("fmt", _real_formats())
def test_every_kernel_tier_of_the_spec_is_in_the_native_table(fmt):
    """Every tier a format's spec lists a kernel for (any mode) has an init function in this build's native table
    when the build compiled that tier, and no other tier has one: checked without the hardware, so a kernel
    compiled but left out of the registry (it would silently run the tier below) fails here, not on the host."""
    from cpumoe_formats import _native

    spec = cf.get_format(fmt)
    built = set(cf.BUILD_INFO.split("tiers=")[1].split()[0].split(","))
    mask = _native.variant_tier_mask(spec.id)
    have = {t for i, t in enumerate(cf.TIERS) if mask >> i & 1}
    want = {t for tiers in spec.kernel_tiers.values() for t in tiers if t in built}
    assert want <= have, f"{fmt}: spec kernels at {sorted(want - have)} have no init function in the registry"
    assert have <= built, f"{fmt}: init functions at tiers this build did not compile: {sorted(have - built)}"


OPT_IN = [(f, t) for f in _real_formats() for t in cf.get_format(f).opt_in_tiers]


def test_tile_kernels_of_quantized_formats_are_opt_in():
    assert ("fp8_block", "amx") in OPT_IN and ("q4_0", "amx") in OPT_IN


@pytest.mark.parametrize("fmt,tier", OPT_IN)
def test_opt_in_tiers_run_only_by_name(fmt, tier, monkeypatch):
    """An opt-in kernel (fp8_block amx, q4_0 amx+w4a8): never picked by auto; picked when its tier is named
    (argument or CPUMOE_ISA) on a CPU that has the tier. Compared on the tier part of the kernel name."""
    spec = cf.get_format(fmt)

    def selected(**kw):
        return cf.selected_tier(fmt, **kw).split("+")[0]

    assert tier in spec.kernel_tiers[spec.default_mode]
    for auto in (None, "", "auto"):
        if auto is None:
            monkeypatch.delenv("CPUMOE_ISA", raising=False)
        else:
            monkeypatch.setenv("CPUMOE_ISA", auto)
        assert selected() != tier
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier (auto's side was checked)")
    monkeypatch.delenv("CPUMOE_ISA")
    assert selected(isa=tier) == tier
    monkeypatch.setenv("CPUMOE_ISA", tier)
    assert selected() == tier


AMD_AUTO = [(f, t) for f in _real_formats() for t in cf.get_format(f).amd_auto_tiers]


@pytest.mark.parametrize("fmt,tier", AMD_AUTO)
def test_amd_auto_tiers(fmt, tier, monkeypatch):
    """A tier auto picks only on AMD CPUs (fp8_block avx512bf16): auto picks it there (where usable), never
    elsewhere; named, it runs on any CPU that has it."""
    if tier not in USABLE:
        pytest.skip(f"this CPU/OS lacks the {tier} tier")
    monkeypatch.delenv("CPUMOE_ISA", raising=False)
    auto = cf.selected_tier(fmt).split("+")[0]
    assert (auto == tier) == bool(_native.cpu_is_amd()), (auto, _native.cpu_is_amd())
    assert cf.selected_tier(fmt, isa=tier).split("+")[0] == tier


def test_unknown_env_value_is_an_error(monkeypatch):
    monkeypatch.setenv("CPUMOE_ISA", "avx1024")
    with pytest.raises(ValueError, match="CPUMOE_ISA=avx1024"):
        cf.Kernel("bf16", 2, 64, 64)


def test_unknown_isa_argument_is_an_error():
    with pytest.raises(ValueError, match="isa='sse9'"):
        cf.Kernel("bf16", 2, 64, 64, isa="sse9")


def test_tier_is_logged_per_kernel():
    k = cf.Kernel("bf16", 2, 64, 64)
    assert k.name == k.tier and k.tier in USABLE


def test_debug_info_line():
    out = subprocess.run([sys.executable, "-c", "import cpumoe_formats"], capture_output=True, text=True,
                         env={**os.environ, "CPUMOE_DEBUG_INFO": "1"})
    assert out.returncode == 0, out.stderr
    assert "usable tiers" in out.stdout and f"ABI {cf.ABI_VERSION}" in out.stdout

