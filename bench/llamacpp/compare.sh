#!/usr/bin/env bash
# Our executor's MoE decode step against llama.cpp's ggml CPU backend, same shapes, batches, routing, threads
# and working-set rule (DRAM and/or cache-resident), interleaved round by round so both see the same minutes of a
# noisy machine.
#
#   OUT=dir THREADS=n ROUNDS=3 bench/llamacpp/compare.sh
#
# env (defaults):
#   OUT        (required) results folder: ours-<fmt>[-w4a8][-l3]-r<R>.json, ggml-<fmt>[-l3]-r<R>.json, logs/,
#              env.txt, summary.md, summary.json
#   THREADS    (nproc) worker threads for both sides
#   ROUNDS     (3)     interleaved rounds (odd rounds run ours first, even rounds ggml first)
#   REPEATS    (5)     timed repeats per (format, batch, routing), each of STEPS steps
#   STEPS      (20)
#   BATCH      (1,8)
#   FORMATS    ("q4_0 mxfp4 bf16") at gemma4-26b, gpt-oss-120b, qwen3-30b; q8_0, q4_k, q5_k, q6_k (GGUF types) and
#              q4_k_m (a Q4_K_M layer: gate/up q4_k, down q6_k; ours runs the executor's format pair) and q5_k_m
#              (a Q5_K_M layer: gate/up q5_k, down q6_k) at qwen3-30b
#   WSET       (dram)  comma list of working sets, each run on both sides: dram (--working-set dram: the bank
#              >= 4 x LLC, windows rotated per step), l3 (--working-set cache: one window, the same experts every
#              step, reloaded by an untimed step after each evicting read; bench/llamacpp/README.md)
#   LLC        ()      the cache size both sides size the DRAM bank, the evicting reads and our ceiling buffer by
#              (--llc, e.g. 96M; default: the L3 size sysfs reports, which a VM may understate: README)
#   LOCK       ()      a file: every timed run (its quiet check included) holds flock on it, so benches of other
#              sessions that take the same lock never overlap ours (e.g. LOCK=/work/bench.lock)
#   BUDGET_S   (510)   a round starts only if the time so far plus the longest round so far stays within
#                      this many seconds (the build and round 1 always run); the summary uses the rounds that ran
#   GGML_BIND  (0)     1: OMP_PROC_BIND=close OMP_PLACES=cores for ggml (llama.cpp sets neither by default;
#                      ours pins its workers to cores)
#   GGML_ARGS  ()      extra moe_ggml_bench arguments (e.g. --no-extra-bufts = llama.cpp --no-repack)
#   OURS_ARGS  ()      extra cpumoe_executor.bench arguments (e.g. --repack off: the given formats row-major)
#   QUIET_PCT  (15)    before each run wait until the machine's CPUs were at most this % busy over 1 s
#   QUIET_MAX_WAIT (20) ... but no longer than this many seconds (0: do not wait); every run's busy % and wait
#                      go to OUT/logs/quiet.csv (the machine's noise, for the record)
#   RERUN_PCT  (0)     run again where processes other than the run kept more than this % of all CPUs busy during it
#   RERUNS     (2)     ... at most this many times (every attempt's % goes to OUT/logs/during.csv; 0 % = off)
#   PYTHON     (python3)
# ggml is built (bench/llamacpp/build.sh) if needed, from the sources in .ggml/ (bench/llamacpp/fetch_ggml.sh);
# ours must already be built in place (this script never rebuilds packages/).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
: "${OUT:?set OUT=results folder}"
THREADS=${THREADS:-$(nproc)}
ROUNDS=${ROUNDS:-3}
REPEATS=${REPEATS:-5}
STEPS=${STEPS:-20}
BATCH=${BATCH:-1,8}
FORMATS=${FORMATS:-"q4_0 mxfp4 bf16"}
WSET=${WSET:-dram}
LOCK=${LOCK:-}
LLC=${LLC:-}
RERUN_PCT=${RERUN_PCT:-0}
RERUNS=${RERUNS:-2}
BUDGET_S=${BUDGET_S:-510}
GGML_BIND=${GGML_BIND:-0}
GGML_ARGS=${GGML_ARGS:-}
OURS_ARGS=${OURS_ARGS:-}
PY=${PYTHON:-python3}
mkdir -p "$OUT/logs"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
say() { echo "[compare $(printf '%4d' "$(elapsed)")s] $*" >&2; }

