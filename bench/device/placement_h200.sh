#!/usr/bin/env bash
# Issue 40 on the lent H200 host, by hand: STAGE=test|profile|hot|split|auto|replay|prefill bench/device/placement_h200.sh OUT
# (each stage under 10 min; builds the native packages in place first when kernelio's is missing).
# test:    the placement / split suites with their cuda cases (zero-copy reads of page-locked banks, counts on the GPU)
# profile: moe-engine bench --profile at Qwen3-30B-A3B's shape, bf16 and fp8_block (the profile auto reads; + PNG)
# hot:     hot vs random at equal slots, 8 layers under CUDA graphs, batch 1 and 8 (FORMAT=bf16|fp8_block)
# split:   0% resident: CPU-only misses, GPU-only zero-copy, split fractions (both formats)
# auto:    the grid residency 0/10/25/50/90% for FORMAT and BATCH (1 or 8): each q and auto's pick (profile first)
# replay:  1,000 replays, hot re-placement every 50 steps, split q=0.3, against eager bit for bit (batch 1 and 8)
# prefill: staged prefill from page-locked banks (copy_GBps against the profile's h2d) and the crossover re-measured
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mkdir -p "${1:-$ROOT/gpu-out}" && cd "${1:-$ROOT/gpu-out}" && pwd)
PY=${PYTHON:-python3}
P=$ROOT/packages
export PYTHONUNBUFFERED=1 CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-$(nproc)} XDG_CACHE_HOME=${XDG_CACHE_HOME:-$OUT/cache}
export PYTHONPATH=$P/cpumoe-formats/src:$P/cpumoe-executor/src:$P/gpusync-cuda/src:$P/gpusync-hip/src:$P/kernelio/src:$P/moe-engine-glue/src${PYTHONPATH:+:$PYTHONPATH}
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then  # wheels the host's image lacks (as glue_h200.sh)
  for w in "$ROOT"/.whl/*.whl; do
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" >/dev/null 2>&1 || true
  done
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if ! ls "$P"/kernelio/src/kernelio/_native*.so >/dev/null 2>&1 || [ "${REBUILD:-0}" = 1 ]; then
  for p in cpumoe-formats cpumoe-executor gpusync-cuda gpusync-hip kernelio; do  # in place, as glue_h200.sh
    (cd "$P/$p" && $PY hatch_build.py) >"$OUT/build-$p.log" 2>&1 || { tail -40 "$OUT/build-$p.log"; exit 1; }
  done
fi
cd "$ROOT" || exit 1
B="$PY -m moe_engine.tools.bench_placement"
F=${FORMAT:-bf16}
case "${STAGE:-test}" in
  test) timeout 540 $PY -m pytest -p no:cacheprovider -q -rfEs packages/moe-engine-glue/tests/test_runner_split.py \
          packages/moe-engine-glue/tests/test_runner_placement.py packages/moe-engine-glue/tests/test_placement*.py ;;
  profile) timeout 540 $PY -m moe_engine.tools.cli bench --profile --preset qwen3-30b-a3b --formats bf16,fp8_block \
          --out "$OUT/profile_h200.json" --png "$OUT/profile_h200.png" ;;
  hot) timeout 540 $B hot --formats "$F" --residencies 0.1,0.25,0.5 --json "$OUT/placement_hot_${F}_h200.json" ;;
  split) timeout 540 $B split --formats bf16,fp8_block --qs 0.2,0.3,0.4,0.5 --json "$OUT/placement_split_h200.json" ;;
  auto) timeout 570 $B auto --formats "$F" --batch "${BATCH:-1}" --qs 0.2,0.35,0.5 --warmup 150 --steps 100 \
          --profile "$OUT/profile_h200.json" --json "$OUT/placement_auto_${F}_b$(echo "${BATCH:-1}" | tr , -)_h200.json" ;;
  replay) timeout 540 $B replay --formats bf16 --json "$OUT/placement_replay_h200.json" ;;
  prefill) timeout 540 $PY -m moe_engine.tools.bench prefill --pin-memory --repeats 3 \
          --json "$OUT/moe_engine_prefill_pinned_h200.json" ;;
esac
