#!/usr/bin/env bash
# Called by: nox -s package-check-<pkg> (noxfile.py); tests-integration/test_packaging.py runs it with --build.
# Packaging check for one package of this repo.
#
#   ci/check_wheel.sh [--build] PKG_DIR DIST_DIR
#
#   --build   first builds PKG_DIR's sdist into DIST_DIR, then the wheel FROM that sdist
#             (python -m build with no --sdist/--wheel); without it, checks what DIST_DIR holds
#             (nox's build-<pkg> session made it the same way).
#
# Then inspects both artifacts (ci/inspect_dist.py: sdist complete, a native wheel platform-tagged with its library
# and headers, no torch requirement), installs the wheel alone into a fresh venv (runtime dependencies only: no test
# extras; torch only for moe-engine-glue) and runs ci/smoke/<pkg>.py there, from a scratch directory (no source tree).
set -euo pipefail

build=0
if [[ ${1:-} == --build ]]; then build=1; shift; fi
if [[ $# -ne 2 ]]; then
    echo "usage: $0 [--build] PKG_DIR DIST_DIR" >&2
    exit 2
fi
pkg_dir=$(cd "$1" && pwd)
mkdir -p "$2"
dist=$(cd "$2" && pwd)
ci=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pkg=$(basename "$pkg_dir")
py=$(command -v python || command -v python3)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== $pkg: fresh venv ($("$py" --version))"
"$py" -m venv "$work/venv" 2>/dev/null || "$py" -m virtualenv -q "$work/venv"
vpy=$work/venv/bin/python

if [[ $build == 1 ]]; then
    echo "== $pkg: sdist, then wheel from the sdist -> $dist"
    "$vpy" -m pip install -q --disable-pip-version-check "build>=1.2"
    PIP_FIND_LINKS="${PIP_FIND_LINKS:+$PIP_FIND_LINKS }$dist" "$vpy" -m build --outdir "$dist" "$pkg_dir"
fi

echo "== $pkg: inspect sdist and wheel"
status=0
report=$("$vpy" "$ci/inspect_dist.py" "$pkg_dir" "$dist") || status=$?
printf '%s\n' "$report"
if [[ $status -ne 0 ]]; then exit "$status"; fi
wheel=$(tail -n 1 <<<"$report")

echo "== $pkg: install $(basename "$wheel") alone"
"$vpy" -m pip install -q --disable-pip-version-check --find-links "$dist" --only-binary :all: "$wheel"
native=0
if [[ -f $pkg_dir/hatch_build.py || -d $pkg_dir/csrc ]]; then native=1; fi
if [[ $native == 1 ]] && "$vpy" -c "import torch" 2>/dev/null; then
    echo "FAIL: installing $pkg pulled in torch (native packages never need it)" >&2
    exit 1
fi

smoke=$ci/smoke/$pkg.py
if [[ -f $smoke ]]; then
    echo "== $pkg: smoke test $(basename "$smoke")"
    (cd "$work" && "$vpy" "$smoke")
else
    echo "== $pkg: no ci/smoke/$pkg.py; import check only"
    (cd "$work" && "$vpy" -c "import sys, importlib; importlib.import_module(sys.argv[1])" "$(basename "$(dirname "$(ls "$pkg_dir"/src/*/__init__.py | head -n 1)")")")
fi
echo "== $pkg: packaging OK"
