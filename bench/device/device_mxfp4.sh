#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/device_mxfp4.sh OUTDIR (< 8 minutes).
# mxfp4 in both layouts (the gpt-oss / Triton transposed one and the CPU panel repack, mxfp4_panel) on the host's CPU
# (16 Xeon cores, AVX-512 + VNNI + BF16 + AMX, no network):
#   1. builds cpumoe-formats + cpumoe-executor in place (cpu_setup.sh),
#   2. tests: test_mxfp4.py, test_mxfp4_panel.py (every mode x every tier this CPU has, bit identity of the two
#      layouts on real AVX-512), the batch-identity tests and the executor's tests,
#   3. the single-thread formats bench for both formats (every mode x tier, gpt-oss shape, DRAM working set),
#   4. the executor bench at THREADS threads (default 16), batch 1 and 8, random and shared routing, in MODE (default
#      w4a8), ROUNDS (default 3) rounds alternating the two layouts so the shared host's swings hit both alike.
# Logs, JSON and summary.txt land in OUTDIR. Through the device tool: run(command="bench/device/device_mxfp4.sh $OUT",
# carry=[".whl"]).
set -uo pipefail
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
THREADS=${THREADS:-16}
MODE=${MODE:-w4a8}
ROUNDS=${ROUNDS:-3}
. bench/device/cpu_setup.sh
rc=0
echo "== tests" | tee "$OUT/summary.txt"
(cd packages/cpumoe-formats && timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_mxfp4.py \
  tests/test_mxfp4_panel.py tests/test_batch_identity.py tests/test_validation.py tests/test_dispatch.py) \
  > "$OUT/test-formats.log" 2>&1 || rc=1
echo "formats: $(tail -1 "$OUT/test-formats.log")" | tee -a "$OUT/summary.txt"
(cd packages/cpumoe-executor && timeout 240 python3 -m pytest -q -p no:cacheprovider tests) \
  > "$OUT/test-executor.log" 2>&1 || rc=1
echo "executor: $(tail -1 "$OUT/test-executor.log")" | tee -a "$OUT/summary.txt"
echo "== formats bench (single thread)" | tee -a "$OUT/summary.txt"
timeout 240 python3 -m cpumoe_formats.bench --formats mxfp4,mxfp4_panel --tiers avx2,avx512f,avx512vnni --repeats 5 \
  --steps 10 --json "$OUT/bench-formats-mxfp4.json" > "$OUT/bench-formats-mxfp4.log" 2>&1 || rc=1
grep -E "^\| mxfp4" "$OUT/bench-formats-mxfp4.log" | tee -a "$OUT/summary.txt"
echo "== executor bench ($THREADS threads, mode $MODE, $ROUNDS rounds)" | tee -a "$OUT/summary.txt"
for r in $(seq "$ROUNDS"); do
  for f in mxfp4 mxfp4_panel; do
    timeout 120 python3 -m cpumoe_executor.bench --format "$f" --mode "$MODE" --batch 1,8 --routing both \
      --threads "$THREADS" --repeats 5 --steps 20 --json "$OUT/executor-$f-r$r.json" >> "$OUT/executor.log" 2>&1 || rc=1
    python3 - "$OUT/executor-$f-r$r.json" "$f" "$r" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try:
    e = json.load(open(sys.argv[1]))["formats"][sys.argv[2]]
    print(f"round {sys.argv[3]} {sys.argv[2]:12s} {e['isa']}: b1 {e['step_us']:.0f} us {e['gbps']:.1f} GB/s of "
          f"{e['ceiling_gbps']:.1f} ({100 * e['ratio']:.0f}%), shared b8/b1 "
          f"{e.get('shared_batch8_over_batch1', float('nan')):.2f}, random b8/b1 "
          f"{e.get('random_batch8_over_batch1', float('nan')):.2f}")
except Exception as ex:
    print(f"round {sys.argv[3]} {sys.argv[2]}: no result", ex)
PY
  done
done
exit $rc
