"""Self-contained build of kernelio (hatchling hook and script).

Three products, none needing a GPU on the build machine:
  * kernels/kernelio.cu -> src/kernelio/kernels/kernelio.fatbin by nvcc: SASS for
    each of KERNELIO_CUDA_ARCHS that this nvcc accepts plus compute_75 PTX, and
    kernelio.json recording what was built (and what this nvcc refused). It is
    package data, loaded at run time with cuModuleLoadData through gpusync-cuda.
  * the same source -> src/kernelio/kernels/kernelio.hipfb by hipcc (HIP_PLATFORM=amd):
    a clang offload bundle with one code object per AMD target this toolchain
    accepts (each probed first), and kernelio.hipfb.json; loaded with
    hipModuleLoadData through gpusync-hip. Built when a HIP toolchain is found.
  * csrc/*.cpp -> kernelio._native (host launchers) by the C++ compiler; it
    includes gpusync/abi.h and links no GPU library.

Environment:
  NVCC                 nvcc to use (default: $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, PATH)
  KERNELIO_CUDA_ARCHS  comma list, default "sm_75,sm_80,sm_90,sm_100,sm_120,compute_75";
                       e.g. "compute_75" builds a PTX-only image (the JIT-fallback tests use it)
  KERNELIO_FATBIN_OUT  write the fatbin elsewhere (tests build variants)
  KERNELIO_SKIP_FATBIN=1  build without nvcc (CPU-only CI): the package imports, its kernel
                       path reports "no kernel image" and gpusync-cuda decodes with copies
  HIPCC                hipcc to use (default: $ROCM_PATH/bin, $HIP_PATH/bin, /opt/rocm/bin, PATH)
  KERNELIO_HIP_ARCHS   AMD targets, ';' or ',' separated (else PYTORCH_ROCM_ARCH, as PyTorch spells it;
                       else gfx942;gfx1100;gfx1201, or gfx90a;gfx1030 when the toolchain takes none of those)
  KERNELIO_HIP=1       a HIP image is required: no toolchain or no accepted target is a build error
                       (also implied by KERNELIO_HIP_ARCHS / PYTORCH_ROCM_ARCH)
  KERNELIO_SKIP_HIP=1  never build the HIP image
  KERNELIO_HIP_OUT     write the HIP bundle elsewhere (tests build variants)
  CXX, CPUMOE_DEBUG=1, CPUMOE_BUILD_JOBS
Run `python hatch_build.py` for an in-place build.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
KERNELS = HERE / "kernels"
PKG = HERE / "src" / "kernelio"
DEFAULT_ARCHS = "sm_75,sm_80,sm_90,sm_100,sm_120,compute_75"


SIBLING = HERE.parent / "cpumoe-executor" / "src" / "cpumoe_executor" / "include"


def executor_include() -> str:
    """cpumoe_executor/abi.h and gpusync/abi.h, both shipped by cpumoe-executor."""
    try:
        import cpumoe_executor

        return cpumoe_executor.get_include()
    except ImportError:
        if (SIBLING / "gpusync" / "abi.h").is_file():
            return str(SIBLING)
        raise RuntimeError("kernelio needs gpusync/abi.h from cpumoe-executor: install it first or build from the "
                           "monorepo") from None


def find_nvcc() -> str:
    for c in (os.environ.get("NVCC"), os.environ.get("CUDA_HOME") and f"{os.environ['CUDA_HOME']}/bin/nvcc",
              "/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if c and Path(c).is_file():
            return c
    raise RuntimeError("kernelio: nvcc not found (set NVCC or CUDA_HOME); it is needed to build the CUDA kernels")


def _nvcc_lists(nvcc: str) -> tuple[set[str], set[str], str]:
    code = set(subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True).stdout.split())
    arch = set(subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout.split())
    ver = re.findall(r"release [\d.]+, V([\d.]+)", subprocess.run([nvcc, "--version"], capture_output=True,
                                                                    text=True).stdout)
    return code, arch, ver[0] if ver else "?"


def build_fatbin(out: Path | None = None, archs: str | None = None) -> Path:
    nvcc = find_nvcc()
    out = Path(out or os.environ.get("KERNELIO_FATBIN_OUT") or PKG / "kernels" / "kernelio.fatbin")
    out.parent.mkdir(parents=True, exist_ok=True)
    wanted = [a.strip() for a in (archs or os.environ.get("KERNELIO_CUDA_ARCHS") or DEFAULT_ARCHS).split(",")
              if a.strip()]
    code, arch, version = _nvcc_lists(nvcc)
    sass = [a for a in wanted if a.startswith("sm_") and a in code and f"compute_{a[3:]}" in arch]
    ptx = [a for a in wanted if a.startswith("compute_") and a in arch]
    refused = [a for a in wanted if a not in sass + ptx]
    if not sass and not ptx:
        raise RuntimeError(f"kernelio: nvcc {version} accepts none of {wanted}")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in sass] + \
              [f"-gencode=arch={a},code={a}" for a in ptx]
    cmd = [nvcc, "-fatbin", "-std=c++17", "-O3", f"-I{KERNELS}", f"-I{PKG / 'include'}", *gencode,
           str(KERNELS / "kernelio.cu"), "-o", str(out)]
    print(f"[kernelio] nvcc {version}: SASS {sass}, PTX {ptx}" + (f", refused {refused}" if refused else ""),
          file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvcc failed: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    meta = {"sass": sass, "ptx": ptx, "requested": wanted, "refused_by_nvcc": refused, "nvcc": version,
            "source": "kernels/kernelio.cu"}
    out.with_name(out.stem + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


def build_ext(out_dir: Path = PKG) -> Path:
    import pybind11

    cxx = shlex.split(os.environ.get("CXX", "c++"))
    debug = os.environ.get("CPUMOE_DEBUG") == "1"
    inc = [CSRC, PKG / "include", executor_include(), pybind11.get_include(),
           sysconfig.get_paths()["include"]]
    flags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-O1" if debug else "-O2",
             "-g" if debug else "-g0"] + [f"-I{p}" for p in inc]
    obj_dir = HERE / "build" / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    def compile_one(src: Path) -> str:
        obj = obj_dir / f"{src.stem}.o"
        cmd = cxx + flags + ["-c", str(src), "-o", str(obj)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        return str(obj)

    with ThreadPoolExecutor(int(os.environ.get("CPUMOE_BUILD_JOBS", "0")) or os.cpu_count() or 2) as ex:
        objs = list(ex.map(compile_one, sorted(CSRC.glob("*.cpp"))))
    target = out_dir / f"_native{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    r = subprocess.run(cxx + ["-shared", "-o", str(target)] + objs, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"link failed\n{r.stdout}{r.stderr}")
    return target


# ---- HIP: the same kernel source as a code-object bundle for hipModuleLoadData ----
HIP_DEFAULT_ARCHS = ("gfx942", "gfx1100", "gfx1201")  # MI300, RDNA3, RDNA4
HIP_FALLBACK_ARCHS = ("gfx90a", "gfx1030")  # MI200, RDNA2: what older toolchains (Debian's hipcc 5.2) build
_PROBE_SRC = ('#include <hip/hip_runtime.h>\n'
              'extern "C" __global__ void kio_probe(unsigned long long* p) { __threadfence_system(); *p = 1; }\n')


def find_hipcc() -> str | None:
    for c in (os.environ.get("HIPCC"), *(os.environ.get(v) and f"{os.environ[v]}/bin/hipcc" for v in
                                         ("ROCM_PATH", "HIP_PATH")), "/opt/rocm/bin/hipcc", shutil.which("hipcc")):
        if c and Path(c).is_file():
            return c
    return None


def hip_archs_from_env() -> tuple[list[str], str] | None:
    """The explicit target list and the variable it came from, or None (use the defaults)."""
    for var in ("KERNELIO_HIP_ARCHS", "PYTORCH_ROCM_ARCH"):
        v = os.environ.get(var, "").strip()
        if v:
            return [a for a in re.split(r"[;,\s]+", v) if a], var
    return None


def _hip_env() -> dict:
    # With nvcc on PATH and no AMD GPU, hipcc would pick the NVIDIA platform: say AMD explicitly.
    return dict(os.environ, HIP_PLATFORM="amd")


def _hipcc_version(hipcc: str) -> str:
    out = subprocess.run([hipcc, "--version"], capture_output=True, text=True, env=_hip_env()).stdout
    m = re.search(r"HIP version: (\S+)", out)
    return m.group(1) if m else "?"


def _hip_flags(archs: list[str]) -> list[str]:
    return ["--genco", "-O3", "-std=c++17", *(f"--offload-arch={a}" for a in archs)]


def probe_hip_arch(hipcc: str, arch: str, tmp: Path) -> str | None:
    """None when this toolchain builds device code for `arch` (device libraries included), else why not."""
    src = tmp / "probe.hip"
    src.write_text(_PROBE_SRC)
    r = subprocess.run([hipcc, *_hip_flags([arch]), str(src), "-o", str(tmp / f"probe-{arch}.co")],
                       capture_output=True, text=True, env=_hip_env())
    if r.returncode == 0:
        return None
    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if "error" in ln]
    return (lines[0] if lines else f"hipcc exit {r.returncode}").strip()[:300]


def choose_hip_targets(groups: list[list[str]], probe) -> tuple[list[str], dict[str, str]]:
    """(accepted, {refused: why}): each group's targets that probe(target) accepts (None = accepted);
    a later group (the fallback) is tried only when no target of the earlier ones was accepted."""
    accepted: list[str] = []
    refused: dict[str, str] = {}
    for group in groups:
        for a in group:
            why = probe(a)
            if why is None:
                accepted.append(a)
            else:
                refused[a] = why
        if accepted:
            break
    return accepted, refused


def build_hip_bundle(out: Path | None = None, archs: list[str] | None = None) -> Path:
    """kernelio.cu -> a clang offload bundle of the accepted targets (+ .json of what was built and refused)."""
    hipcc = find_hipcc()
    if hipcc is None:
        raise RuntimeError("kernelio: a HIP image was requested but no hipcc was found (set HIPCC or ROCM_PATH; "
                           "Debian/Ubuntu: apt-get install hipcc libamdhip64-dev; or KERNELIO_SKIP_HIP=1)")
    out = Path(out or os.environ.get("KERNELIO_HIP_OUT") or PKG / "kernels" / "kernelio.hipfb")
    out.parent.mkdir(parents=True, exist_ok=True)
    explicit = hip_archs_from_env()
    if archs is not None:
        explicit = (list(archs), "archs argument")
    candidates = [explicit[0]] if explicit else [list(HIP_DEFAULT_ARCHS), list(HIP_FALLBACK_ARCHS)]
    version = _hipcc_version(hipcc)
    tmp = HERE / "build" / "hip-probe"
    tmp.mkdir(parents=True, exist_ok=True)
    accepted, refused = choose_hip_targets(candidates, lambda a: probe_hip_arch(hipcc, a, tmp))
    for a, why in refused.items():
        print(f"[kernelio] hipcc {version} cannot build {a}, dropped: {why}", file=sys.stderr)
    if not accepted:
        src = f" (from {explicit[1]})" if explicit else ""
        raise RuntimeError(f"kernelio: hipcc {version} ({hipcc}) accepts none of the AMD targets "
                           f"{[a for g in candidates for a in g]}{src}: " +
                           "; ".join(f"{a}: {w}" for a, w in refused.items()) +
                           ". Set KERNELIO_HIP_ARCHS to targets it supports, or KERNELIO_SKIP_HIP=1")
    cmd = [hipcc, *_hip_flags(accepted), f"-I{KERNELS}", f"-I{PKG / 'include'}", str(KERNELS / "kernelio.cu"),
           "-o", str(out)]
    print(f"[kernelio] hipcc {version}: AMD targets {accepted}", file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True, env=_hip_env())
    if r.returncode:
        raise RuntimeError(f"hipcc failed: HIP_PLATFORM=amd {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    meta = {"targets": accepted, "tried": [a for g in candidates for a in g], "refused_by_hipcc": refused,
            "hipcc": version, "source": "kernels/kernelio.cu"}
    Path(str(out) + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


def maybe_build_hip() -> Path | None:
    """The HIP bundle when a toolchain is here (or required), None with a note otherwise."""
    if os.environ.get("KERNELIO_SKIP_HIP") == "1":
        print("[kernelio] KERNELIO_SKIP_HIP=1: no HIP image in this build", file=sys.stderr)
        return None
    required = os.environ.get("KERNELIO_HIP") == "1" or hip_archs_from_env() is not None
    if not required and find_hipcc() is None:
        print("[kernelio] no hipcc found: no HIP image in this build (KERNELIO_HIP=1 makes that an error)",
              file=sys.stderr)
        return None
    try:
        return build_hip_bundle()
    except RuntimeError as e:
        if required:
            raise
        print(f"[kernelio] no HIP image in this build: {e}", file=sys.stderr)
        return None


def build() -> list[Path | None]:
    skip = os.environ.get("KERNELIO_SKIP_FATBIN") == "1"
    if skip:
        print("[kernelio] KERNELIO_SKIP_FATBIN=1: no kernel image in this build", file=sys.stderr)
    return [None if skip else build_fatbin(), maybe_build_hip(), build_ext()]


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:
    BuildHookInterface = object  # type: ignore[assignment,misc]


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    PLUGIN_NAME = "custom"

    def dependencies(self):
        # Our providers come from the checkout beside this package when it is there (`pip install
        # ./packages/...`: the index has none of them); an unpacked sdist asks for them (nox finds them in dist/).
        return [] if (SIBLING / "gpusync" / "abi.h").is_file() else ["cpumoe-executor>=0.2,<0.5"]

    def initialize(self, version, build_data):
        if self.target_name != "wheel":
            return
        fatbin, hipfb, so = build()
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["force_include"][str(so)] = f"kernelio/{so.name}"
        if fatbin is not None:
            build_data["force_include"][str(fatbin)] = f"kernelio/kernels/{fatbin.name}"
            meta = fatbin.with_name(fatbin.stem + ".json")
            build_data["force_include"][str(meta)] = f"kernelio/kernels/{meta.name}"
        if hipfb is not None:
            for f in (hipfb, Path(str(hipfb) + ".json")):
                build_data["force_include"][str(f)] = f"kernelio/kernels/{f.name}"


if __name__ == "__main__":
    for p, what in zip(build(), ("fatbin", "HIP image", "extension")):
        print(p or f"(no {what})")
