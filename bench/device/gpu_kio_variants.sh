#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/gpu_kio_variants.sh OUTDIR ["NAME:ENV=V,ENV=V" ...].
# The kernel path's handshake under several environments, interleaved in one run (the host is shared: compare
# variants within a run, never across runs). Builds in place (SKIP_BUILD=1 reuses), runs kernelio's CUDA tests and
# the handshake graph-replay tests (SKIP_TESTS=1 skips them), then per round (ROUNDS, default 2) and variant
# `python -m gpusync_cuda.bench --paths kernel --batches 1,8` with that variant's environment (default:
# KERNELIO_WAIT=poll against =memop). Summary (batch 1/8 round trip with and without a CPU route, minus_service_us of
# the bench JSON, floor) in OUTDIR/summary.txt.
set -uo pipefail
OUT=$(mkdir -p "${1:?usage: bench/device/gpu_kio_variants.sh OUTDIR [variants]}" && cd "$1" && pwd)
shift
[ $# -gt 0 ] || set -- "poll:KERNELIO_WAIT=poll" "memop:KERNELIO_WAIT=memop"
source "$(dirname "$0")/gpu_setup.sh"
if [ -z "${SKIP_TESTS:-}" ]; then
  run tests-kernelio 120 3 $PY -m pytest -q -p no:cacheprovider packages/kernelio/tests
  run tests-handshake 200 3 $PY -m pytest -q -p no:cacheprovider tests-integration/test_gpu_handshake.py
fi
for round in $(seq "${ROUNDS:-2}"); do
  for v in "$@"; do
    name=${v%%:*}; envs=${v#*:}
    run "bench-$name-$round" 90 4 env ${envs//,/ } $PY -m gpusync_cuda.bench --paths kernel --batches 1,8 \
      --json "$OUT/$name-$round.json"
  done
done
$PY - "$OUT" "$@" <<'PY' | tee "$OUT/summary.txt"
import json, sys, glob, os
out = sys.argv[1]
for v in sys.argv[2:]:
    name = v.split(":")[0]
    for f in sorted(glob.glob(os.path.join(out, f"{name}-*.json"))):
        d = json.load(open(f))
        row = {(r["batch"], r["cpu_routes"]): r for r in d["results"]}
        b1, b8 = row.get((1, "1/token"), {}), row.get((8, "1/token"), {})
        n1, n8 = row.get((1, "none"), {}), row.get((8, "none"), {})
        fl = d["floor"]["roundtrip"]["us_per_op_median"]
        g = lambda r, k="us_per_layer_median": f"{r.get(k, float('nan')):6.2f}"
        print(f"{os.path.basename(f):14} floor {fl:5.2f} | b1 rt {g(b1)} svc {g(b1, 'cpu_service_us_per_layer')} "
              f"rt-svc {g(b1, 'minus_service_us')} (target {fl + 1.5:5.2f}) | b8 rt-svc {g(b8, 'minus_service_us')} "
              f"| no route b1 {g(n1)} b8 {g(n8)}")
PY
echo "total: $(($(date +%s) - t0)) s"
exit $rc
