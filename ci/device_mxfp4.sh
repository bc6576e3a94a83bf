#!/usr/bin/env bash
# mxfp4 on the lent GPU host (16 Xeon cores, AVX-512 + VNNI + BF16, no network), < 3 minutes:
#   1. builds cpumoe-formats + cpumoe-executor in place,
#   2. runs tests/test_mxfp4.py (every mode x every tier this CPU has: scalar, avx2, avxvnni,
#      avx512f, avx512vnni, avx512bf16 -> the tier names the kernels report),
#   3. the single-thread formats bench for mxfp4 (every mode x tier, gpt-oss shape, DRAM working set),
#   4. the executor bench for mxfp4 at 16 threads, batch 1 and 8, shared and random routing, native
#      and (through CpuMoeExecutor(mode="w4a8")) w4a8.
# Usage (repository root):  ci/device_mxfp4.sh OUTDIR      (logs + JSON under OUTDIR)
#   through the device tool: run(command="ci/device_mxfp4.sh $OUT", carry=[".whl"])
#   THREADS (default 16) sets the executor benches' worker count.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
export THREADS=${THREADS:-16}
. ci/cpu_setup.sh
rc=0
echo "== tests/test_mxfp4.py"
(cd packages/cpumoe-formats && timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_mxfp4.py) \
  > "$OUT/test-mxfp4.log" 2>&1 || rc=1
grep -E "passed|failed|error" "$OUT/test-mxfp4.log" | tail -3
echo "== formats bench (single thread)"
timeout 120 python3 -m cpumoe_formats.bench --formats mxfp4 --repeats 3 --steps 10 \
  --json "$OUT/bench-formats-mxfp4.json" > "$OUT/bench-formats-mxfp4.log" 2>&1 || rc=1
tail -15 "$OUT/bench-formats-mxfp4.log"
echo "== executor bench ($THREADS threads)"
timeout 90 python3 -m cpumoe_executor.bench --format mxfp4 --batch 1,8 --routing both --threads "$THREADS" --repeats 2 \
  --steps 8 --json "$OUT/bench-executor-mxfp4.json" > "$OUT/bench-executor-mxfp4.log" 2>&1 || rc=1
tail -12 "$OUT/bench-executor-mxfp4.log"
echo "== executor, native and w4a8 ($THREADS threads, batch 1 and 8, shared routing)"
timeout 60 python3 - > "$OUT/executor-w4a8.log" 2>&1 <<'EOF' || rc=1
# Same method as cpumoe_executor.bench (dram working set, fresh experts per step), mode w4a8.
import os, statistics, time
import numpy as np
import cpumoe_formats as cf
from cpumoe_executor import CpuMoeExecutor
spec = cf.get_format("mxfp4")
H = I = 2880
K = 4
E = int(256e6 // spec.bytes_per_expert(H, I)) + K
rng = np.random.default_rng(0)
banks = spec.random_banks(E, H, I, rng)
for mode in ("native", "w4a8"):
    ex = CpuMoeExecutor("mxfp4", [banks], top_k=K, activation="swigluoai", alpha=1.702, limit=7.0, max_tokens=8,
                        threads=int(os.environ["THREADS"]), mode=mode)
    res = {}
    for T in (1, 8):
        x = rng.standard_normal((T, H)).astype(np.float32)
        w = np.full((T, K), 1 / K, np.float32)
        ts = []
        for s in range(30):
            ids = np.tile(((np.arange(K) + s * K) % E).astype(np.int32), (T, 1))
            t = time.perf_counter()
            ex.decode(0, x, w, ids)
            ts.append(time.perf_counter() - t)
        res[T] = statistics.median(ts[3:])
        print(f"{ex.isa:16s} T={T} shared: step {res[T] * 1e6:.0f} us, "
              f"{K * spec.bytes_per_expert(H, I) / res[T] / 1e9:.1f} GB/s", flush=True)
    print(f"{ex.isa:16s} batch 8 / batch 1 = {res[8] / res[1]:.2f}", flush=True)
    ex.close()
EOF
cat "$OUT/executor-w4a8.log" | tail -8
exit $rc
