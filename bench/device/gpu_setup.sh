# Sourced by gpu_latency.sh, gpu_memfork.sh, gpu_kio_variants.sh and gpu_compute_sanitizer.sh after they set OUT.
# Installs the wheels the image lacks (ml_dtypes, pybind11, hypothesis from .whl/) into /tmp/site, builds the four
# packages in place (gpu_cuda_inplace.sh with its tests and bench skipped; SKIP_BUILD=1 reuses extensions already in
# the tree), puts their source trees on PYTHONPATH, cds to the repo root, and sets t0 (the start time), rc=0 and
# run() to time-box a stage:
#   run NAME SECONDS TAIL_LINES command...   (log in $OUT/NAME.log; its exit status is or-ed into rc)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
t0=$(date +%s)
SKIP_TESTS=1 SKIP_BENCH=1 "$ROOT/bench/device/gpu_cuda_inplace.sh" "$OUT" >"$OUT/build.txt" 2>&1 \
  || { tail -40 "$OUT/build.txt"; echo "build failed"; exit 1; }
echo "build: $(($(date +%s) - t0)) s"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT/packages/cpumoe-formats/src:$ROOT/packages/cpumoe-executor/src:$ROOT/packages/gpusync-cuda/src:$ROOT/packages/kernelio/src${PYTHONPATH:+:$PYTHONPATH}
cd "$ROOT" || exit 1
rc=0
run() {
  local name=$1 limit=$2 lines=$3; shift 3
  local t1; t1=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local r=$?; rc=$((rc | r))
  echo "== $name: rc=$r in $(($(date +%s) - t1)) s"
  grep -vE "^\[doorbell\]" "$OUT/$name.log" | tail -"$lines"
}
