#!/usr/bin/env bash
# Run by hand on the lent H200 host: OUT=DIR [STAGE=test|bench|all] bench/device/device_roofline.sh.
# The compute roof, in two calls of < 10 minutes (the build stays between them):
#   STAGE=test : build, one-thread peak_loop rates per tier and kind, the peak and _x16 tests at every tier this
#                CPU has (bit identity against scalar), the executor bench smoke tests;
#   STAGE=bench: the executor bench of every format (batch 1 and 8, both routings, w4a8) with its roofline columns.
# Summaries in $OUT/*.txt, the bench in $OUT/roofline.json.
set -uo pipefail
: "${OUT:?set OUT}"
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
. bench/device/cpu_setup.sh
STAGE=${STAGE:-all}
if [ "$STAGE" != bench ]; then
  python3 - <<'PY' | tee "$OUT/peak.txt"
import time

import cpumoe_formats as cf

for tier in cf.usable_tiers()[1:]:
    for kind in cf.PEAK_KINDS:
        best = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            n = cf.peak_loop(kind, tier, 200_000)
            best = max(best, n / (time.perf_counter() - t0) / 1e9)
        print(f"one thread {tier:>10} {kind:>4}: {best:8.1f} G multiply-adds/s")
PY
  (cd packages/cpumoe-formats && timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_peak.py \
     tests/test_nvfp4_x16.py tests/test_q4_0_x16.py tests/test_ds_fp4_x16.py tests/test_mxfp4_x16.py \
     tests/test_batch_identity.py tests/test_tier_identity.py -k "peak or x16" 2>&1 | tail -3) | tee "$OUT/tests.txt"
  (cd packages/cpumoe-executor && timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_bench.py 2>&1 \
     | tail -1) | sed 's/^/executor test_bench: /' | tee -a "$OUT/tests.txt"
fi
if [ "$STAGE" != test ]; then
  timeout 480 python3 -m cpumoe_executor.bench --format bf16,nvfp4,mxfp4,ds_fp4,q4_0,fp8_block --batch 1,8 \
    --routing both --mode w4a8 --repeats 5 --steps 20 --json "$OUT/roofline.json" 2>"$OUT/bench.log" \
    | tee "$OUT/bench.txt"
fi
