#!/usr/bin/env bash
# Run by hand on the lent H200 host: STAGE=test|bench|transformers bench/device/glue_h200.sh OUTDIR (calls of < 10 min;
# the in-place build of the first is reused by the second when the machine is still warm, else rebuilt).
# test:  builds the five native packages in place (nvcc for kernelio's fatbin), then the GPU suites: gpusync-cuda,
#        kernelio, gpusync-hip through the HIP-on-CUDA shim, tests-integration, moe-engine-glue (all marks).
# bench: python -m moe_engine.tools.bench step (gpu / cpu / hybrid per layer under CUDA graphs, 1,000-replay check),
#        prefill (CPU chunks against staged experts), overhead (OVERHEAD=1) and `moe-engine demo` (hybrid under graphs).
# transformers: bench/transformers_generate.py --mode h200 (generate() tokens/s against accelerate's CPU offload).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mkdir -p "${1:-$ROOT/gpu-out}" && cd "${1:-$ROOT/gpu-out}" && pwd)
PY=${PYTHON:-python3}
P=$ROOT/packages
export PYTHONUNBUFFERED=1 CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-$(nproc)}
export PYTHONPATH=$P/cpumoe-formats/src:$P/cpumoe-executor/src:$P/gpusync-cuda/src:$P/gpusync-hip/src:$P/kernelio/src:$P/moe-engine-glue/src${PYTHONPATH:+:$PYTHONPATH}
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then  # wheels the host's image lacks (ml_dtypes, pybind11, hypothesis, gguf)
  for w in "$ROOT"/.whl/*.whl; do  # one at a time: the folder holds builds for several Pythons
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" >/dev/null 2>&1 || true
  done
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
rc=0
run() {  # NAME SECONDS TAIL command...   (log in $OUT/NAME.log; its status is or-ed into rc)
  local name=$1 limit=$2 lines=$3; shift 3
  local t1; t1=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local r=$?; rc=$((rc | r))
  echo "== $name: rc=$r in $(($(date +%s) - t1)) s"
  grep -vE "^\[doorbell\]|it/s\]|s/it\]" "$OUT/$name.log" | tail -"$lines"
}
if ! ls "$P"/kernelio/src/kernelio/_native*.so >/dev/null 2>&1 || [ "${REBUILD:-0}" = 1 ]; then
  t0=$(date +%s)
  pids=()
  for p in cpumoe-formats cpumoe-executor gpusync-cuda gpusync-hip kernelio; do
    (cd "$P/$p" && $PY hatch_build.py) >"/tmp/glue-build-$p.log" 2>&1 & pids+=($!)
  done
  fail=0
  for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
  cat /tmp/glue-build-*.log >"$OUT/build.log"
  [ $fail = 0 ] || { tail -60 "$OUT/build.log"; exit 1; }
  echo "build: $(($(date +%s) - t0)) s"
fi
cd "$ROOT" || exit 1
nvidia-smi -L; $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
if [ "${STAGE:-test}" = test ]; then
  T="-p no:cacheprovider -q -rfEs"
  run gpusync_cuda 120 12 $PY -m pytest $T packages/gpusync-cuda/tests -m "cuda or not gpu"
  run kernelio 60 6 $PY -m pytest $T packages/kernelio/tests -m "cuda or not gpu"
  HIPSHIM_REPLAYS=${HIPSHIM_REPLAYS:-1000} run hip_on_cuda 150 10 $PY -m pytest $T packages/gpusync-hip/tests/test_hip_on_cuda.py -m "cuda or not gpu"
  run integration 150 8 $PY -m pytest $T tests-integration -m cuda
  run glue 240 20 $PY -m pytest $T -rA --durations=15 packages/moe-engine-glue/tests
elif [ "${STAGE}" = transformers ]; then
  run transformers 540 30 $PY bench/transformers_generate.py --mode h200 --batch ${BATCH:-1 4} --quiet \
    --json "$OUT/transformers_h200_bench.json"
else
  run demo 90 6 $PY -m moe_engine.tools.cli demo --quiet --json "$OUT/demo_h200.json"
  [ "${DEMO16:-1}" = 1 ] && run demo16 90 4 $PY -m moe_engine.tools.cli demo --quiet --threads 16 --json "$OUT/demo_h200_16threads.json"
  run step 420 40 $PY -m moe_engine.tools.bench step --replays 30 --repeats ${REPEATS:-9} --json "$OUT/moe_engine_step_h200.json"
  [ "${PREFILL:-1}" = 1 ] && run prefill 150 16 $PY -m moe_engine.tools.bench prefill --repeats 3 --json "$OUT/moe_engine_prefill_h200.json"
  [ "${OVERHEAD:-0}" = 1 ] && run overhead 60 3 $PY -m moe_engine.tools.bench overhead --formats bf16 --json "$OUT/moe_engine_overhead_h200.json"
fi
exit $rc
