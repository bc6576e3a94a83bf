#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/gpu_nox_cuda.sh WHEELHOUSE [OUTDIR].
# Runs `REQUIRE_GPU=1 nox -s test-cuda` as a CI maintainer would, on a GPU machine without PyPI: every Python package
# it needs comes from WHEELHOUSE and WHEELHOUSE/nox (nox, virtualenv, hatchling, build, pybind11, ...) instead of the
# index; torch and the CUDA stack come from the machine (GPU sessions use its site packages).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
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
