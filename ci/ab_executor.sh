#!/usr/bin/env bash
# A/B of executor sources on the lent GPU host (< 10 minutes): interleaved rounds, each builds the executor from
# one variant's csrc files and runs the executor bench, so both variants see the same minutes of a noisy host.
#   OUT=DIR [ROUNDS=2] [BENCH="--format nvfp4 --batch 1,8 --routing both --mode w4a8"] ci/ab_executor.sh A_DIR B_DIR
# A_DIR / B_DIR hold replacement files for $DEST (default packages/cpumoe-executor/csrc, e.g. executor.cpp), and
# the package in $PKG (default packages/cpumoe-executor) is rebuilt per variant (ci/ab_formats.sh sets both).
# Summary (per round and variant: format, batch, routing, us/step, % of the ceiling) in $OUT/ab.txt.
set -uo pipefail
: "${OUT:?set OUT}"
A=${1:?A_DIR}; B=${2:?B_DIR}
BENCH=${BENCH:---format nvfp4 --batch 1,8 --routing both --mode w4a8}
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
. ci/cpu_setup.sh
for r in $(seq "${ROUNDS:-2}"); do
  for v in "$A" "$B"; do
    cp "$v"/* "${DEST:-packages/cpumoe-executor/csrc}/"
    (cd "${PKG:-packages/cpumoe-executor}" && python3 hatch_build.py) >> "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
    echo "== round $r $(basename "$v")" | tee -a "$OUT/ab.txt"
    # shellcheck disable=SC2086
    timeout 200 python3 -m cpumoe_executor.bench $BENCH --repeats 5 --steps 20 --json "$OUT/r$r-$(basename "$v").json" \
      2>/dev/null | grep -E "^[a-z0-9_]+ +[a-z0-9+]+ +[0-9]+ +[0-9]+ " | tee -a "$OUT/ab.txt"
  done
done
