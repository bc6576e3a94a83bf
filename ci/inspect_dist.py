# Called by: ci/check_wheel.sh (nox -s package-check-<pkg>, tests-integration/test_packaging.py).
"""Inspect one package's sdist and wheel in a dist directory; print the wheel's path last.

    python ci/inspect_dist.py PKG_DIR DIST_DIR

sdist: holds every file git tracks under PKG_DIR (so a wheel can be built from it alone)
and no build output (.so, .o, build/, __pycache__).
wheel (native packages, i.e. with a hatch_build.py or csrc/): platform-tagged, not
py3-none-any, Root-Is-Purelib false, holds the compiled module(s) and every header under
src/<pkg>/include/, and no torch in Requires-Dist (native packages never link it). A pure-Python
package (moe-engine-glue, which composes them with torch): py3-none-any, no compiled library.
Exits 1 naming every problem found.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib


def _tracked(pkg_dir: Path) -> list[str] | None:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "."], cwd=pkg_dir, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    files = [f for f in out.stdout.decode().split("\0") if f]
    return [f for f in files if (pkg_dir / f).is_file()] or None


def main(pkg_dir: Path, dist: Path) -> int:
    proj = tomllib.loads((pkg_dir / "pyproject.toml").read_text())["project"]
    stem = re.sub(r"[-_.]+", "_", proj["name"]).lower()
    version = proj.get("version", "*")
    problems: list[str] = []

    sdists = sorted(dist.glob(f"{stem}-{version}.tar.gz"))
    wheels = sorted(dist.glob(f"{stem}-{version}-*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        print(f"FAIL: expected one sdist and one wheel of {proj['name']} {version} in {dist}, found "
              f"{[p.name for p in sdists + wheels]}", file=sys.stderr)
        return 1
    sdist, wheel = sdists[0], wheels[0]

    with tarfile.open(sdist) as tf:
        names = [m.name for m in tf.getmembers() if m.isfile()]
    top = names[0].split("/", 1)[0]
    in_sdist = {n.split("/", 1)[1] for n in names if "/" in n}
    for required in ("pyproject.toml", "PKG-INFO"):
        if required not in in_sdist:
            problems.append(f"sdist lacks {required}")
    tracked = _tracked(pkg_dir)
    if tracked is None:
        print(f"note: {pkg_dir} is not a git checkout; sdist completeness checked by the wheel build only")
    else:
        lacking = sorted(set(tracked) - in_sdist)
        if lacking:
            problems.append(f"sdist lacks {len(lacking)} tracked file(s): {lacking[:20]}")
        untracked = sorted(in_sdist - set(tracked) - {"PKG-INFO", ".gitignore"})
        if untracked:
            print(f"warning: sdist holds files git does not track (a fresh clone lacks them): {untracked[:20]}")
    junk = sorted(n for n in in_sdist if n.endswith((".so", ".o", ".pyc")) or n.startswith("build/")
                  or "/__pycache__/" in n)
    if junk:
        problems.append(f"sdist holds build output: {junk[:20]}")
    present = "" if tracked is None else f", {len(set(tracked) & in_sdist)} of {len(tracked)} git-tracked files"
    print(f"sdist {sdist.name}: {len(in_sdist)} files under {top}/{present}")

    native = (pkg_dir / "hatch_build.py").is_file() or (pkg_dir / "csrc").is_dir()
    tag = wheel.name[:-len(".whl")].split("-")[-3:]
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
        dist_info = next(n.split("/", 1)[0] for n in in_wheel if n.split("/", 1)[0].endswith(".dist-info"))
        meta = Parser().parsestr(zf.read(f"{dist_info}/METADATA").decode())
        wheel_meta = Parser().parsestr(zf.read(f"{dist_info}/WHEEL").decode())
    requires = meta.get_all("Requires-Dist") or []
    if native and any(re.match(r"torch\b", r) for r in requires):
        problems.append(f"native wheel requires torch: {requires}")
    libs = sorted(n for n in in_wheel if n.endswith((".so", ".pyd", ".dylib")))
    if native:
        if tag[2] == "any":
            problems.append(f"native wheel has a pure tag {'-'.join(tag)}")
        if wheel_meta.get("Root-Is-Purelib", "").strip().lower() != "false":
            problems.append("native wheel says Root-Is-Purelib: true")
        if not libs:
            problems.append("native wheel holds no compiled library (.so)")
        src = pkg_dir / "src"
        headers = sorted(p.relative_to(src).as_posix() for p in src.glob("*/include/**/*") if p.is_file())
        lacking = [h for h in headers if h not in in_wheel]
        if lacking:
            problems.append(f"wheel lacks headers {lacking}")
        print(f"wheel {wheel.name}: tag {'-'.join(tag)}, libraries {libs}, headers {headers}")
    else:
        if tag != ["py3", "none", "any"] or libs:
            problems.append(f"pure-Python wheel has tag {'-'.join(tag)} and libraries {libs}; expected py3-none-any")
        print(f"wheel {wheel.name}: tag {'-'.join(tag)}")
    print(f"requires: {requires}")

    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    if problems:
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()))
