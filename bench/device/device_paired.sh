#!/usr/bin/env bash
# Run by hand on the lent H200 host: OUT=DIR [REPEATS=11] [FORMATS=bf16,...] [BUDGET=480] bench/device/device_paired.sh.
# The acceptance points of issue 3 on the host's CPU, with paired repeats (the bench interleaves batch 1 and 8 of both
# routings per repeat): every format at its model preset, w4a8, batch 1 and 8, both routings. One bench process per
# format (a killed run loses one format, not the report), merged into paired.json and paired.png with the bench's own
# table and plot.
set -uo pipefail
: "${OUT:?set OUT}"
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
. bench/device/cpu_setup.sh
REPEATS=${REPEATS:-11}
FORMATS=${FORMATS:-bf16,nvfp4,mxfp4,ds_fp4,q4_0,fp8_block}
end=$(( $(date +%s) + ${BUDGET:-480} ))
for f in ${FORMATS//,/ }; do
  left=$(( end - $(date +%s) ))
  [ "$left" -gt 20 ] || { echo "$f: skipped, out of time" | tee -a "$OUT/bench.log"; continue; }
  timeout "$left" python3 -m cpumoe_executor.bench --format "$f" --batch 1,8 --routing both --mode w4a8 \
    --repeats "$REPEATS" --steps 20 --json "$OUT/part-$f.json" 2>>"$OUT/bench.log" >/dev/null \
    || echo "$f: bench exit $?" | tee -a "$OUT/bench.log"
done
python3 - "$OUT" <<'PY' | tee "$OUT/bench.txt"
import glob, json, sys
from cpumoe_executor import bench
out = sys.argv[1]
parts = sorted(glob.glob(f"{out}/part-*.json"))
report = json.load(open(parts[0]))
for p in parts[1:]:
    report["formats"].update(json.load(open(p))["formats"])
json.dump(report, open(f"{out}/paired.json", "w"), indent=1)
print(bench.table(report))
bench.plot(report, f"{out}/paired.png")
PY
rm -f "$OUT"/part-*.json
