#!/usr/bin/env bash
# Run by hand on the lent GPU host: STAGE=prep|llama|ours OUT=DIR bench/device/e2e_h200.sh (calls of < 10 min on one
# warm machine; each stage reuses what the one before left in the tree and /tmp/e2e).
# prep:  our packages built in place; llama.cpp's llama-bench built for CUDA (sm_90) from the source carried as
#        .ggml/llama-src.tar.xz (bench/llamacpp/build_llama_bench.sh, FlashAttention kernels left out: a shorter
#        build, the experts' mul_mat_id unchanged); the full-size Qwen3-30B-A3B GGUF (experts Q4_0, rest BF16) written
#        by moe_engine.tools.synth --random-codes to /tmp/e2e. Then the glue's GPU tests (GLUE_TESTS=1).
# llama: llama-bench -ngl 99 --n-cpu-moe N for N = 48 36 24 0 (all, 3/4, 1/2, none of the experts on the CPU): pp and
#        tg (P, N_GEN, R), JSON per N.
# fresh: one call on a fresh machine: ours built, the file written, the GPU decode tests (every buffer on the GPU,
#        the step captured), then `ours`, then `llama` for NCPU_AFTER (a ratio needs both on one machine). llama.cpp's
#        CUDA tools come from .ggml/llama-cuda-bin.tar.xz when carried (built here with build_llama_bench.sh, its
#        llama-bench stripped and packed: ~27 MB), else they are built there first (~8 min: the call then runs out).
#        FRESH_TESTS=0 leaves the tests out.
# profile: token_profile on the GPU for each of STRATS (default "cpu"; gpu = every expert on the GPU: the floor of
#        the non-expert part): the parts with a sync at each hook, GraphLoop's captured step and generate() apart,
#        the experts alone; JSON per strategy (tp-STRATEGY.json).
# ours:  moe-engine bench on the same file for each of OURS (default "cpu hybrid"): strategy cpu; hybrid with
#        gpu_memory holding the non-expert weights, the KV cache and a quarter of the expert bytes (as --n-cpu-moe 36),
#        its slots in every layer; hybrid-layers: the same budget as whole layers (--residency layers, the last 12
#        layers' experts, as --n-cpu-moe 36 places); RUN+compile: the same with the step compiled by inductor before
#        its capture (--decode compile). Decode under CUDA graphs.
# fp8:   the FP8-block 30B checkpoint (Qwen3-30B-A3B shape, ~31 GB of safetensors) written to /tmp/e2e/fp8 by synth
#        --kind fp8 --random-codes (our packages built first on a fresh machine), then `moe-engine generate` with
#        --gpu-memory 16GiB through GraphLoop (FP8_LOOP, default graph), FP8_TOKENS tokens (32), peak RSS from
#        getrusage (one host copy of the experts, fp8_block_x16, which the GPU loads from); JSON fp8-generate.json.
#        FP8_HOST_MEMORY (e.g. 40GiB) passes --host-memory (it decides only for layouts that are not byte moves);
#        JSON fp8-generate-hostFP8_HOST_MEMORY.json. FP8_LAYERS=N writes and runs an N-layer cut instead
#        (/tmp/e2e/fp8-LN, JSON fp8-generate-LN.json): 24 layers write and load in half the time.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mkdir -p "${OUT:-$ROOT/gpu-out}" && cd "${OUT:-$ROOT/gpu-out}" && pwd)
PY=${PYTHON:-python3}
P=$ROOT/packages
W=/tmp/e2e
GGUF=$W/qwen3moe-q4_0.gguf
THREADS=${THREADS:-15}
PP=${PP:-512} NG=${NG:-32} R=${R:-2}
export PYTHONUNBUFFERED=1 CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-$(nproc)}
export PYTHONPATH=$P/cpumoe-formats/src:$P/cpumoe-executor/src:$P/gpusync-cuda/src:$P/gpusync-hip/src:$P/kernelio/src:$P/moe-engine-glue/src
mkdir -p "$W"
export OUT
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  for w in "$ROOT"/.whl/*.whl; do
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" >/dev/null 2>&1 || true
  done
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
cd "$ROOT" || exit 1
stamp() { echo "[$(date +%T)] $*"; }
case "${STAGE:-prep}" in
prep)
  stamp "start; $(nproc) cores; $(free -g | awk '/Mem/ {print $2}') GiB"
  ( mkdir -p .ggml && tar xJf .ggml/llama-src.tar.xz -C .ggml && \
    CUDA=1 CUDA_FA=0 JOBS=${LLAMA_JOBS:-10} OUT=$ROOT/.ggml/llama-cuda bench/llamacpp/build_llama_bench.sh ) >"$OUT/llama-build.log" 2>&1 &
  lb=$!
  sy=
  for p in cpumoe-formats cpumoe-executor gpusync-cuda gpusync-hip kernelio; do
    (cd "$P/$p" && $PY hatch_build.py) >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    if [ -z "$sy" ]; then  # the writer imports cpumoe_formats: it starts once that is built
      $PY -m moe_engine.tools.synth --kind gguf-q4_0 --random-codes --quiet --out "$GGUF" >"$OUT/synth.log" 2>&1 &
      sy=$!
    fi
  done
  stamp "ours built"
  if [ "${GLUE_TESTS:-1}" = 1 ]; then
    timeout 300 $PY -m pytest -p no:cacheprovider -q -rfEs packages/moe-engine-glue/tests >"$OUT/glue.log" 2>&1
    stamp "glue tests rc=$?"; grep -E "passed|failed" "$OUT/glue.log" | tail -3; grep -E "^FAILED" "$OUT/glue.log" | head -20
  fi
  wait $sy; stamp "gguf rc=$? $(ls -la $GGUF 2>/dev/null | awk '{print $5}') bytes"
  wait $lb; stamp "llama build rc=$?"; tail -3 "$OUT/llama-build.log"
  ls -la .ggml/llama-cuda/bin 2>/dev/null | head
  ;;
fresh)
  stamp "start; $(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader)"
  lb=
  if [ ! -x .ggml/llama-cuda/bin/run.sh ] && [ -f .ggml/llama-cuda-bin.tar.xz ]; then  # built elsewhere and carried
    mkdir -p .ggml/llama-cuda && tar xJf .ggml/llama-cuda-bin.tar.xz -C .ggml && mv .ggml/llama-cuda-bin .ggml/llama-cuda/bin
  fi
  if [ ! -x .ggml/llama-cuda/bin/run.sh ]; then
    ( mkdir -p .ggml && tar xJf .ggml/llama-src.tar.xz -C .ggml && CUDA=1 CUDA_FA=0 JOBS=8 OUT=$ROOT/.ggml/llama-cuda \
      bench/llamacpp/build_llama_bench.sh ) >/tmp/llama-build.log 2>&1 &
    lb=$!
  fi
  sy=
  for p in cpumoe-formats cpumoe-executor gpusync-cuda gpusync-hip kernelio; do
    (cd "$P/$p" && $PY hatch_build.py) >>/tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
    if [ -z "$sy" ]; then  # the writer imports cpumoe_formats: it starts once that is built
      [ -f "$GGUF" ] || $PY -m moe_engine.tools.synth --kind gguf-q4_0 --random-codes --quiet --out "$GGUF" >/tmp/synth.log 2>&1 &
      sy=$!
    fi
  done
  stamp "ours built"
  if [ "${FRESH_TESTS:-1}" = 1 ]; then
    timeout 200 $PY -m pytest -p no:cacheprovider -q -rfEs packages/moe-engine-glue/tests/test_from_pretrained.py \
      packages/moe-engine-glue/tests/test_runner_split.py -k "captured or buffers or zero_copy or split" >"$OUT/tests.log" 2>&1
    stamp "tests rc=$?"; tail -4 "$OUT/tests.log"
  fi
  wait $sy; stamp "gguf $(stat -c %s "$GGUF") bytes"
  # ours runs alone: a compiler beside it took 8 of the 16 cores from the first cpu run (stop 44)
  [ -n "${lb:-}" ] && { wait $lb; stamp "llama build rc=$? $(tail -1 /tmp/llama-build.log)"; }
  STAGE=ours bash "$0"
  if [ -n "${NCPU_AFTER:-}" ]; then wait; STAGE=llama NCPU="$NCPU_AFTER" bash "$0"; fi
  ;;
llama)
  for n in ${NCPU:-48 36 24 0}; do
    timeout 200 .ggml/llama-cuda/bin/run.sh llama-bench -m "$GGUF" -ngl 99 --n-cpu-moe "$n" -t "$THREADS" \
      -p "$PP" -n "$NG" -r "$R" -o json >"$OUT/llama-ncpumoe$n.json" 2>"/tmp/llama-ncpumoe$n.err"
    stamp "n-cpu-moe $n rc=$?"
    $PY -c "import json,sys; [print(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), round(r['stddev_ts'],2)) for r in json.load(open(sys.argv[1]))]" "$OUT/llama-ncpumoe$n.json" 2>/dev/null
  done
  ;;
profile)
  for st in ${STRATS:-cpu}; do
    timeout ${PROFILE_TIMEOUT:-280} $PY -m moe_engine.tools.token_profile "$GGUF" --device cuda --strategy "$st" \
      -t "$THREADS" -n "${PROFILE_N:-16}" --rounds "${ROUNDS_P:-2}" --json "$OUT/tp-$st.json" >"$OUT/tp-$st.log" 2>&1
    stamp "profile $st rc=$?"; grep -v "^moe_engine:" "$OUT/tp-$st.log" | tail -14
  done
  ;;
fp8)
  if ! ls "$P"/kernelio/src/kernelio/_native*.so >/dev/null 2>&1; then  # a fresh machine: build first (~1-2 min)
    for p in cpumoe-formats cpumoe-executor gpusync-cuda kernelio; do
      (cd "$P/$p" && $PY hatch_build.py) >>/tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
    done
    stamp "ours built"
  fi
  d=$W/fp8${FP8_LAYERS:+-L$FP8_LAYERS}
  [ -f $d/config.json ] || { t=$(date +%s); $PY -m moe_engine.tools.synth --kind fp8 --random-codes --quiet --out $d \
    ${FP8_LAYERS:+--layers $FP8_LAYERS} >/tmp/synth-fp8.log 2>&1
    stamp "fp8 written rc=$? in $(( $(date +%s) - t )) s: $(du -sb $d | cut -f1) bytes"; }
  tag=${FP8_LAYERS:+-L$FP8_LAYERS}${FP8_HOST_MEMORY:+-host${FP8_HOST_MEMORY}}
  timeout ${FP8_TIMEOUT:-300} $PY - "$d" "${FP8_LOOP:-graph}" "${FP8_TOKENS:-32}" "$THREADS" "${FP8_HOST_MEMORY:-}" \
    >"$OUT/fp8-generate$tag.json" 2>"$OUT/fp8-generate$tag.err" <<'EOF'
import contextlib, io, json, resource, sys
from moe_engine.tools.cli import main
path, loop, n, t, host = sys.argv[1:6]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["generate", path, "--ids", "1,2,3", "--max-new-tokens", n, "--gpu-memory", "16GiB", "-t", t,
               "--loop", loop, "--json", "--quiet"] + (["--host-memory", host] if host else []))
res = json.loads(out.getvalue())
res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(res, indent=1))
sys.exit(rc)
EOF
  stamp "fp8 generate rc=$?"; grep -E "tok_s|load_s|peak|loop|graphs" "$OUT/fp8-generate$tag.json"
  grep -E "plan|graph|host memory|ready" "$OUT/fp8-generate$tag.err" | tail -6
  ;;
ours)
  budget=$($PY - <<'EOF'
# non-expert weights (bf16) + KV cache (4096 tokens) + reserve + a quarter of the expert bytes (Q4_0), as --n-cpu-moe 36
ne = (151936 * 2048 * 2 + 48 * (2048 * 4096 * 2 + 2048 * 512 * 2 * 2 + 128 * 2048) ) * 2
kv = 2 * 48 * 4 * 128 * 4096 * 2
experts = 48 * 128 * 3 * 2048 * 768 * 18 // 32
print(int(ne + kv + 1.5 * 2**30 + experts / 4))
EOF
)
  for run in ${OURS:-cpu hybrid}; do  # cpu | hybrid (the budget's slots in every layer) | hybrid-layers (whole layers)
    case ${run%+compile} in         # RUN+compile: the same with --decode compile (GraphLoop's step through inductor)
      cpu) args=(--strategy cpu) ;;
      hybrid) args=(--strategy hybrid --gpu-memory "$budget") ;;
      hybrid-layers) args=(--strategy hybrid --gpu-memory "$budget" --residency layers) ;;
    esac
    [ "$run" != "${run%+compile}" ] && args+=(--decode compile)
    timeout ${OURS_TIMEOUT:-280} $PY -m moe_engine.tools.cli bench "$GGUF" "${args[@]}" --device cuda -t "$THREADS" -p "$PP" -n "$NG" \
      -r "$R" --quiet --json >"$OUT/ours-${run/+/-}.json" 2>"$OUT/ours-${run/+/-}.err"  # no '+' in names: not fetched
    stamp "ours $run rc=$?"; grep -E "avg_ts|test|plan" "$OUT/ours-${run/+/-}.json" | head; tail -2 "$OUT/ours-${run/+/-}.err"
  done
  ;;
esac
