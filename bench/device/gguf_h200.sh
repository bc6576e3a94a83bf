#!/usr/bin/env bash
# Issue 39's GPU-host figures, by hand: STAGE=cpu|triton|replay bench/device/gguf_h200.sh OUT  (calls of < 10 min; the
# in-place build of the first is reused by the next on a warm machine).
# cpu:    the executor at Qwen3-30B-A3B's shape per GGUF format (q4_0 q4_k q5_k q6_k q8_0), batch 1 and 8, random and
#         shared routes, THREADS (15) workers, against the host's read ceiling (the bench measures it in the same run)
# triton: the GPU experts per GGUF format and the Q4_K_M pair under a CUDA graph (bench/gpu_experts.py, float64 check)
# replay: hybrid with a Q4_K_M model (8 layers, Q6_K downs by use_more_bits) under CUDA graphs: step times per
#         residency, then 1,000 replays with changing routes and residency, bit for bit against eager
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mkdir -p "${1:-$ROOT/gpu-out}" && cd "${1:-$ROOT/gpu-out}" && pwd)
PY=${PYTHON:-python3}
P=$ROOT/packages
THREADS=${THREADS:-15}
export PYTHONUNBUFFERED=1 CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-$(nproc)}
export PYTHONPATH=$P/cpumoe-formats/src:$P/cpumoe-executor/src:$P/gpusync-cuda/src:$P/gpusync-hip/src:$P/kernelio/src:$P/moe-engine-glue/src${PYTHONPATH:+:$PYTHONPATH}
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then  # wheels the host's image lacks (as glue_h200.sh)
  for w in "$ROOT"/.whl/*.whl; do
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" >/dev/null 2>&1 || true
  done
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if ! ls "$P"/kernelio/src/kernelio/_native*.so >/dev/null 2>&1 || [ "${REBUILD:-0}" = 1 ]; then
  for p in cpumoe-formats cpumoe-executor gpusync-cuda gpusync-hip kernelio; do
    (cd "$P/$p" && $PY hatch_build.py) >"$OUT/build-$p.log" 2>&1 || { tail -40 "$OUT/build-$p.log"; exit 1; }
  done
fi
cd "$ROOT" || exit 1
case "${STAGE:-cpu}" in
  cpu) timeout 560 $PY -m cpumoe_executor.bench --format q4_0,q4_k,q5_k,q6_k,q8_0 --model qwen3-30b --batch 1,8 \
         --routing both --threads "$THREADS" --json "$OUT/executor_gguf_h200.json" ;;
  triton) timeout 560 $PY bench/gpu_experts.py --formats q4_0,q8_0,q4_k,q6_k,q4_k/q6_k --json "$OUT/gpu_experts_gguf_h200.json" ;;
  replay) timeout 560 $PY -m moe_engine.tools.bench step --formats q4_k_m --layers 8 --batch 1,8 --residency 0,0.25,0.5 \
         --repeats 5 --check-replays 1000 --json "$OUT/moe_engine_step_q4_k_m_h200.json" ;;
esac
