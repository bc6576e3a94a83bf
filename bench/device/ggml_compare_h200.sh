#!/usr/bin/env bash
# Issue 39 on the lent GPU host's CPU, by hand: OUT=DIR bench/device/ggml_compare_h200.sh (one call of < 10 min).
# bench/llamacpp/compare.sh there: ggml's CPU backend built from the carried .ggml/ggml and .ggml/VERSION
# (bench/llamacpp/build.sh, -march=native on that Xeon), ours built in place first (incremental); 15 threads, the GGUF
# formats (FORMATS, default "q8_0 q4_k_m q5_k_m q4_k q6_k"), batch 1 and 8, DRAM and L3 working sets (sysfs LLC),
# ROUNDS (2) interleaved rounds within BUDGET_S (420). $OUT gets summary.md, summary.json, and the logs with env.txt as one
# tarball (a call brings back 8 files). PF_AB=1 adds the prefetch A/B below.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mkdir -p "${OUT:-$ROOT/gpu-out}" && cd "${OUT:-$ROOT/gpu-out}" && pwd)
P=$ROOT/packages
export PYTHONUNBUFFERED=1 CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-$(nproc)}
export PYTHONPATH=$P/cpumoe-formats/src:$P/cpumoe-executor/src
cd "$ROOT" || exit 1
for p in cpumoe-formats cpumoe-executor; do  # in place, incremental: a tree changed since the last call is rebuilt
  (cd "$P/$p" && python3 hatch_build.py) >"/tmp/build-$p.log" 2>&1 || { tail -40 "/tmp/build-$p.log"; exit 1; }
done
C=/tmp/ggml-compare
rm -rf "$C"
OUT=$C THREADS=${THREADS:-15} ROUNDS=${ROUNDS:-2} WSET=dram,l3 BATCH=1,8 BUDGET_S=${BUDGET_S:-420} QUIET_MAX_WAIT=5 \
  FORMATS=${FORMATS:-"q8_0 q4_k_m q5_k_m q4_k q6_k"} bash bench/llamacpp/compare.sh >"$OUT/compare.log" 2>&1
echo "compare rc=$?"
cp "$C"/summary.md "$C"/summary.json "$OUT"/ 2>/dev/null
tar czf "$OUT/compare-logs.tgz" -C "$C" logs env.txt
tail -5 "$OUT/compare.log"; cat "$OUT/summary.md" 2>/dev/null | head -40
# PF_AB=1: then ours alone, CPUMOE_X16_PREFETCH on / off alternating (PF_ROUNDS, default 2), PF_FORMATS (q4_k,q8_0) at
# batch 1 and 8 from DRAM: the avx512vnni GGUF x16 kernels' software prefetch measured on this Intel host (auto keeps it
# on off AMD); JSONs in prefetch-ab.tgz, one summary line per run.
if [ "${PF_AB:-0}" = 1 ]; then
  mkdir -p /tmp/pf
  for i in $(seq "${PF_ROUNDS:-2}"); do
    for pf in on off; do
      CPUMOE_X16_PREFETCH=$pf timeout 150 python3 -m cpumoe_executor.bench --format "${PF_FORMATS:-q4_k,q8_0}" \
        --model qwen3-30b --batch 1,8 --routing random --threads "${THREADS:-15}" --repeats 3 \
        --json "/tmp/pf/pf-$pf-r$i.json" >"/tmp/pf/pf-$pf-r$i.log" 2>&1
      echo "prefetch $pf round $i rc=$?"; grep -E "GB/s, .* us/step" "/tmp/pf/pf-$pf-r$i.log" | sed 's/^/  /'
    done
  done
  tar czf "$OUT/prefetch-ab.tgz" -C /tmp pf
fi
