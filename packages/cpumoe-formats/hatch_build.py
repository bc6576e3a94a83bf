"""Self-contained build of cpumoe_formats._native (hatchling hook and script).

Each file in csrc/formats/ is compiled once per ISA tier with that tier's -m
flags (ggml-style variants); everything else once with baseline flags. Objects
are rebuilt only when a source or header is newer. Run `python hatch_build.py`
for an in-place build; `pip install packages/cpumoe-formats` runs it as a hook.

Environment:
  CXX                 compiler (default c++)
  CPUMOE_SANITIZE     e.g. "address,undefined" or "thread": sanitizer build
  CPUMOE_DEBUG=1      -O1 -g
  CPUMOE_BUILD_JOBS   parallel compile jobs (default: CPU count)
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
PKG = HERE / "src" / "cpumoe_formats"
INCLUDE = PKG / "include"

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVX2 = ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt"]
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
# tier tag -> (cpumoe_tier value, flags); order is the ladder.
TIERS = {
    "scalar": (0, ["-fno-tree-vectorize"]),
    "avx2": (1, _AVX2),
    "avxvnni": (2, _AVX2 + ["-mavxvnni"]),
    "avx512f": (3, _AVX512),
    "avx512vnni": (4, _AVX512 + ["-mavx512vnni"]),
    "avx512bf16": (5, _AVX512 + ["-mavx512vnni", "-mavx512bf16", "-mavx512vbmi"]),
    "amx": (6, _AVX512 + ["-mavx512vnni", "-mavx512bf16", "-mavx512vbmi", "-mamx-tile", "-mamx-bf16", "-mamx-int8"]),
}
# Tiers only some formats have kernels for (the registry's table holds nullptr for the rest).
TIER_FORMATS = {"amx": {"bf16", "fp8_block", "q4_0", "fp8_block_x16"}}


def _cxx() -> list[str]:
    return shlex.split(os.environ.get("CXX", "c++"))


def _base_flags() -> list[str]:
    import pybind11  # build requirement

    debug = os.environ.get("CPUMOE_DEBUG") == "1"
    flags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-Wall", "-Wextra",
             "-Wno-unused-function", "-Wno-maybe-uninitialized", "-O1" if debug else "-O2", "-g" if debug else "-g0",
             f"-I{CSRC}", f"-I{INCLUDE}", f"-I{pybind11.get_include()}",
             f"-I{sysconfig.get_paths()['include']}"]
    san = os.environ.get("CPUMOE_SANITIZE")
    if san:
        flags += [f"-fsanitize={san}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
    return flags


def _supported(flags: list[str]) -> bool:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "t.cpp"
        src.write_text("int main(){return 0;}\n")
        r = subprocess.run(_cxx() + flags + ["-c", str(src), "-o", str(Path(d) / "t.o")], capture_output=True)
        return r.returncode == 0


def _newest_header() -> float:
    hs = list(CSRC.rglob("*.h")) + list(INCLUDE.rglob("*.h"))
    return max((h.stat().st_mtime for h in hs), default=0.0)


def _deps_mtime(obj: Path, fallback: float) -> float:
    """Newest mtime of the headers obj was compiled from (its -MMD file), or `fallback` (the newest header of the
    package) where there is none: a header edit rebuilds only the objects that include it (a full rebuild took
    3-5 minutes on a shared 2-core VM)."""
    dep = obj.with_suffix(".d")
    try:
        text = dep.read_text()
    except OSError:
        return fallback
    paths = text.replace("\\\n", " ").split(":", 1)[-1].split()
    try:
        return max((Path(p).stat().st_mtime for p in paths), default=0.0)
    except OSError:  # a header was removed or renamed: rebuild
        return float("inf")


def build(out_dir: Path = PKG, verbose: bool = True) -> Path:
    """Compile and link the extension into out_dir; returns the .so path."""
    ext = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = out_dir / f"_native{ext}"
    obj_dir = HERE / "build" / ("obj-" + (os.environ.get("CPUMOE_SANITIZE", "") or "rel").replace(",", "-"))
    obj_dir.mkdir(parents=True, exist_ok=True)
    base = _base_flags()
    tiers = {t: v for t, v in TIERS.items() if t == "scalar" or (_X86 and _supported(v[1]))}
    built = " ".join(f"-DCPUMOE_BUILT_{t}" for t in tiers)
    cc = subprocess.run(_cxx() + ["--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    info = f"cpumoe-formats tiers={','.join(tiers)} cxx={cc[0] if cc else '?'}"
    jobs: list[tuple[Path, Path, list[str]]] = []
    for src in sorted(CSRC.glob("*.cpp")):
        defs = shlex.split(built) + [f'-DCPUMOE_BUILD_INFO="{info}"']
        jobs.append((src, obj_dir / f"{src.stem}.o", defs))
    for src in sorted((CSRC / "formats").glob("*.cpp")):
        for tag, (num, flags) in tiers.items():
            if tag in TIER_FORMATS and src.stem not in TIER_FORMATS[tag]:
                continue
            jobs.append((src, obj_dir / f"{src.stem}.{tag}.o",
                         flags + [f"-DCPUMOE_TIER={num}", f"-DCPUMOE_TIER_TAG={tag}"]))
    hdr = _newest_header()
    stamp = obj_dir / "flags.txt"
    # CXX may carry -D flags (bench/device/kernel_sweep.sh)
    flag_key = " ".join(_cxx() + base) + "|" + built + "|" + info
    stale_flags = not stamp.exists() or stamp.read_text() != flag_key

    def compile_one(job):
        src, obj, extra = job
        if not stale_flags and obj.exists() and obj.stat().st_mtime >= max(src.stat().st_mtime, _deps_mtime(obj, hdr)):
            return obj
        cmd = _cxx() + base + extra + ["-MMD", "-MF", str(obj.with_suffix(".d")), "-c", str(src), "-o", str(obj)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        if verbose and r.stderr.strip():
            print(r.stderr, file=sys.stderr)
        return obj

    n = int(os.environ.get("CPUMOE_BUILD_JOBS", "0")) or (os.cpu_count() or 2)
    if verbose:
        print(f"[cpumoe-formats] compiling {len(jobs)} objects ({', '.join(tiers)}) with {n} jobs", file=sys.stderr)
    with ThreadPoolExecutor(n) as ex:
        objs = list(ex.map(compile_one, jobs))
    stamp.write_text(flag_key)
    link = _cxx() + ["-shared", "-o", str(target)] + [str(o) for o in objs]
    if os.environ.get("CPUMOE_SANITIZE"):
        link.append(f"-fsanitize={os.environ['CPUMOE_SANITIZE']}")
    r = subprocess.run(link, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"link failed: {' '.join(link)}\n{r.stdout}{r.stderr}")
    return target


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # running as a script without hatchling
    BuildHookInterface = object  # type: ignore[assignment,misc]


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    PLUGIN_NAME = "custom"

    def initialize(self, version, build_data):  # noqa: D401 - hatchling API
        if self.target_name != "wheel":
            return
        so = build()
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["force_include"][str(so)] = f"cpumoe_formats/{so.name}"


if __name__ == "__main__":
    print(build())
