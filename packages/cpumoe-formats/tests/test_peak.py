"""cf.peak_loop: the compute roof's instruction loops (abi.h peak_loop, csrc/peak.cpp)."""
import pytest

import cpumoe_formats as cf

# multiply-adds per round: 12 ymm or 24 zmm chains x the instruction's products (ymm 32 int8 / 8 fp32, zmm 64 / 16,
# vdpbf16ps 32, tdpbssd 4 x 16 x 16 x 64, tdpbf16ps 4 x 16 x 16 x 32)
PER_ROUND = {
    "avx2": {"int8": 12 * 32, "bf16": 12 * 8, "fp32": 12 * 8},
    "avxvnni": {"int8": 12 * 32, "bf16": 12 * 8, "fp32": 12 * 8},
    "avx512f": {"int8": 24 * 64, "bf16": 24 * 16, "fp32": 24 * 16},
    "avx512vnni": {"int8": 24 * 64, "bf16": 24 * 16, "fp32": 24 * 16},
    "avx512bf16": {"int8": 24 * 64, "bf16": 24 * 32, "fp32": 24 * 16},
    "amx": {"int8": 4 * 16 * 16 * 64, "bf16": 4 * 16 * 16 * 32, "fp32": 24 * 16},
}


@pytest.mark.parametrize("kind", cf.PEAK_KINDS)
@pytest.mark.parametrize("tier", cf.TIERS)
def test_peak_loop_counts(tier, kind):
    got = cf.peak_loop(kind, tier, 1000)
    if tier == "scalar" or tier not in cf.usable_tiers():
        assert got == 0  # never runs an instruction this machine lacks
    else:
        assert got == 1000 * PER_ROUND[tier][kind]


def test_peak_loop_takes_time_in_proportion():
    """The loop really runs: 8x the rounds take clearly longer (a loop the compiler dropped would take ~0)."""
    import time

    tier = cf.usable_tiers()[-1]
    if tier == "scalar":
        pytest.skip("no SIMD tier here")

    def t(n):
        best = 1e9
        for _ in range(5):
            t0 = time.perf_counter()
            cf.peak_loop("fp32", tier, n)
            best = min(best, time.perf_counter() - t0)
        return best

    assert t(400_000) > 3 * t(50_000)


@pytest.mark.parametrize("args, word", [(("int4", "avx2", 10), "kind"), (("int8", "avx3", 10), "tier"),
                                        (("int8", "avx2", 0), "iters"), (("int8", "avx2", 1.5), "iters")])
def test_peak_loop_rejects(args, word):
    with pytest.raises(ValueError, match=word):
        cf.peak_loop(*args)
