"""The executor's versioned C ABI through a real C consumer compiled here (what
gpusync-* do): a matching build drives the host-function entry points; a
mismatched one is refused with both versions named."""
import importlib.util
import os
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from conftest import bits, make_banks, reference, routing

import cpumoe_executor as ce
import cpumoe_formats as cf
from cpumoe_executor import _native

HERE = Path(__file__).resolve().parent


def build(tmp: Path, *defines):
    so = tmp / ("exec_consumer" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-Wall", "-Werror",
                    f"-I{sysconfig.get_paths()['include']}", f"-I{ce.get_include()}", *defines,
                    str(HERE / "abi_consumer.c"), "-o", str(so)], check=True, capture_output=True,
                   env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})  # the compiler: unsanitized
    spec = importlib.util.spec_from_file_location("exec_consumer", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("coordinated", [False, True])
def test_consumer_runs_a_task_through_the_hostfn_entries(tmp_path, rng, coordinated):
    mod = build(tmp_path)
    banks, (E, H, I) = make_banks("bf16", rng)
    ex = ce.CpuMoeExecutor("bf16", banks, top_k=2, max_tokens=4)
    if coordinated:
        ex.start_coordinator()
    a = ex.io_arrays()
    x = rng.standard_normal((3, H)).astype(np.float32).astype(cf.numerics.BF16)
    w, ids = routing(rng, 3, 2, E)
    a["x"][:3], a["ids"][:3], a["w"][:3] = x, ids, w
    assert mod.run(ex.handle, 1, 3) == (_native.IOB_MAGIC, ce.PROTOCOL_VERSION)
    np.testing.assert_array_equal(bits(a["y"][:3]), bits(reference(ex, banks, 1, x, w, ids)))
    with pytest.raises(ValueError, match="refused"):
        mod.run(ex.handle, 2, 1)
    ex.stop_coordinator()


@pytest.mark.parametrize("major,minor", [(0, 0), (2, 0), (1, 7)])
def test_mismatched_consumer_is_refused(tmp_path, major, minor):
    have = f"{ce.ABI_VERSION[0]}.{ce.ABI_VERSION[1]}"
    with pytest.raises(ImportError, match=rf"provides ABI {have} \(protocol v1\).*built against ABI {major}\.{minor}"):
        build(tmp_path, f"-DWANT_MAJOR={major}", f"-DWANT_MINOR={minor}")


def test_formats_abi_is_checked_at_import():
    assert _native.FORMATS_ABI == cf.ABI_VERSION
