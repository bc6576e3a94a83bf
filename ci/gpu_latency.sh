#!/usr/bin/env bash
# On the H200 machine: the handshake latency numbers of issue 4 (target: kernel path <= memop floor + 1.5 us,
# memop path <= floor + 3 us, at batch 1), in under 3 minutes.
#   ci/gpu_latency.sh OUTDIR
# 1. builds the four packages in place (ci/gpu_cuda_inplace.sh with its tests and bench skipped;
#    SKIP_BUILD=1 reuses extensions already in the tree);
# 2. the CPU side on the host alone: python -m cpumoe_executor.bench --doorbell (a CPU thread on a free
#    core plays the GPU) with 1 and 4 executor threads -> OUTDIR/doorbell.json;
# 3. python -m gpusync_cuda.bench --json OUTDIR/latency.json (every path, batch 1/4/8, default team sizing),
#    then batch 1 again with every thread on every step (--team-unit 0) -> OUTDIR/latency-allthreads.json.
# Each bench prints round trip - CPU task alone per path and a verdict line per path (MET / NOT MET).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:?usage: ci/gpu_latency.sh OUTDIR}" && cd "$1" && pwd)
PY=${PYTHON:-python3}
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then  # wheels the image lacks (ml_dtypes, pybind11, ...)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
t0=$(date +%s)
SKIP_TESTS=1 SKIP_BENCH=1 "$ROOT/ci/gpu_cuda_inplace.sh" "$OUT" >"$OUT/build.txt" 2>&1 \
  || { tail -40 "$OUT/build.txt"; echo "build failed"; exit 1; }
echo "build: $(($(date +%s) - t0)) s"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT/packages/cpumoe-formats/src:$ROOT/packages/cpumoe-executor/src:$ROOT/packages/gpusync-cuda/src:$ROOT/packages/kernelio/src${PYTHONPATH:+:$PYTHONPATH}
cd "$ROOT"
rc=0
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local t1; t1=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local r=$?; rc=$((rc | r))
  echo "== $name: rc=$r in $(($(date +%s) - t1)) s"
  grep -vE "^\[doorbell\]" "$OUT/$name.log" | tail -22
}
run doorbell 45 $PY -m cpumoe_executor.bench --doorbell --threads 1,4 --rings 3000 --repeats 3 --json "$OUT/doorbell.json"
run latency 100 $PY -m gpusync_cuda.bench --json "$OUT/latency.json"
run latency-allthreads 45 $PY -m gpusync_cuda.bench --batches 1 --paths kernel,memop --team-unit 0 --json "$OUT/latency-allthreads.json"
echo "total: $(($(date +%s) - t0)) s"
exit $rc
