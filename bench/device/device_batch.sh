#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/device_batch.sh OUTDIR (< 5 minutes; each stage is time-boxed).
# Multi-token (batched) decode check on the host's CPU (16 Xeon cores, AVX-512/VNNI/BF16, no network):
# 1. builds cpumoe-formats + cpumoe-executor in place (cpu_setup.sh);
# 2. runs the batch-identity test (batch n == n single-token steps, bit for bit, every format x mode x tier, all six
#    tiers exist there) and the row-major formats' reference tests, every tier forced in turn;
# 3. runs the executor bench at THREADS (default 16) threads, batch 1 and 8, shared and random routing, dram working
#    set, each format at its model preset, and writes the batch-8 / batch-1 step-time ratios.
# Logs, JSON and summary.txt land in OUTDIR.
set -uo pipefail
OUT=${1:?usage: bench/device/device_batch.sh OUTDIR}
mkdir -p "$OUT"
T0=$(date +%s)
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
. bench/device/cpu_setup.sh
echo "build done at +$(( $(date +%s) - T0 )) s" | tee "$OUT/summary.txt"
rc=0
python3 -c "import cpumoe_formats as cf; print('usable tiers:', cf.usable_tiers())" | tee -a "$OUT/summary.txt"
# the test files run side by side (one process each, 16 cores), each time-boxed
pids=""
for t in test_batch_identity test_bf16 test_fp8_block test_nvfp4 test_ds_fp4 test_q4_0; do
  (cd packages/cpumoe-formats && timeout 120 python3 -m pytest -q -p no:cacheprovider "tests/$t.py") > "$OUT/$t.log" 2>&1 &
  pids="$pids $!"
done
for p in $pids; do wait "$p" || rc=1; done
for t in test_batch_identity test_bf16 test_fp8_block test_nvfp4 test_ds_fp4 test_q4_0; do
  echo "$t: $(tail -1 "$OUT/$t.log")" | tee -a "$OUT/summary.txt"
done
echo "tests done at +$(( $(date +%s) - T0 )) s" | tee -a "$OUT/summary.txt"
timeout 150 python3 -m cpumoe_executor.bench --format bf16,fp8_block,nvfp4,ds_fp4,q4_0 --batch 1,8 --routing both \
  --threads "${THREADS:-16}" --repeats 3 --steps 10 --json "$OUT/bench-executor-batch.json" \
  > "$OUT/bench-executor-batch.log" 2>&1 || rc=1
tail -25 "$OUT/bench-executor-batch.log"
python3 - "$OUT/bench-executor-batch.json" >> "$OUT/summary.txt" <<'PY' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{'format':10s} {'isa':18s} {'b1 GB/s':>8s} {'ceiling':>8s} {'%':>5s} {'shared b8/b1':>13s} {'random b8/b1':>13s}")
for f, e in r["formats"].items():
    print(f"{f:10s} {e['isa']:18s} {e['gbps']:8.1f} {e['ceiling_gbps']:8.1f} {100 * e['ratio']:4.0f}% "
          f"{e.get('shared_batch8_over_batch1', float('nan')):12.2f}x {e.get('random_batch8_over_batch1', float('nan')):12.2f}x")
PY
echo "all done at +$(( $(date +%s) - T0 )) s, rc=$rc" | tee -a "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $rc