QUIET_T0=$T0
. "$ROOT/bench/llamacpp/quiet.sh"  # busy_pct, wait_quiet

model_of() {
    case $1 in
        q4_0) echo gemma4-26b ;;
        mxfp4) echo gpt-oss-120b ;;
        bf16|q8_0|q4_k|q5_k|q6_k|q4_k_m|q5_k_m) echo qwen3-30b ;;
        *) echo "compare.sh: no model for format $1" >&2; exit 2 ;;
    esac
}

WSETS=${WSET//,/ }
for w in $WSETS; do
    [[ $w == dram || $w == l3 ]] || { echo "compare.sh: WSET entry $w: expected dram or l3" >&2; exit 2; }
done
wset_arg() { if [[ $1 == l3 ]]; then echo cache; else echo dram; fi; }  # both sides' --working-set
wset_suffix() { if [[ $1 == l3 ]]; then echo -l3; fi; }                 # in the file names

if [[ -n $LOCK ]]; then exec 9>> "$LOCK"; fi
lock() {  # label: take LOCK (if set) before a run's quiet check and timed run
    [[ -n $LOCK ]] || return 0
    if ! flock -n 9; then say "$1: waiting for $LOCK"; flock 9; fi
}
unlock() { [[ -z $LOCK ]] || flock -u 9; }

say "building ggml + bench (log: $OUT/logs/build.log)"
bench/llamacpp/build.sh > "$OUT/logs/build.log" 2>&1 || { cat "$OUT/logs/build.log" >&2; exit 1; }
GGML_BENCH=$ROOT/.ggml/build/moe_ggml_bench

export PYTHONPATH=packages/cpumoe-formats/src:packages/cpumoe-executor/src${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import cpumoe_executor, cpumoe_formats" 2> "$OUT/logs/import.log"; then
    cat "$OUT/logs/import.log" >&2
    echo "compare.sh: our packages do not import from packages/*/src (build them in place first)" >&2
    exit 1
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "repo: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- packages 2>/dev/null || echo ' (packages/ modified)')"
    echo "threads: $THREADS rounds: $ROUNDS repeats: $REPEATS steps: $STEPS batch: $BATCH formats: $FORMATS wset: $WSET"
    echo "lock: ${LOCK:-none} rerun_pct: $RERUN_PCT reruns: $RERUNS llc: ${LLC:-sysfs}"
    echo "ggml_bind: $GGML_BIND ggml_args: $GGML_ARGS ours_args: $OURS_ARGS"
    echo "nproc: $(nproc)"
    echo "llc: $(cat /sys/devices/system/cpu/cpu0/cache/index3/size 2>/dev/null || echo unknown)"
    echo "gcc: $(gcc --version | head -1)"
    echo "python: $("$PY" --version 2>&1) numpy $("$PY" -c 'import numpy; print(numpy.__version__)')"
    sed 's/^/ggml: /' .ggml/VERSION 2>/dev/null || true
    echo "ggml build flags: $(cat .ggml/build/flags 2>/dev/null)"
    echo "--- lscpu"
    lscpu 2>/dev/null || true
} > "$OUT/env.txt"

timed() {  # label command...: the command under LOCK after the quiet check; while processes other than ours kept
          # more than RERUN_PCT % of the CPUs busy during it (logs/during.csv), again, at most RERUNS times
    local label=$1 a o mark t0 rc note
    shift
    for ((a = 1; ; a++)); do
        lock "$label"
        (( QUIET_MAX_WAIT > 0 )) && wait_quiet "$label" "$OUT/logs/quiet.csv"
        note=
        (( a > 1 )) && note=" (attempt $a)"
        say "round ${label##*-r}: $label$note"
        mark=$(cpu_mark)
        t0=$(date +%s)
        rc=0
        "$@" || rc=$?
        o=$(others_pct "$mark")
        unlock
        [[ -f $OUT/logs/during.csv ]] || echo "run,attempt,others_pct_during,seconds" > "$OUT/logs/during.csv"
        echo "$label,$a,$o,$(( $(date +%s) - t0 ))" >> "$OUT/logs/during.csv"
        (( rc == 0 )) || return $rc
        if (( RERUN_PCT > 0 && o > RERUN_PCT && a <= RERUNS )); then
            say "$label: other processes kept ${o}% of the CPUs busy during it: again ($a of $RERUNS)"
            continue
        fi
        return 0
    done
}

run_ours() {  # fmt round wset [mode]
    local fmt=$1 r=$2 mode=${4:-} tag=$1
    local args=(--format "$fmt" --model "$(model_of "$fmt")" --batch "$BATCH" --routing both --threads "$THREADS"
                --repeats "$REPEATS" --steps "$STEPS" --working-set "$(wset_arg "$3")")
    if [[ -n $LLC ]]; then args+=(--llc "$LLC"); fi
    if [[ -n $mode ]]; then args+=(--mode "$mode"); tag=$fmt-$mode; fi
    tag=$tag$(wset_suffix "$3")
    ours_cmd() {
        "$PY" -m cpumoe_executor.bench "${args[@]}" $OURS_ARGS --json "$OUT/ours-$tag-r$r.json" \
            > "$OUT/logs/ours-$tag-r$r.txt" 2> "$OUT/logs/ours-$tag-r$r.err"
    }
    timed "ours-$tag-r$r" ours_cmd \
        || { tail -20 "$OUT/logs/ours-$tag-r$r.err" >&2; echo "compare.sh: ours $tag failed" >&2; exit 1; }
}

run_ours_all() {  # fmt round wset: the default mode, then w4a8 where the default is not w4a8 (ggml's q4_0 and
                  # mxfp4 multiply q8_0 activations: vec_dot_type Q8_0)
    local fmt=$1 r=$2 mode
    run_ours "$fmt" "$r" "$3"
    mode=$("$PY" -c "import json,sys; e=json.load(open(sys.argv[1]))['formats'][sys.argv[2]]
print(e.get('mode') or e['isa'].partition('+')[2])" "$OUT/ours-$fmt$(wset_suffix "$3")-r$r.json" "$fmt")
    if [[ $fmt != bf16 && $mode != w4a8 ]]; then
        run_ours "$fmt" "$r" "$3" w4a8
    fi
}

run_ggml() {  # fmt round wset
    local fmt=$1 r=$2 tag rc=0 ws
    tag=$fmt$(wset_suffix "$3")
    ws=$(wset_arg "$3")
    local envs=() llc=()
    if [[ $GGML_BIND == 1 ]]; then envs=(OMP_PROC_BIND=close OMP_PLACES=cores); fi
    if [[ -n $LLC ]]; then llc=(--llc "$LLC"); fi
    ggml_cmd() {
        # shellcheck disable=SC2086
        env ${envs[@]+"${envs[@]}"} "$GGML_BENCH" --format "$fmt" --batch "$BATCH" --routing both \
            --threads "$THREADS" --repeats "$REPEATS" --steps "$STEPS" --working-set "$ws" ${llc[@]+"${llc[@]}"} $GGML_ARGS \
            --json "$OUT/ggml-$tag-r$r.json" > "$OUT/logs/ggml-$tag-r$r.txt" 2> "$OUT/logs/ggml-$tag-r$r.err"
    }
    timed "ggml-$tag-r$r" ggml_cmd || rc=$?
    if (( rc )); then
        tail -20 "$OUT/logs/ggml-$tag-r$r.err" >&2
        echo "compare.sh: ggml $tag failed (rc $rc; 3 = output check failed)" >&2
        exit 1
    fi
}

longest=0
for ((r = 1; r <= ROUNDS; r++)); do
    if (( r > 1 && $(elapsed) + longest > BUDGET_S )); then
        say "budget: $(elapsed)s so far + ${longest}s for a round > BUDGET_S=${BUDGET_S}s: stopping after $((r - 1)) rounds"
        break
    fi
    t_round=$(elapsed)
    for w in $WSETS; do
        for fmt in $FORMATS; do
            if (( r % 2 )); then run_ours_all "$fmt" "$r" "$w"; run_ggml "$fmt" "$r" "$w"
            else run_ggml "$fmt" "$r" "$w"; run_ours_all "$fmt" "$r" "$w"; fi
        done
    done
    t_round=$(( $(elapsed) - t_round ))
    (( t_round > longest )) && longest=$t_round
    say "round $r took ${t_round}s"
done

"$PY" bench/llamacpp/summarize.py "$OUT"
say "done: $OUT/summary.md"
