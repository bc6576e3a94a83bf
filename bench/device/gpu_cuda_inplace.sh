#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/gpu_cuda_inplace.sh OUTDIR (gpu_setup.sh calls it to build only).
# Builds cpumoe-formats, cpumoe-executor, gpusync-cuda and kernelio in place with this machine's python3 (and nvcc,
# unless a fatbin built elsewhere travels with the tree), then runs the CUDA tests of gpusync-cuda, kernelio and
# tests-integration, and the handshake bench. MARKS="cuda or not gpu" runs the CPU tests too; SKIP_TESTS=1 /
# SKIP_BENCH=1: build only; SKIP_BUILD=1 reuses extensions. A PYTHONPATH given is kept after the packages.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mkdir -p "${1:-$ROOT/gpu-out}" && cd "${1:-$ROOT/gpu-out}" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-$(nproc)}
export PYTHONPATH=$ROOT/packages/cpumoe-formats/src:$ROOT/packages/cpumoe-executor/src:$ROOT/packages/gpusync-cuda/src:$ROOT/packages/kernelio/src${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi -L; nproc; $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  nvcc --version | tail -2; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
t0=$(date +%s)
# The four builds run at once: each finds its providers' headers in the sibling source tree when
# the provider is not importable yet. SKIP_BUILD=1 reuses extensions already in the tree.
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  pids=()
  for p in cpumoe-formats cpumoe-executor gpusync-cuda; do
    (cd "$ROOT/packages/$p" && $PY hatch_build.py) >"/tmp/build-$p.log" 2>&1 & pids+=($!)
  done
  (cd "$ROOT/packages/kernelio" && if [ -f src/kernelio/kernels/kernelio.fatbin ]; then
     $PY -c 'import hatch_build as h; print(h.build_ext())'; else $PY hatch_build.py; fi) >/tmp/build-kernelio.log 2>&1 &
  pids+=($!)
  fail=0
  for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
  cat /tmp/build-*.log >"$OUT/build.log"
  [ $fail = 0 ] || { tail -60 "$OUT/build.log"; exit 1; }
  (cd "$ROOT" && tar -cf "$OUT/extensions.tar" packages/*/src/*/_native*.so)
fi
echo "build: $(($(date +%s) - t0)) s"
rc=0
cd "$ROOT"
# One pytest per test directory: their conftest.py files share a module name.
# dir:timeout:marks (kernelio's CPU tests are quick and include the cuobjdump check)
[ "${SKIP_TESTS:-0}" = 1 ] || for spec in "packages/gpusync-cuda/tests:${T_GPUSYNC:-90}:${MARKS:-cuda}" \
            "packages/kernelio/tests:${T_KERNELIO:-45}:${MARKS:-cuda or not gpu}" \
            "tests-integration:${T_INTEGRATION:-200}:${MARKS:-cuda}"; do
  dir=${spec%%:*}; rest=${spec#*:}; limit=${rest%%:*}; marks=${rest#*:}
  log="$OUT/tests_$(echo "$dir" | tr / _).log"
  t1=$(date +%s)
  timeout "$limit" $PY -m pytest -p no:cacheprovider -q -s -rfEs "$dir" -m "$marks" \
    >"$log" 2>&1
  r=$?; rc=$((rc | r))
  echo "== $dir: rc=$r in $(($(date +%s) - t1)) s"
  grep -E "passed|failed|error|path=|SKIPPED|FAILED|ERROR|Error|assert" "$log" | tail -25
done
[ "${SKIP_BENCH:-0}" = 1 ] && exit $rc
timeout "${T_BENCH:-100}" $PY -m gpusync_cuda.bench --json "$OUT/bench.json" >"$OUT/bench.log" 2>&1
r=$?; rc=$((rc | r)); echo "== bench: rc=$r"; tail -25 "$OUT/bench.log"
exit $rc
