"""The versioned C ABI, exercised by a real C consumer compiled here against the
header from get_include(): matching versions bind and compute the same bits as
the Python entry; a mismatched consumer gets an ImportError naming both versions."""
import importlib.util
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import cpumoe_formats as cf
from cpumoe_formats import _native

HERE = Path(__file__).resolve().parent
CC = os.environ.get("CC", "cc")


def build_consumer(tmp: Path, *defines: str):
    if shutil.which(CC) is None:
        pytest.fail(f"a C compiler ({CC}) is required to test the C ABI")
    so = tmp / ("abi_consumer" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [CC, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-I{sysconfig.get_paths()['include']}",
           f"-I{cf.get_include()}", *defines, str(HERE / "abi_consumer.c"), "-o", str(so)]
    # the compiler runs unsanitized (ci/sanitize.sh preloads a sanitizer runtime that a compiler of another
    # build may crash under)
    subprocess.run(cmd, check=True, capture_output=True, env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    spec = importlib.util.spec_from_file_location("abi_consumer", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_header_ships_with_the_package():
    h = Path(cf.get_include()) / "cpumoe_formats" / "abi.h"
    assert h.is_file()
    text = h.read_text()
    assert f"#define CPUMOE_FORMATS_ABI_MAJOR {cf.ABI_VERSION[0]}" in text
    assert f"#define CPUMOE_FORMATS_ABI_MINOR {cf.ABI_VERSION[1]}" in text
    assert _native.CAPSULE_NAME.endswith(f"_C_API_v{cf.ABI_VERSION[0]}")


def test_matching_consumer_computes_same_bits(tmp_path, rng):
    mod = build_consumer(tmp_path)
    spec = cf.get_format("bf16")
    E, H, I, T, K = 3, 96, 40, 3, 2  # noqa: E741
    banks = spec.random_banks(E, H, I, rng)
    arrays, _ = spec.validate(banks)
    x = cf.aligned_copy(rng.standard_normal((T, H)).astype(np.float32).astype(cf.numerics.BF16))
    ids = np.array([[0, 2], [1, -1], [2, 2]], np.int32)
    w = rng.random((T, K), dtype=np.float32)
    y = np.zeros((T, H), cf.numerics.BF16)
    name = mod.step(spec.id, E, H, I, spec.bank_views(arrays), T, K, x.ctypes.data, ids.ctypes.data, w.ctypes.data,
                    y.ctypes.data)
    assert name == cf.selected_tier("bf16")
    want = cf.moe_forward("bf16", banks, x, w, ids)
    np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))
    bad = ids.copy()
    bad[0, 0] = 3
    with pytest.raises(ValueError, match=r"topk_ids\[0, 0\] = 3"):
        mod.step(spec.id, E, H, I, spec.bank_views(arrays), T, K, x.ctypes.data, bad.ctypes.data, w.ctypes.data,
                 y.ctypes.data)


def test_linear_through_the_c_abi_computes_the_python_entrys_bits(tmp_path, rng):
    mod = build_consumer(tmp_path)
    M, K, n = 45, 133, 3
    w = rng.standard_normal((M, K)).astype(cf.numerics.BF16)
    x = rng.standard_normal((n, K)).astype(cf.numerics.BF16)
    y = np.zeros((n, M), cf.numerics.BF16)
    assert mod.linear(M, K, n, w.ctypes.data, x.ctypes.data, y.ctypes.data) == cf.Linear().name
    np.testing.assert_array_equal(y.view(np.uint16), cf.Linear().forward(x, w).view(np.uint16))


@pytest.mark.parametrize("major,minor", [(0, 0), (2, 0), (1, 99)])
def test_mismatched_consumer_is_refused_naming_both_versions(tmp_path, major, minor):
    have = f"{cf.ABI_VERSION[0]}.{cf.ABI_VERSION[1]}"
    with pytest.raises(ImportError, match=rf"provides ABI {have}.*built against ABI {major}\.{minor}"):
        build_consumer(tmp_path, f"-DWANT_MAJOR={major}", f"-DWANT_MINOR={minor}")
    msg = _native.check_api_as(major, minor, 1 << 10)
    assert have in msg and f"{major}.{minor}" in msg


def test_python_level_require_abi():
    cf.require_abi(*cf.ABI_VERSION)
    with pytest.raises(ImportError, match=rf"provides ABI {cf.ABI_VERSION[0]}\.{cf.ABI_VERSION[1]}.*needs ABI 2\.0"):
        cf.require_abi(2, 0)
