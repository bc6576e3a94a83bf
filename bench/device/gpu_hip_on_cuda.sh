#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/gpu_hip_on_cuda.sh OUTDIR (SKIP_BUILD=1 reuses extensions).
# gpusync-hip's control logic against a real GPU through the HIP-on-CUDA shim (packages/gpusync-hip/tests/cuda_shim).
# Builds cpumoe-formats, cpumoe-executor, gpusync-cuda, gpusync-hip and kernelio's host module in place with this
# machine's python3 (no nvcc, no hipcc, no torch needed), then runs packages/gpusync-hip/tests/test_hip_on_cuda.py:
# the shim compiled with g++, checked against cuda.h, and for each path (native memops, spliced batch-memop nodes via
# the ROCm<10 eager-capture mode, spliced nodes forced) one graph of 4 layers replayed HIPSHIM_REPLAYS (default 1000)
# times with fresh inputs, compared bit for bit with CpuMoeExecutor.decode. Writes
# OUTDIR/{env.txt,build.log,tests.log,results.jsonl}; exits non-zero on any failure, and when the GPU tests skip.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mkdir -p "${1:-$ROOT/gpu-out}" && cd "${1:-$ROOT/gpu-out}" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-$(nproc)}
# Test dependencies without PyPI: the repo's wheel cache (ml_dtypes, pybind11, hypothesis...).
if ! $PY -c "import numpy, ml_dtypes, pybind11, pytest" 2>/dev/null; then
  for w in "$ROOT/.whl" /work/main/.whl; do
    if compgen -G "$w/*.whl" >/dev/null; then
      $PY -m pip install -q --no-index --no-deps --target /tmp/site "$w"/*.whl && break
    fi
  done
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
P=$ROOT/packages
export PYTHONPATH=$P/cpumoe-formats/src:$P/cpumoe-executor/src:$P/gpusync-cuda/src:$P/gpusync-hip/src:$P/kernelio/src${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi -L; nproc; $PY --version; g++ --version | head -n 1; git -C "$ROOT" log --oneline -1; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  : >"$OUT/build.log"
  build() {  # name command...: runs in packages/<name>, log appended to build.log
    local p=$1; shift
    (cd "$P/$p" && "$@") >"/tmp/hipcuda-build-$p.log" 2>&1
    local r=$?
    cat "/tmp/hipcuda-build-$p.log" >>"$OUT/build.log"
    return $r
  }
  # Providers first (their consumers read headers from the sibling trees, but import them when built).
  pids=()
  for p in cpumoe-formats cpumoe-executor gpusync-cuda; do build "$p" $PY hatch_build.py & pids+=($!); done
  fail=0
  for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
  if [ $fail = 0 ]; then
    # kernelio: the host module only (its HIP image is used if one travelled with the tree; the CUDA
    # fatbin is not needed here: on the shim, kernelio must find that it cannot load its HIP image).
    build gpusync-hip $PY hatch_build.py & p1=$!
    build kernelio $PY -c 'import hatch_build as h; print(h.build_ext())' & p2=$!
    wait $p1 || fail=1
    wait $p2 || fail=1
  fi
  [ $fail = 0 ] || { tail -60 "$OUT/build.log"; echo "build failed"; exit 1; }
fi
echo "build: $(($(date +%s) - t0)) s"

t1=$(date +%s)
cd "$ROOT"
timeout "${T_TESTS:-210}" $PY -m pytest -p no:cacheprovider -q -s -rfEs packages/gpusync-hip/tests/test_hip_on_cuda.py \
  -m "cuda or not gpu" >"$OUT/tests.log" 2>&1
rc=$?
echo "tests: rc=$rc in $(($(date +%s) - t1)) s"
grep -E '^\[(native|eager-capture)/' "$OUT/tests.log" | sed 's/^\[[^]]*\] //' >"$OUT/results.jsonl"
$PY - "$OUT/results.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for r in rows:
    s = r.get("shim") or {}
    print(f"{r['path']:12s} mechanism={r['mechanism']:7s} replays={r['replays']} mismatches={r['mismatches']} "
          f"served={r['served']}/{r['expected_served']} pending(ready={r['ready']}, done={r['done']}) "
          f"{r['us_per_replay']} us/replay  shim: captured={s.get('memops_captured')} eager={s.get('memops_eager')} "
          f"batch_nodes={s.get('batch_nodes')} ext_records={s.get('external_records')} "
          f"release_events={s.get('release_events')}")
    print(f"    kernel path: {r['kernel_probe'][:160]}")
print(f"{len(rows)} paths, {sum(r['replays'] for r in rows)} replays, {sum(r['mismatches'] for r in rows)} mismatches")
EOF
grep -E "passed|failed|error|SKIPPED|FAILED|ERROR" "$OUT/tests.log" | tail -15
if grep -q "needs an NVIDIA GPU" "$OUT/tests.log"; then
  echo "the GPU tests were skipped: this script needs an NVIDIA GPU"
  rc=$((rc | 3))
fi
exit $rc
