"""CPUMOE_X16_PREFETCH (auto | on | off): the avx512vnni tier's GGUF x16 kernels (q4_0_x16, q4_k_x16, q6_k_x16,
q8_0_x16) with and without their software prefetch give the same bits, auto is off on AMD and on elsewhere, and an
invalid value is an error naming the variable. The process reads the variable once, so each setting runs in its own
subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import IS_AMD, USABLE

import cpumoe_formats as cf

FORMATS = (*cf.X16_PREFETCH_LAYOUTS, "q5_k_x16")  # q5_k_x16: always prefetches, a control
TESTS = Path(__file__).resolve().parent

# Per format, at avx512vnni: whole layers at batch 1 (the lone-token path, two streams a call), 3 and 8 (the token
# blocks), and one down work item's fp32 accumulators (bf16 outputs would hide a reordered fp32 sum), random data
# from a fixed seed; saved to an .npz with the choice cf.x16_prefetch() reports.
_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
from conftest import routes, run_forced
from fp4_helpers import to_bf16_bits
from x16_helpers import down_accumulators
import cpumoe_formats as cf

out = {{}}
for fmt in {formats!r}:
    rng = np.random.default_rng(20261207)
    E, H, I = 4, 768, 512
    b = cf.get_format(fmt).random_banks(E, H, I, rng)
    for T in (1, 3, 8):
        x = rng.standard_normal((T, H)).astype(np.float32)
        w, ids = routes(rng, T, 3, E)
        out[f"{{fmt}}/y{{T}}"] = run_forced(fmt, b, x, w, ids, "w4a8", "avx512vnni")
    gs = to_bf16_bits(rng.standard_normal((5, I)) * rng.uniform(0.01, 10.0, (5, 1)))
    out[f"{{fmt}}/acc"] = down_accumulators(fmt, b, ("avx512vnni",), gs, H, mode="w4a8")[0]
np.savez(sys.argv[1], **out)
print(json.dumps(cf.x16_prefetch()))
"""


def _run(tmp_path, value, script):
    env = {k: v for k, v in os.environ.items() if k != "CPUMOE_X16_PREFETCH"}
    if value is not None:
        env["CPUMOE_X16_PREFETCH"] = value
    return subprocess.run([sys.executable, "-c", script, str(tmp_path / f"{value}.npz")], capture_output=True,
                          text=True, env=env, timeout=300)


def _outputs(tmp_path, value):
    r = _run(tmp_path, value, _SCRIPT.format(tests=str(TESTS), formats=FORMATS))
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / f"{value}.npz") as z:
        return json.loads(r.stdout.strip().splitlines()[-1]), {k: z[k] for k in z.files}


def test_on_and_off_are_bit_identical(tmp_path):
    if "avx512vnni" not in USABLE:
        pytest.skip("this CPU/OS lacks the avx512vnni tier")
    on_choice, on = _outputs(tmp_path, "on")
    off_choice, off = _outputs(tmp_path, "off")
    assert on_choice == {"prefetch": "on", "why": "CPUMOE_X16_PREFETCH=on"}
    assert off_choice == {"prefetch": "off", "why": "CPUMOE_X16_PREFETCH=off"}
    assert on.keys() == off.keys() and len(on) == 4 * len(FORMATS)
    for key in on:
        assert np.isfinite(on[key]).all(), key
        np.testing.assert_array_equal(on[key].view(np.uint64 if on[key].dtype == np.float64 else np.uint32),
                                      off[key].view(np.uint64 if off[key].dtype == np.float64 else np.uint32),
                                      err_msg=key)


CHOICE = "import json, cpumoe_formats as cf; print(json.dumps(cf.x16_prefetch()))"


@pytest.mark.parametrize("value", [None, "", "auto"])
def test_auto_is_off_on_amd(tmp_path, value):
    r = _run(tmp_path, value, CHOICE)
    assert r.returncode == 0, r.stderr
    choice = json.loads(r.stdout)
    assert choice["prefetch"] == ("off" if IS_AMD else "on")
    assert choice["why"].startswith("auto: ") and ("AuthenticAMD" in choice["why"]) == (
        "AuthenticAMD" in Path("/proc/cpuinfo").read_text())


@pytest.mark.parametrize("value", ["sometimes", "ON", "1"])
def test_invalid_value_is_an_error(tmp_path, value):
    script = f"""
import cpumoe_formats as cf
msg = "CPUMOE_X16_PREFETCH={value} is not valid; expected one of auto, on, off"
for call in (cf.x16_prefetch, lambda: cf.Kernel("q4_k_x16", 2, 256, 256), lambda: cf.Kernel("bf16", 2, 64, 64)):
    try:
        call()
    except ValueError as e:
        assert str(e) == msg, (str(e), msg)
    else:
        raise SystemExit("no error")
print("ok")
"""
    r = _run(tmp_path, value, script)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
