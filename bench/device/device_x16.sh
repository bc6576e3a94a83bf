#!/usr/bin/env bash
# Run by hand on the lent H200 host: OUT=DIR bench/device/device_x16.sh (< 10 minutes; knobs below).
# The _x16 CPU layouts: their tests (every tier this CPU has, bit identity against scalar), one-thread kernel timings
# against the row-major format (bench/device/current_kernel.py), then interleaved
# executor benches of the format as given (--repack off) and repacked (--repack auto), both routings, batch 1 and 8.
#   OUT=DIR [ROUNDS=2] [PAIRS="fp8_block:native"] [RUNS="off::off auto::auto"] bench/device/device_x16.sh
# PAIRS: format:mode items (the row-major format; its cpu_layout is the x16 one). RUNS: name:isa:repack items, one
# bench each per round and format (isa: a CPUMOE_ISA cap, empty for none). Summary in $OUT/x16.txt.
set -uo pipefail
: "${OUT:?set OUT}"
PAIRS=${PAIRS:-fp8_block:native}
RUNS=${RUNS:-off::off auto::auto}
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
. bench/device/cpu_setup.sh
log() { echo "$*" | tee -a "$OUT/x16.txt"; }
for p in $PAIRS; do
  f=${p%%:*}; m=${p##*:}; x=$(python3 -c "import cpumoe_formats as cf; print(cf.get_format('$f').cpu_layout)")
  log "== $f -> $x ($m) tests"
  (cd packages/cpumoe-formats && timeout 240 python3 -m pytest -q -p no:cacheprovider "tests/test_$x.py" \
     tests/test_batch_identity.py tests/test_tier_identity.py -k "$x" 2>&1 | tail -2) | tee -a "$OUT/x16.txt"
  read -r H I <<<"$(python3 -c "from cpumoe_formats.bench import PRESETS as P; p=P['$f']; print(p.H, p.I)")"
  for run in $RUNS; do
    IFS=: read -r name isa rp <<<"$run"
    fmt=$([ "$rp" = off ] && echo "$f" || echo "$x")
    log "$fmt (CPUMOE_ISA=$isa) kernel 1 thread H=$H I=$I: $(CPUMOE_ISA=$isa python3 \
      bench/device/current_kernel.py "$fmt" "$H" "$I" "$m")"
  done
done
(cd packages/cpumoe-executor && timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -1) \
  | sed 's/^/executor test_decode: /' | tee -a "$OUT/x16.txt"
for r in $(seq "${ROUNDS:-2}"); do
  for p in $PAIRS; do
    f=${p%%:*}; m=${p##*:}
    for run in $RUNS; do
      IFS=: read -r name isa rp <<<"$run"
      log "== round $r $f $name (CPUMOE_ISA=$isa --repack $rp)"
      CPUMOE_ISA=$isa timeout 200 python3 -m cpumoe_executor.bench --format "$f" --mode "$f=$m" --batch 1,8 \
        --routing both --repack "$rp" --repeats 5 --steps 20 --json "$OUT/r$r-$f-$name.json" 2>/dev/null \
        | grep -E "^[a-z0-9_>]+ +[a-z0-9+]+ +[0-9]+ +[0-9]+ " | tee -a "$OUT/x16.txt"
    done
  done
done
(cd "$OUT" && tar czf benches.tgz r*.json && rm -f r*.json)
