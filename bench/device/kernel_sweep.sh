#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/kernel_sweep.sh OUTDIR ["FLAGS" ...] (< 10 minutes).
# Which build of one format's kernels (prefetch, rows in flight, decoder) is fastest on the host's Xeon?
#   [FMT=fp8_block] [TIERS=avx512f] [EXEC_MODE=w4a8] [EXEC_ISA=tier] [SWEEP_TEST=1] bench/device/kernel_sweep.sh OUTDIR ["FLAGS" ...]
# Each variant is a set of -D build knobs passed through CXX so the build re-compiles (fp8_block: CPUMOE_FP8_PF,
# _PF_LOC, _DROWS, _GROWS, _FP16, _AMX_PF, _AMX_SPAN; bf16: CPUMOE_BF16_PF, _PF_LOC; q4_0 amx: CPUMOE_Q4_AMX_PAIR;
# x16 layouts: CPUMOE_Q4X16_PF, CPUMOE_NVX16_PF, CPUMOE_E2M1X16_PF, CPUMOE_X16_PF_LOC; nvfp4 / ds_fp4: CPUMOE_FP4_PF).
# Per variant: the single-thread formats bench (TIERS forced, same-run ceiling), with SWEEP_TEST=1 the format's tests
# (every tier forced in turn), and the executor bench at all cores (batch 1 and 8, random and shared routing;
# EXEC_ISA caps its tier, EXEC_MODE picks the precision mode). Summary in OUTDIR/summary.txt.
set -uo pipefail
OUT=${1:?usage: bench/device/kernel_sweep.sh OUTDIR [variants...]}
FMT=${FMT:-fp8_block}
TIERS=${TIERS:-avx512f}
shift
mkdir -p "$OUT"
[ $# -gt 0 ] || set -- ""
T0=$(date +%s)
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
. bench/device/cpu_setup.sh
i=0
for v in "$@"; do
  i=$((i + 1))
  (cd packages/cpumoe-formats && CXX="c++ $v" python3 hatch_build.py) >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  echo "== variant $i [${v:-default}] built at +$(( $(date +%s) - T0 )) s" | tee -a "$OUT/summary.txt"
  timeout 150 python3 -m cpumoe_formats.bench --formats "$FMT" --tiers "$TIERS" --repeats 7 --steps 20 \
    --json "$OUT/formats-v$i.json" >> "$OUT/logs.txt" 2>&1
  if [ -n "${SWEEP_TEST:-}" ]; then  # the fp8 tests of this build, every tier forced in turn
    echo "tests: $(cd packages/cpumoe-formats && timeout 150 python3 -m pytest -q -p no:cacheprovider \
      "tests/test_$FMT.py" tests/test_batch_identity.py -k "$FMT" 2>&1 | tail -1)" | tee -a "$OUT/summary.txt"
  fi
  timeout 150 env ${EXEC_ISA:+CPUMOE_ISA=$EXEC_ISA} python3 -m cpumoe_executor.bench --format "$FMT" ${EXEC_MODE:+--mode $EXEC_MODE} --batch 1,8 --routing both --repeats 5 --steps 20 \
    --json "$OUT/executor-v$i.json" >> "$OUT/logs.txt" 2>&1
  python3 - "$OUT/formats-v$i.json" "$OUT/executor-v$i.json" "$FMT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try:
    f = json.load(open(sys.argv[1]))["formats"][sys.argv[3]]
    print("single thread:", ", ".join(f"{k} {r['gbps']['median']:.2f} GB/s [{r['gbps']['min']:.2f}-{r['gbps']['max']:.2f}] "
                                      f"{100 * r['ratio']:.0f}%" for k, r in f["results"].items()),
          f"(ceiling {f['ceiling']['median']:.2f})")
except Exception as ex:
    print("single thread: no result", ex)
try:
    e = json.load(open(sys.argv[2]))["formats"][sys.argv[3]]
    print(f"executor {e['isa']} b1 {e['gbps']:.1f} GB/s of {e['ceiling_gbps']:.1f} ({100 * e['ratio']:.0f}%), "
          f"shared b8/b1 {e.get('shared_batch8_over_batch1', float('nan')):.2f}, "
          f"random b8/b1 {e.get('random_batch8_over_batch1', float('nan')):.2f}")
except Exception as ex:
    print("executor: no result", ex)
PY
done
echo "done at +$(( $(date +%s) - T0 )) s" | tee -a "$OUT/summary.txt"
