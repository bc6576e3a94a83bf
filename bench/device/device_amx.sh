#!/usr/bin/env bash
# Run by hand on the lent H200 host: OUT=DIR bench/device/device_amx.sh (< 10 minutes; knobs below).
# A format's AMX tier against the tier below on the host's Xeon: the format's tests (every tier forced in turn, batch
# identity, dispatch, bf16 amx), the single-thread formats bench at TIERS, the executor bench at all cores per
# CPUMOE_ISA in ISAS (batch 1 and 8, random and shared routing), and with SANITIZE=1 the AMX paths under ASan+UBSan
# (ci/sanitize.sh; the dev box has no AMX, so only here do they run sanitized).
#   OUT=DIR [FMT=fp8_block] [MODE=w4a8] [TIERS="avx512f,amx"] [ISAS="amx avx512f"] [SANITIZE=1] bench/device/device_amx.sh
set -uo pipefail
: "${OUT:?set OUT}"
FMT=${FMT:-fp8_block}
TIERS=${TIERS:-avx512f,amx}
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
. bench/device/cpu_setup.sh
echo "built"
(cd packages/cpumoe-formats && timeout 240 python3 -m pytest -q -p no:cacheprovider "tests/test_$FMT.py" \
  tests/test_batch_identity.py tests/test_dispatch.py tests/test_bf16.py -k "$FMT or amx or dispatch" 2>&1 | tail -4) \
  | tee "$OUT/tests.txt"
(cd packages/cpumoe-executor && timeout 120 python3 -m pytest -q -p no:cacheprovider tests -k "${FMT%_block}" 2>&1 \
  | tail -2) | tee -a "$OUT/tests.txt"
timeout 150 python3 -m cpumoe_formats.bench --formats "$FMT" --tiers "$TIERS" --repeats 7 --steps 20 \
  --json "$OUT/formats.json" > /tmp/fbench.log 2>&1; tail -8 /tmp/fbench.log
for isa in ${ISAS:-amx avx512f}; do
  timeout 200 env CPUMOE_ISA=$isa python3 -m cpumoe_executor.bench --format "$FMT" ${MODE:+--mode $MODE} --batch 1,8 \
    --routing both --repeats 5 --steps 20 --json "$OUT/exec-$isa.json" > /tmp/ebench.log 2>&1
  echo "== executor CPUMOE_ISA=$isa"; tail -7 /tmp/ebench.log
done
if [ "${SANITIZE:-0}" = 1 ]; then
  PYTHON=python3 timeout 400 ci/sanitize.sh asan -k "$FMT or amx or dispatch" > "$OUT/asan.txt" 2>&1
  echo "asan rc=$?"; grep -E "passed|failed|ERROR|Sanitizer" "$OUT/asan.txt" | tail -8
fi
