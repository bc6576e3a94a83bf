#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/gpu_compute_sanitizer.sh OUTDIR (~45 s with the build).
# kernelio's CUDA tests under compute-sanitizer memcheck, racecheck and synccheck (the host's Firecracker runtime
# supports it). Their start-up probe runs every publish/combine stage: one block and several, ringing and skipped
# steps, the in-kernel wait released by a host store and its timeout. SKIP_BUILD=1 reuses extensions.
set -uo pipefail
OUT=$(mkdir -p "${1:?usage: bench/device/gpu_compute_sanitizer.sh OUTDIR}" && cd "$1" && pwd)
source "$(dirname "$0")/gpu_setup.sh"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck synccheck; do
  run "$tool" 120 3 "$CS" --tool "$tool" --error-exitcode 9 --target-processes all \
    $PY -m pytest -q -x -p no:cacheprovider packages/kernelio/tests/test_cuda.py
done
exit $rc
