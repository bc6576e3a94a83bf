#!/usr/bin/env bash
# Run by hand on the lent H200 host: OUT=DIR bench/device/device_cpu.sh STAGE...
# The CPU-side suites and benches on the host's CPU (16 Xeon cores, AVX-512, no network): builds formats + executor in
# place (cpu_setup.sh) and runs each STAGE named (test-formats, test-executor, bench-formats, bench-executor); logs
# under $OUT (default /tmp/out). BENCH_FORMATS_ARGS and BENCH_EXECUTOR_ARGS add bench arguments.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device/cpu_setup.sh
rc=0
for what in "$@"; do
  case $what in
    test-formats) (cd packages/cpumoe-formats && python3 -m pytest -q -p no:cacheprovider tests -k "not bench") > "$OUT/test-formats.log" 2>&1 || rc=1; tail -3 "$OUT/test-formats.log" ;;
    test-executor) (cd packages/cpumoe-executor && python3 -m pytest -q -p no:cacheprovider tests -k "not bench") > "$OUT/test-executor.log" 2>&1 || rc=1; tail -3 "$OUT/test-executor.log" ;;
    bench-formats) python3 -m cpumoe_formats.bench ${BENCH_FORMATS_ARGS:-} --json "$OUT/bench-formats-h200host.json" --markdown "$OUT/bench-formats-h200host.md" > "$OUT/bench-formats.log" 2>&1 || rc=1; tail -25 "$OUT/bench-formats.log" ;;
    bench-executor) python3 -m cpumoe_executor.bench ${BENCH_EXECUTOR_ARGS:-} --json "$OUT/bench-executor-h200host.json" > "$OUT/bench-executor.log" 2>&1 || rc=1; tail -40 "$OUT/bench-executor.log" ;;
  esac
done
exit $rc
