#!/usr/bin/env bash
# docs/end-to-end.md's decode-at-depth table in one command: llama.cpp's llama-bench and ours on the same full-size
# GGUF and threads, tg after 0, 512 and 2048 tokens already in the cache (llama-bench's -d; ours `moe-engine bench
# -d`), ours with its decode attention (--attention auto, the default) and with transformers' sdpa
# (--attention sdpa, what it ran before). One tool at a time, ours each in a fresh process.
#
#   bench/e2e_depth_2core.sh [F.gguf]    # default /tmp/qwen3moe-q4_0.gguf (bench/e2e_2core.sh writes it); ~20 min
#
# env: OUT (/tmp/e2e_depth_2core: the raw files), JSON (docs/results/end_to_end_depth_2core.json), THREADS (2),
#      DEPTHS (0,512,2048), N (32 decoded tokens), ROUNDS (3), BIN (.ggml/llama-cpu/bin), PYTHON (python3: one with
#      torch and transformers), LLAMA (1; 0 = keep OUT's llama-bench.json from an earlier run).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
F=${1:-/tmp/qwen3moe-q4_0.gguf}
OUT=${OUT:-/tmp/e2e_depth_2core}
JSON=${JSON:-$ROOT/docs/results/end_to_end_depth_2core.json}
THREADS=${THREADS:-2}
DEPTHS=${DEPTHS:-0,512,2048}
N=${N:-32}
ROUNDS=${ROUNDS:-3}
BIN=${BIN:-$ROOT/.ggml/llama-cpu/bin}
PY=${PYTHON:-python3}
export PYTHONPATH=$ROOT/packages/cpumoe-formats/src:$ROOT/packages/cpumoe-executor/src:$ROOT/packages/moe-engine-glue/src${PYTHONPATH:+:$PYTHONPATH}
[[ -f $F ]] || { echo "no $F: bench/e2e_2core.sh writes it (or moe_engine.tools.synth --kind gguf-q4_0)" >&2; exit 1; }
[[ -x $BIN/llama-bench ]] || { echo "no $BIN/llama-bench: bench/llamacpp/build_llama_bench.sh, or BIN=" >&2; exit 1; }
mkdir -p "$OUT"
say() { echo "[e2e-depth $(date +%T)] $*" >&2; }
{ echo "date $(date -u +%FT%TZ)"; echo "loadavg $(cut -d' ' -f1-3 /proc/loadavg)"; uname -a
  grep -m1 'model name' /proc/cpuinfo; echo "nproc $(nproc)"; free -b | head -2; } > "$OUT/env.txt"

$PY -c "import torch, transformers" || { echo "$PY lacks torch or transformers: set PYTHON=" >&2; exit 1; }
if [[ ${LLAMA:-1} == 1 ]]; then
    say "llama-bench -t $THREADS -p 0 -n $N -d $DEPTHS -r $ROUNDS"
    BIN=$BIN OUT=$OUT NAME=llama-bench LOAD_CHECK=0 bench/llamacpp/run_llama_bench.sh "$F" -t "$THREADS" -p 0 -n "$N" \
        -d "$DEPTHS" -r "$ROUNDS"
fi
for att in auto sdpa; do
    say "moe-engine bench --attention $att"
    $PY -m moe_engine.tools.cli bench "$F" -t "$THREADS" -p 0 -n "$N" -d "$DEPTHS" -r "$ROUNDS" --json --quiet \
        --attention "$att" > "$OUT/ours-$att.json" 2> "$OUT/ours-$att.err"
done

$PY - "$OUT" "$F" "$THREADS" "$JSON" <<'PY'
import json, os, sys
out, f, threads, dest = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
llama = json.load(open(os.path.join(out, "llama-bench.json")))
res = {"file": {"path": f, "bytes": os.path.getsize(f)}, "threads": threads,
       "env": open(os.path.join(out, "env.txt")).read().splitlines(), "llama_cpp": llama}
for att in ("auto", "sdpa"):
    res[f"moe_engine_attention_{att}"] = json.load(open(os.path.join(out, f"ours-{att}.json")))
table = []
for r in llama:
    d = r.get("n_depth", 0)
    row = {"depth": d, "n_gen": r["n_gen"], "llama_cpp_tok_s": r["avg_ts"]}
    for att in ("auto", "sdpa"):
        ours = next(o for o in res[f"moe_engine_attention_{att}"]["results"] if o["n_depth"] == d and o["n_gen"])
        row[f"ours_{att}_tok_s"] = ours["avg_ts"]
        row[f"ours_{att}_over_llama"] = ours["avg_ts"] / r["avg_ts"]
    table.append(row)
res["table"] = table
json.dump(res, open(dest, "w"), indent=1)
print(json.dumps(table, indent=1))
PY
say "wrote $JSON"
