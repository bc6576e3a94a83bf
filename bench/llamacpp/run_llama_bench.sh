#!/usr/bin/env bash
# llama.cpp's own llama-bench on one GGUF file, with what llama-bench does not report: peak RSS and wall time
# (/usr/bin/time -v) and the model's load time (llama-simple's `load time`, a 4-token generation after the bench).
#
#   bench/llamacpp/run_llama_bench.sh F.gguf                         # -t 2 -p 64 -n 32 -r 3
#   OUT=/work/results NAME=q4_0-pp32 bench/llamacpp/run_llama_bench.sh F.gguf -t 2 -p 32 -n 16 -r 3
#   BIN=.ggml/llama-cuda/bin bench/llamacpp/run_llama_bench.sh F.gguf -ngl 99 --n-cpu-moe 48 -t 15 -p 512 -n 128
#
# Writes OUT/NAME.json (llama-bench -o json), NAME.time (time -v), NAME.load.txt (llama-simple's log),
# NAME.env.txt (machine, busy % before, free memory, file, BUILD_INFO) and prints one summary line.
# env: BIN (.ggml/llama-cpu/bin; a folder with run.sh runs the tools through it), OUT (/tmp/llama-bench),
#      NAME (the file's stem), QUIET_PCT / QUIET_MAX_WAIT (15 % / 20 s: see quiet.sh), LOAD_CHECK (1).
# Build the tools first: bench/llamacpp/build_llama_bench.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[[ $# -ge 1 && -f $1 ]] || { echo "usage: $0 MODEL.gguf [llama-bench args] (got ${1:-nothing})" >&2; exit 2; }
MODEL=$1; shift
ARGS=("$@"); (( ${#ARGS[@]} )) || ARGS=(-t 2 -p 64 -n 32 -r 3)
BIN=${BIN:-$ROOT/.ggml/llama-cpu/bin}
OUT=${OUT:-/tmp/llama-bench}
NAME=${NAME:-$(basename "$MODEL" .gguf)}
LOAD_CHECK=${LOAD_CHECK:-1}
. "$ROOT/bench/llamacpp/quiet.sh"
[[ -x $BIN/llama-bench ]] || { echo "no $BIN/llama-bench (run bench/llamacpp/build_llama_bench.sh)" >&2; exit 1; }
tool() {  # TOOL ARGS: through run.sh (which puts the CUDA libraries on the path) where the folder has one
    if [[ -x $BIN/run.sh ]]; then echo "$BIN/run.sh" "$1"; else echo "$BIN/$1"; fi
}
mkdir -p "$OUT"

threads=4
for ((i = 0; i < ${#ARGS[@]}; i++)); do [[ ${ARGS[i]} == -t ]] && threads=${ARGS[i + 1]%%,*}; done
wait_quiet "$NAME" "$OUT/quiet.csv"
{
    echo "date $(date -u +%FT%TZ)"
    echo "host $(hostname) cpu $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //') nproc $(nproc)"
    echo "busy_pct_before $(tail -1 "$OUT/quiet.csv" | cut -d, -f2) loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "mem_available_mb $(awk '/MemAvailable/ {print int($2 / 1024)}' /proc/meminfo)"
    echo "model $MODEL $(stat -c %s "$MODEL") bytes"
    echo "args ${ARGS[*]}"
    cat "$BIN/BUILD_INFO" 2>/dev/null | head -3
} > "$OUT/$NAME.env.txt"
read -r -a bench <<< "$(tool llama-bench)"
read -r -a simple <<< "$(tool llama-simple)"
/usr/bin/time -v -o "$OUT/$NAME.time" "${bench[@]}" -m "$MODEL" "${ARGS[@]}" -o json > "$OUT/$NAME.json" 2> "$OUT/$NAME.err"
if [[ $LOAD_CHECK == 1 ]]; then
    "${simple[@]}" -m "$MODEL" -t "$threads" -n 4 "the cat" > "$OUT/$NAME.load.txt" 2>&1 || true
fi
python3 - "$OUT/$NAME" <<'PY'
import json, re, sys
p = sys.argv[1]
rows = json.load(open(p + ".json"))
t = open(p + ".time").read()
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", t).group(1)) / 1e6
wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", t).group(1)
try:
    load = re.search(r"load time =\s+([\d.]+) ms", open(p + ".load.txt").read()).group(1) + " ms"
except (OSError, AttributeError):
    load = "n/a"
tests = "  ".join(f"{'pp' + str(r['n_prompt']) if r['n_prompt'] else 'tg' + str(r['n_gen'])} "
                  f"{r['avg_ts']:.2f} +- {r['stddev_ts']:.2f} tok/s" for r in rows)
print(f"{p.rsplit('/', 1)[-1]}: {tests}  threads {rows[0]['n_threads']}  peak RSS {rss:.2f} GB  wall {wall}  "
      f"load {load}")
PY
