#!/usr/bin/env bash
# Issue 40 on the lent H200 host, by hand: STAGE="STAGE ..." bench/device/placement_h200.sh OUT. The stages run in
# turn within BUDGET_S seconds of the start, the build included (default 570: one device call; the native packages
# are built in place first when kernelio's is missing); a stage that would start with under 60 s left is skipped.
# The profile lives at PROFILE (default /tmp/placement/profile_SUF.json, SUF the GPU: h100 or h200; OUT is fresh per device call), so a later
# call's `auto` on the same warm machine reads it; it is copied into OUT too.
# test:    the placement / split suites with their cuda cases (zero-copy reads of page-locked banks, counts on the GPU)
# profile: moe-engine bench --profile at Qwen3-30B-A3B's shape, bf16 and fp8_block (the profile auto reads; + PNG)
# hot:     hot vs random at equal slots, 8 layers under CUDA graphs, batch 1 and 8 (FORMAT=bf16|fp8_block)
# split:   0% resident: CPU-only misses, GPU-only zero-copy, split fractions QS under each split rule RULES (default
#          expert,step), FORMATS (default both) at BATCH (default 1,8); REPEATS rounds, as auto
# auto:    the grid residency RES (default 0/10/25/50/90%) for FORMAT and BATCH (1 or 8): each q and auto's pick
#          (profile first); one runner per residency, 500 warm-up steps, then REPEATS (default 5) rounds of every q
#          in turn on the same 25 + STEPS (default 200) steps of routes; the median
# replay:  1,000 replays, hot re-placement every 50 steps, split q=0.3 (split rule RULE, default the runner's), against
#          eager bit for bit (batch 1 and 8)
# prefill: staged prefill from page-locked banks (copy_GBps against the profile's h2d) and the crossover re-measured
set -uo pipefail
END=$(( $(date +%s) + ${BUDGET_S:-570} ))  # the build counts too
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
SUF=${SUF:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -oE 'H[0-9]+' | head -1 | tr H h)}
SUF=${SUF:-h200}  # outputs are named for the GPU the call got (h100 or h200)
PROFILE=${PROFILE:-/tmp/placement/profile_$SUF.json}
mkdir -p "$(dirname "$PROFILE")"
stage() {  # $1: the stage; $2: its own limit in seconds (cut to what is left of BUDGET_S)
  local left=$(( END - $(date +%s) )) t=$2
  [ "$left" -lt 60 ] && { echo "[$(date +%T)] skip $1: ${left}s left"; return 0; }
  [ "$left" -lt "$t" ] && t=$left
  echo "[$(date +%T)] $1 (limit ${t}s)"
  case "$1" in
  test) timeout "$t" $PY -m pytest -p no:cacheprovider -q -rfEs packages/moe-engine-glue/tests/test_runner_split.py packages/moe-engine-glue/tests/test_pinning.py \
          packages/moe-engine-glue/tests/test_runner_placement.py packages/moe-engine-glue/tests/test_placement*.py ;;
  profile) timeout "$t" $PY -m moe_engine.tools.cli bench --profile --preset qwen3-30b-a3b --formats bf16,fp8_block \
          --out "$PROFILE" --png "$OUT/profile_${SUF}.png" && cp "$PROFILE" "$OUT/profile_${SUF}.json" ;;
  hot) timeout "$t" $B hot --formats "$F" --residencies 0.1,0.25,0.5 --json "$OUT/placement_hot_${F}_${SUF}.json" ;;
  split) timeout "$t" $B split --formats "${FORMATS:-bf16,fp8_block}" --batch "${BATCH:-1,8}" --qs "${QS:-0.2,0.3,0.4,0.5}" \
          --rules "${RULES:-step,expert}" --repeats "${REPEATS:-5}" \
          --json "$OUT/placement_split_$(echo "${FORMATS:-all}" | tr , -)_b$(echo "${BATCH:-1,8}" | tr , -)_${SUF}.json" ;;
  auto) timeout "$t" $B auto --formats "$F" --batch "${BATCH:-1}" --residencies "${RES:-0,0.1,0.25,0.5,0.9}" --qs 0.2,0.35,0.5 --warmup 500 --settle 25 --steps "${STEPS:-200}" --repeats "${REPEATS:-5}" \
          --profile "$PROFILE" --json "$OUT/placement_auto_${F}_b$(echo "${BATCH:-1}" | tr , -)_${SUF}.json" ;;
  replay) timeout "$t" $B replay --formats bf16 ${RULE:+--rule "$RULE"} --json "$OUT/placement_replay${RULE:+_$RULE}_${SUF}.json" ;;
  prefill) timeout "$t" $PY -m moe_engine.tools.bench prefill --pin-memory --repeats 3 \
          --json "$OUT/moe_engine_prefill_pinned_${SUF}.json" ;;
  *) echo "STAGE $1: expected test, profile, hot, split, auto, replay or prefill"; return 2 ;;
  esac
}
rc=0
for s in ${STAGE:-test}; do
  stage "$s" 570 || rc=$?
done
exit $rc
