#!/usr/bin/env bash
# Run by hand on the lent H200 host: bench/device/gpu_memfork.sh OUTDIR (under 4 minutes).
# The copy step's fork/join (GPUSYNC_COPY_FORK; issue 4: memop path <= memop floor + 3 us at batch 1), measured both
# ways in one run, with the tests that exercise it:
# 1. builds the four packages in place (gpu_setup.sh; SKIP_BUILD=1 reuses extensions already in the tree);
# 2. python -m gpusync_cuda.bench --batches 1,8 --paths memop,kernel with GPUSYNC_COPY_FORK=0, then =1
#    -> OUTDIR/bench-fork0.json, OUTDIR/bench-fork1.json; prints, for each, the memop path's round trip with no CPU
#    route minus the raw memop floor measured in the same run (issue 4's number), and the verdict lines;
# 3. gpusync-cuda's tests (CUDA and fake-driver ones: the fork's graph, both probes with each value);
# 4. tests-integration/test_gpu_handshake.py for the copy paths (memop, host-func: eager + 1,000 graph replays
#    bit-identical to the executor) with GPUSYNC_COPY_FORK=1, then =0. (The kernel path does not use the copy step.)
set -uo pipefail
OUT=$(mkdir -p "${1:?usage: bench/device/gpu_memfork.sh OUTDIR}" && cd "$1" && pwd)
source "$(dirname "$0")/gpu_setup.sh"
for f in 0 1; do
  run "bench-fork$f" 100 14 env GPUSYNC_COPY_FORK=$f $PY -m gpusync_cuda.bench --batches 1,8 --paths memop,kernel \
    --json "$OUT/bench-fork$f.json"
done
# Issue 4's reading: the memop path's per-layer round trip with no CPU route (the handshake and its copies
# alone) minus the raw memop floor (write done, write ready, wait answered by a CPU thread) of the same run.
$PY - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
for f in ("0", "1"):
    p = os.path.join(out, f"bench-fork{f}.json")
    if not os.path.exists(p):
        print(f"GPUSYNC_COPY_FORK={f}: no {p}")
        continue
    res = json.load(open(p))
    floor = ((res.get("floor") or {}).get("roundtrip") or {}).get("us_per_op_median")
    mode = res["paths"].get("memop", "")
    mode = "forked" if "copies forked" in mode else "serial" if "copies serial" in mode else f"? ({mode})"
    print(f"GPUSYNC_COPY_FORK={f} (memop probe: copies {mode}), floor {floor} us")
    for r in res["results"]:
        if r.get("path") != "memop" or "skipped" in r:
            continue
        med, ok = r["us_per_layer_median"], r["last_output_matches_cpu"]
        # With a CPU route the handshake is the round trip minus the CPU task alone (bench.verdict's reading).
        hs = r.get("minus_task_us", med)
        what = f"{med:.2f} us/layer" + (f", minus the CPU task {hs:.2f}" if "minus_task_us" in r else "")
        over = f"{hs - floor:+.2f} us over the floor (target <= +3.00)" if floor else "no floor in this run"
        print(f"  memop batch {r['batch']} cpu routes {r['cpu_routes']:>7}: {what}; {over}; matches cpu: {ok}")
    for line in res.get("verdict", []):
        print("  " + line)
EOF
run tests-gpusync-cuda 150 6 $PY -m pytest -p no:cacheprovider -q -s -rfEs packages/gpusync-cuda/tests \
  -m "cuda or not gpu"
grep -oE "GPUSYNC_COPY_FORK=. (memop|host-func): .*" "$OUT/tests-gpusync-cuda.log" | cut -c1-240
for f in 1 0; do
  run "tests-integration-fork$f" 150 6 env GPUSYNC_COPY_FORK=$f $PY -m pytest -p no:cacheprovider -q -s -rfEs \
    tests-integration/test_gpu_handshake.py -m cuda -k "not kernel"
  grep -oE "path=[a-z/-]+ wait=.*" "$OUT/tests-integration-fork$f.log"
done
echo "total: $(($(date +%s) - t0)) s"
exit $rc
