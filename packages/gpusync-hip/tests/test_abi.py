"""The versioned C ABI on the HIP backend: the one gpusync/abi.h (found through
gpusync_hip.get_include(), shipped by cpumoe-executor) builds a real C consumer that
binds gpusync_hip's capsule (backend "hip"; ABI 1.1, and a 1.0 consumer too: entries
are only appended), a mismatched one is refused naming both versions, and kernelio's
services (module load, function, launch, memory, copy, bounded sync) run through the
table on the fake runtime's fake kernel."""

import importlib.util
import json
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from conftest import run_py

import cpumoe_executor as ce
import gpusync_hip

HERE = Path(__file__).resolve().parent
CC = os.environ.get("CC", "cc")


def build_consumer(tmp: Path, *defines: str) -> Path:
    if shutil.which(CC) is None:
        pytest.fail(f"a C compiler ({CC}) is required to test the C ABI")
    so = tmp / ("abi_consumer_hip" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [
        CC,
        "-shared",
        "-fPIC",
        "-O1",
        "-Wall",
        "-Werror",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{gpusync_hip.get_include()}",
        f"-I{ce.get_include()}",
        *defines,
        str(HERE / "abi_consumer.c"),
        "-o",
        str(so),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return so


def load(so: Path):
    spec = importlib.util.spec_from_file_location("abi_consumer_hip", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_one_shared_header():
    text = (Path(gpusync_hip.get_include()) / "gpusync" / "abi.h").read_text()
    assert '#define GPUSYNC_HIP_CAPSULE_NAME "gpusync_hip._native._C_API_v1"' in text
    assert f"#define GPUSYNC_ABI_MAJOR {gpusync_hip.ABI_VERSION[0]}" in text
    assert f"#define GPUSYNC_ABI_MINOR {gpusync_hip.ABI_VERSION[1]}" in text
    assert text.index("(*memcpy_async)") < text.index("(*step_submit)") < text.index("(*step_finish)")
    import cpumoe_executor

    assert gpusync_hip.get_include() == cpumoe_executor.get_include()  # the same file, not a copy
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("gpusync-hip") or []
    except PackageNotFoundError:  # an in-place build: the claim is about the installed wheel's metadata
        pytest.skip("gpusync-hip is not installed (in-place build)")
    assert not [r for r in reqs if r.startswith("gpusync-cuda")], f"gpusync-hip must not need gpusync-cuda: {reqs}"


def test_matching_consumer_binds(tmp_path):
    mod = load(build_consumer(tmp_path))
    assert mod.bind() == (*gpusync_hip.ABI_VERSION, "hip", "memop")


def test_consumer_built_for_1_1_binds_the_split(tmp_path):
    assert gpusync_hip.ABI_VERSION == (1, 1)
    mod = load(build_consumer(tmp_path, "-DWANT_MINOR=1"))
    assert mod.bind() == (1, 1, "hip", "memop")
    assert mod.has_split() == (True, True)


def test_consumer_built_for_1_0_still_binds(tmp_path):
    """A 1.0 consumer (minor 0, the 1.0 table's size) binds the 1.1 table: entries were only appended."""
    mod = load(build_consumer(tmp_path, "-DWANT_MINOR=0", "-DWANT_SIZE=offsetof(gpusync_api,step_submit)"))
    assert mod.bind() == (1, 1, "hip", "memop")


@pytest.mark.parametrize(
    "defines, want", [(["-DWANT_MAJOR=2"], "2.1"), (["-DWANT_MINOR=2"], "1.2"), (["-DWANT_MINOR=7"], "1.7")]
)
def test_mismatched_consumer_names_both_versions(tmp_path, defines, want):
    mod = load(build_consumer(tmp_path, *defines))
    with pytest.raises(ImportError) as e:
        mod.bind()
    msg = str(e.value)
    assert "provides ABI 1.1" in msg and f"built against ABI {want}" in msg and "gpusync-hip" in msg


def test_kernel_services_through_the_table(tmp_path, fake_hip):
    so = build_consumer(tmp_path)
    code = f"""
import importlib.util, json
spec = importlib.util.spec_from_file_location("abi_consumer_hip", {str(so)!r})
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
from gpusync_hip import _native
ok = mod.fill(b"FAKEHIP-MODULE\\0", 16, 0xC0FFEE)
bad = mod.fill(b"not a code object", 4, 1)
print(json.dumps({{"ok": ok, "bad": bad, "peek": _native._peek_error()}}))
"""
    r = run_py(code, env={"GPUSYNC_HIP_LIBRARY": str(fake_hip("full"))})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] == [0, "", [0xC0FFEE] * 16]
    rc, msg, vals = out["bad"]
    assert rc == 209 and msg == "hipModuleLoadData failed: hipErrorNoBinaryForGpu" and vals == []
    assert out["peek"] == 0  # the failed load's error was reported, then consumed


def test_no_runtime_through_the_table(tmp_path):
    so = build_consumer(tmp_path)
    r = run_py(
        f"""
import importlib.util
spec = importlib.util.spec_from_file_location("abi_consumer_hip", {str(so)!r})
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
print(mod.open_device())
""",
        env={"GPUSYNC_HIP_LIBRARY": "/nonexistent/libamdhip64.so"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("(-1, 'no HIP runtime: dlopen(")
