"""combine's in-kernel wait without a GPU: the PTX nvcc makes of the kernel
source polls done with a system-scope acquire load in a loop bounded by
%globaltimer and releases the block with a barrier before any read of y, the
packaged fatbin's SASS keeps the system-scope load, and the host-side choice of
wait (KERNELIO_WAIT, probe_wait) reports instead of failing on a machine
without a GPU."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_py

import kernelio

PKG_DIR = Path(__file__).resolve().parent.parent


def _nvcc() -> str:
    for c in ("/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if c and Path(c).is_file():
            return c
    pytest.skip("nvcc is not installed here")


def _entry(ptx: str, name: str) -> str:
    """The body of one .entry in a PTX module."""
    m = re.search(r"\.entry " + name + r"\b.*?\n\}\n", ptx, flags=re.S)
    assert m, f"no .entry {name} in the PTX"
    return m.group(0)


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> str:
    src = PKG_DIR / "kernels" / "kernelio.cu"
    if not src.is_file():
        pytest.skip("needs the monorepo checkout (kernels/kernelio.cu is not in the wheel)")
    out = tmp_path_factory.mktemp("ptx") / "kernelio.ptx"
    inc = [f"-I{PKG_DIR / 'kernels'}", f"-I{kernelio.get_include()}"]
    subprocess.run([_nvcc(), "-ptx", "-std=c++17", "-O3", "-arch=compute_75", *inc, str(src), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    return out.read_text()


def test_combine_polls_done_with_a_system_scope_acquire_in_a_bounded_loop(ptx):
    body = _entry(ptx, "kernelio_combine")
    lines = body.splitlines()
    acq = [i for i, ln in enumerate(lines) if "ld.acquire.sys" in ln]
    assert len(acq) == 1, "combine must poll done with exactly one ld.acquire.sys (system-scope acquire)"
    # A loop: a branch after the load jumps back to a label before it.
    labels = {ln.strip().rstrip(":"): i for i, ln in enumerate(lines) if re.match(r"^\$L\w+:$", ln.strip())}
    back = [i for i, ln in enumerate(lines) if (m := re.search(r"\bbra(\.uni)?\s+(\$L\w+);", ln))
            and i > acq[0] and labels.get(m.group(2), 1 << 30) <= acq[0]]
    assert back, "the acquire load is not inside a loop"
    assert body.count("%globaltimer") >= 2, "the poll must be bounded by %globaltimer (start + each round)"
    assert re.search(r"atom\.global\.add\.u32", body), "a timeout must be counted in scratch[2]"
    # Every thread's read of y (ld.global.cv) comes after the block barrier that follows the poll.
    bar = [i for i, ln in enumerate(lines) if "bar.sync" in ln]
    cv = [i for i, ln in enumerate(lines) if "ld.global.cv" in ln]
    assert bar and cv and acq[0] < bar[0] < min(cv), (acq, bar, cv)


def test_publish_fences_once_per_block_after_its_barrier(ptx):
    """CUDA publish tail: every thread's payload, then the block barrier (which also ORs "any CPU route"),
    then one thread's system fence; a launch of one block has no counter and fences once before the
    doorbell, several blocks count themselves (one atomic) and the last fences once more."""
    body = _entry(ptx, "kernelio_publish").splitlines()
    fences = [i for i, ln in enumerate(body) if re.search(r"\b(membar\.sys|fence\.sc\.sys)\b", ln)]
    bar = [i for i, ln in enumerate(body) if re.search(r"\bbar\.(red\.or|sync)\b", ln)]
    atom = [i for i, ln in enumerate(body) if "atom.global.add" in ln]
    stores = [i for i, ln in enumerate(body) if "st.volatile.global.u64" in ln]  # done := 0; done := 1 / ready
    assert len(fences) == 2, f"publish must hold exactly two system fences (block, last block), got {len(fences)}"
    assert bar[0] < fences[0] < atom[0] < fences[1], "barrier -> fence -> block counter -> last block's fence"
    assert len(stores) == 3 and stores[0] < bar[0] and min(stores[1:]) > fences[1]


def test_combine_has_one_pcie_poller_per_launch(ptx):
    """Block 0 passes done on with a device-scope release; the other blocks acquire it in a bounded loop, and the
    last block to leave clears it (a counter): one system-scope poll per launch, not one per block."""
    body = _entry(ptx, "kernelio_combine")
    assert body.count("st.release.gpu") == 1 and body.count("ld.acquire.gpu") == 1
    assert body.count("ld.acquire.sys") == 1
    assert len(re.findall(r"atom\.global\.add\.u32", body)) >= 2, "the leave counter and the timeout count"


def test_publish_does_not_poll(ptx):
    body = _entry(ptx, "kernelio_publish")
    assert "ld.acquire" not in body and "%globaltimer" not in body


def test_fatbin_sass_keeps_the_system_scope_poll(tmp_path):
    """Each packaged SASS target's combine holds a .STRONG.SYS load (the acquire) and every target is built."""
    if shutil.which("cuobjdump") is None:
        pytest.skip("cuobjdump is not installed here")
    if not kernelio.fatbin_path().is_file():
        pytest.skip("built without nvcc (KERNELIO_SKIP_FATBIN=1): no fatbin")
    f = tmp_path / "k.fatbin"
    f.write_bytes(kernelio.image())
    sass = kernelio.build_info()["sass"]  # all five unless this nvcc refused some (test_build checks that)
    assert sass
    for arch in sass:
        r = subprocess.run(["cuobjdump", "-sass", "-arch", arch, "-fun", "kernelio_combine", str(f)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert re.search(r"\bLDG?\.E\.64\.STRONG\.SYS\b", r.stdout), f"{arch}: no system-scope 64-bit load"


# The system-scope acquire of the poll per AMD target family: a load bypassing the non-coherent caches,
# then the invalidation that makes later loads miss them (AMDGPU memory model, load atomic acquire system).
HIP_ACQUIRE = {"gfx90a": (("glc",), "buffer_invl2"), "gfx1030": (("glc", "dlc"), "buffer_gl1_inv")}


def test_hip_combine_polls_with_a_system_scope_acquire(tmp_path):
    from test_hip import bundle_entries, hip_image, objdump

    data = hip_image()
    tool = objdump()
    if tool is None:
        pytest.skip("llvm-objdump is not installed here")
    checked = 0
    for triple, co in bundle_entries(data).items():
        target = triple.rsplit("--", 1)[-1]
        if target not in HIP_ACQUIRE:
            continue
        f = tmp_path / f"{target}.co"
        f.write_bytes(co)
        asm = subprocess.run([tool, "-d", f"--mcpu={target}", str(f)], capture_output=True, text=True,
                             check=True).stdout
        body = re.search(r"<kernelio_combine>:\n(.*?)(\n\n|\Z)", asm, flags=re.S).group(1).splitlines()
        bits, inv = HIP_ACQUIRE[target]
        polls = [i for i, ln in enumerate(body)
                 if re.search(r"load_dwordx2\s", ln) and all(b in ln.split() for b in bits)]
        assert len(polls) == 1, (target, "the poll of done: one 64-bit load bypassing the caches", polls)
        assert any(inv in ln for ln in body[polls[0]:polls[0] + 6]), (target, f"no {inv} after the poll (acquire)")
        assert sum("s_memrealtime" in ln for ln in body) >= 2, (target, "the poll is not bounded by wall_clock64")
        bar = [i for i, ln in enumerate(body) if "s_barrier" in ln]
        assert bar and bar[0] > polls[0], (target, "no block barrier after the poll")
        checked += 1
    if not checked:
        pytest.skip(f"no code object for {sorted(HIP_ACQUIRE)} in this image")


def test_kernel_source_spells_the_wait_through_vendor_h():
    src = PKG_DIR / "kernels" / "kernelio.cu"
    if not src.is_file():
        pytest.skip("needs the monorepo checkout")
    code = src.read_text()
    assert "kio_load_acquire_system(" in code and "kio_time_ns()" in code
    hip, cuda = src.with_name("vendor.h").read_text().split("#else", 1)
    assert "ld.acquire.sys" in cuda and "%%globaltimer" in cuda
    assert "__ATOMIC_ACQUIRE" in hip and "wall_clock64()" in hip


def test_wait_override(monkeypatch):
    monkeypatch.delenv("KERNELIO_WAIT", raising=False)
    assert kernelio.wait_override() is None
    for v in kernelio.WAITS:
        monkeypatch.setenv("KERNELIO_WAIT", v)
        assert kernelio.wait_override() == v
    monkeypatch.setenv("KERNELIO_WAIT", "spin")
    with pytest.raises(ValueError, match=r"KERNELIO_WAIT='spin'; expected one of \['poll', 'memop'\]"):
        kernelio.wait_override()


@pytest.mark.parametrize("forced", ["", "poll", "memop"])
def test_probe_wait_without_gpu_reports_no_variant(fake_libcuda, forced):
    r = run_py("""
import gpusync_cuda as g, kernelio
from gpusync_cuda import _native
d = _native.Device(0)
print(repr(kernelio.probe_wait(g.C_API_CAPSULE, d.handle)))
""", env={"GPUSYNC_LIBCUDA": str(fake_libcuda), "KERNELIO_WAIT": forced})
    assert r.returncode == 0, r.stderr
    wait, msg = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr of a tuple of str/None
    assert wait is None and "kernelio probe failed at module load" in msg, (wait, msg)
