"""Self-contained build of cpumoe_executor._native (hatchling hook and script).

Needs the cpumoe-formats C ABI header: from the installed cpumoe_formats
(get_include()), else from the monorepo checkout beside this package.
Environment: CXX, CPUMOE_SANITIZE (e.g. "address,undefined" or "thread"),
CPUMOE_DEBUG=1, CPUMOE_BUILD_JOBS.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
PKG = HERE / "src" / "cpumoe_executor"


SIBLING = HERE.parent / "cpumoe-formats" / "src" / "cpumoe_formats" / "include"


def _formats_include() -> str:
    try:
        import cpumoe_formats

        return cpumoe_formats.get_include()
    except ImportError:
        if (SIBLING / "cpumoe_formats" / "abi.h").is_file():
            return str(SIBLING)
        raise RuntimeError("cpumoe-executor needs cpumoe-formats' C ABI header: install cpumoe-formats first "
                           "(pip install packages/cpumoe-formats) or build from the monorepo") from None


def build(out_dir: Path = PKG) -> Path:
    import pybind11

    cxx = shlex.split(os.environ.get("CXX", "c++"))
    debug = os.environ.get("CPUMOE_DEBUG") == "1"
    san = os.environ.get("CPUMOE_SANITIZE", "")
    flags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-O1" if debug else "-O2",
             "-g" if (debug or san) else "-g0", "-pthread", f"-I{CSRC}", f"-I{PKG / 'include'}",
             f"-I{_formats_include()}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    if san:
        flags += [f"-fsanitize={san}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
    cc = subprocess.run(cxx + ["--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    flags.append(f'-DCPUMOE_EXEC_BUILD_INFO="cpumoe-executor cxx={cc[0] if cc else "?"}"')
    obj_dir = HERE / "build" / ("obj-" + (san or "rel").replace(",", "-"))
    obj_dir.mkdir(parents=True, exist_ok=True)
    # An object is reused only when its key (flags, its source's bytes, every header's bytes) is the one it was built
    # with: mtimes lie when a tree arrives by copy (a carried or checked-out file older than the object it replaces
    # left stale objects beside new ones, and the link failed on a duplicate symbol).
    headers = hashlib.sha256(" ".join(flags).encode())
    for h in sorted(list(CSRC.glob("*.h")) + list((PKG / "include").rglob("*.h")) +
                    list(Path(_formats_include()).rglob("*.h"))):
        headers.update(h.name.encode() + h.read_bytes())

    def compile_one(src: Path) -> Path:
        obj, stamp = obj_dir / f"{src.stem}.o", obj_dir / f"{src.stem}.key"
        key = hashlib.sha256(headers.digest() + src.read_bytes()).hexdigest()
        if obj.exists() and stamp.exists() and stamp.read_text() == key:
            return obj
        cmd = cxx + flags + ["-c", str(src), "-o", str(obj)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        stamp.write_text(key)
        return obj

    srcs = sorted(CSRC.glob("*.cpp"))
    print(f"[cpumoe-executor] compiling {len(srcs)} objects", file=sys.stderr)
    with ThreadPoolExecutor(int(os.environ.get("CPUMOE_BUILD_JOBS", "0")) or os.cpu_count() or 2) as ex:
        objs = list(ex.map(compile_one, srcs))
    target = out_dir / f"_native{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    link = cxx + ["-shared", "-pthread", "-o", str(target)] + [str(o) for o in objs]
    if san:
        link.append(f"-fsanitize={san}")
    r = subprocess.run(link, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"link failed: {' '.join(link)}\n{r.stdout}{r.stderr}")
    return target


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:
    BuildHookInterface = object  # type: ignore[assignment,misc]


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    PLUGIN_NAME = "custom"

    def dependencies(self):
        # Our providers come from the checkout beside this package when it is there (`pip install
        # ./packages/...`: the index has none of them); an unpacked sdist asks for them (nox finds them in dist/).
        return [] if (SIBLING / "cpumoe_formats" / "abi.h").is_file() else ["cpumoe-formats>=0.2,<0.3"]

    def initialize(self, version, build_data):
        if self.target_name != "wheel":
            return
        so = build()
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["force_include"][str(so)] = f"cpumoe_executor/{so.name}"


if __name__ == "__main__":
    print(build())
