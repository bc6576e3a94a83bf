#!/usr/bin/env bash
# On a GPU machine without PyPI (the H200 lease): run `nox -s test-cuda` exactly as a CI maintainer
# would, with every Python package it needs taken from a wheelhouse instead of the index.
#   ci/gpu_nox_cuda.sh WHEELHOUSE [OUTDIR]     (WHEELHOUSE and WHEELHOUSE/nox: nox, virtualenv, hatchling, build, pybind11, ...)
# torch and the CUDA stack come from the machine (GPU sessions use system site packages).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WH=$(cd "${1:?wheelhouse}" && pwd)
OUT=$(mkdir -p "${2:-$ROOT/gpu-out}" && cd "${2:-$ROOT/gpu-out}" && pwd)
PY=${PYTHON:-python3}
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WH $WH/nox" PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
if $PY -m venv /tmp/noxenv >/dev/null 2>&1; then
  /tmp/noxenv/bin/python -m pip install -q nox || exit 1
  NOX=(/tmp/noxenv/bin/python -m nox)
else  # no ensurepip: nox and its deps onto a private path
  $PY -m pip install -q --target /tmp/noxsite nox || exit 1
  export PYTHONPATH=/tmp/noxsite
  NOX=($PY -m nox)
fi
cd "$ROOT"
REQUIRE_GPU=1 "${NOX[@]}" -s test-cuda 2>&1 | tee "$OUT/nox-test-cuda.log"
rc=${PIPESTATUS[0]}
grep -E "^nox > (Session|Ran)|passed|failed|skipped" "$OUT/nox-test-cuda.log" | tail -30
exit "$rc"
