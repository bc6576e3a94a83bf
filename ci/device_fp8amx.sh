#!/usr/bin/env bash
# fp8_block on AMX vs avx512f on the lent GPU host's Xeon (< 10 minutes): tests (fp8 at every tier, batch
# identity, dispatch, bf16 amx), single-thread formats bench (fp8_block and bf16 at avx512f and amx), executor
# bench at all cores for fp8_block with CPUMOE_ISA=amx and =avx512f (batch 1 and 8, random and shared routing).
#   OUT=DIR [ISAS="amx avx512f"] [SANITIZE=1] ci/device_fp8amx.sh
set -uo pipefail
: "${OUT:?set OUT}"
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
. ci/cpu_setup.sh
echo "built"
(cd packages/cpumoe-formats && timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_block.py \
  tests/test_batch_identity.py tests/test_dispatch.py tests/test_bf16.py -k "fp8 or amx or dispatch" 2>&1 | tail -15) \
  | tee "$OUT/tests.txt"
(cd packages/cpumoe-executor && timeout 120 python3 -m pytest -q -p no:cacheprovider tests -k fp8 2>&1 | tail -3) \
  | tee -a "$OUT/tests.txt"
timeout 150 python3 -m cpumoe_formats.bench --formats fp8_block,bf16 --tiers avx512f,amx --repeats 7 --steps 20 \
  --json "$OUT/formats.json" > /tmp/fbench.log 2>&1; tail -12 /tmp/fbench.log
for isa in ${ISAS:-amx avx512f}; do
  timeout 150 env CPUMOE_ISA=$isa python3 -m cpumoe_executor.bench --format fp8_block --batch 1,8 --routing both \
    --repeats 5 --steps 20 --json "$OUT/exec-$isa.json" > /tmp/ebench.log 2>&1; echo "== executor CPUMOE_ISA=$isa"; tail -8 /tmp/ebench.log
done
# SANITIZE=1: then the AMX paths under ASan+UBSan (the dev box has no AMX, so only here do they run sanitized)
if [ "${SANITIZE:-0}" = 1 ]; then
  PYTHON=python3 CPUMOE_BUILD_JOBS=16 timeout 400 ci/sanitize.sh asan -k "fp8 or amx or dispatch" > "$OUT/asan.txt" 2>&1
  echo "asan rc=$?"; grep -E "passed|failed|ERROR|Sanitizer" "$OUT/asan.txt" | tail -8
fi
