#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/gpu_latency.sh OUTDIR (under 3 minutes).
# The handshake latency numbers of issue 4 (target: kernel path <= memop floor + 1.5 us, memop path <= floor + 3 us,
# at batch 1):
# 1. builds the four packages in place (gpu_setup.sh; SKIP_BUILD=1 reuses extensions already in the tree);
# 2. the CPU side on the host alone: python -m cpumoe_executor.bench --doorbell (a CPU thread on a free core plays
#    the GPU) with 1 and 4 executor threads -> OUTDIR/doorbell.json;
# 3. python -m gpusync_cuda.bench --json OUTDIR/latency.json (every path, batch 1/4/8, default team sizing), then
#    batch 1 again with every thread on every step (--team-unit 0) -> OUTDIR/latency-allthreads.json.
# Each bench prints round trip - CPU task alone per path and a verdict line per path (MET / NOT MET).
set -uo pipefail
OUT=$(mkdir -p "${1:?usage: bench/device/gpu_latency.sh OUTDIR}" && cd "$1" && pwd)
source "$(dirname "$0")/gpu_setup.sh"
run doorbell 45 22 $PY -m cpumoe_executor.bench --doorbell --threads 1,4 --rings 3000 --repeats 3 --json "$OUT/doorbell.json"
run latency 100 22 $PY -m gpusync_cuda.bench --json "$OUT/latency.json"
run latency-allthreads 45 22 $PY -m gpusync_cuda.bench --batches 1 --paths kernel,memop --team-unit 0 --json "$OUT/latency-allthreads.json"
echo "total: $(($(date +%s) - t0)) s"
exit $rc
