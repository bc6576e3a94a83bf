#!/usr/bin/env bash
# docs/end-to-end.md's 2-core table in one command: the full-size Qwen3-30B-A3B-shaped GGUF (written if missing),
# llama.cpp's llama-bench and ours on the same file and threads (pp64, tg32, peak RSS from /usr/bin/time -v),
# ours on the static path (oneDNN's packed linears) and transformers' default path too (what decode=auto buys),
# and the token profile with ggml's experts timed beside ours; all written to one JSON.
#
#   bench/e2e_2core.sh [F.gguf]        # default /tmp/qwen3moe-q4_0.gguf; ~11 min on the quiet 2-core VM (+2 to write the file), needs ~21 GB free
#
# env: OUT (/tmp/e2e_2core: every step's raw output), JSON (docs/results/end_to_end_2core.json), THREADS (2), BIN (llama.cpp's tools: .ggml/llama-cpu/bin; see
#      bench/llamacpp/build_llama_bench.sh), GGML (.ggml/build/moe_ggml_bench; bench/llamacpp/build.sh, 0 = skip
#      ggml's experts), ROUNDS (3 for the benches, 2 for the profile), PYTHON (python3).
# Runs one tool at a time (the machine has the memory for one full-size model), ours each in a fresh process.
# JSON is what the page cites; OUT keeps the raw files (not for docs/results/).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
F=${1:-/tmp/qwen3moe-q4_0.gguf}
OUT=${OUT:-/tmp/e2e_2core}
JSON=${JSON:-$ROOT/docs/results/end_to_end_2core.json}
THREADS=${THREADS:-2}
BIN=${BIN:-$ROOT/.ggml/llama-cpu/bin}
GGML=${GGML:-$ROOT/.ggml/build/moe_ggml_bench}
ROUNDS=${ROUNDS:-3}
PY=${PYTHON:-python3}
export PYTHONPATH=$ROOT/packages/cpumoe-formats/src:$ROOT/packages/cpumoe-executor/src:$ROOT/packages/moe-engine-glue/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
say() { echo "[e2e $(date +%T)] $*" >&2; }

if [[ ! -f $F ]]; then
    say "writing $F (19.4 GB)"
    $PY -m moe_engine.tools.synth --kind gguf-q4_0 --random-codes --out "$F" --quiet > "$OUT/synth.json"
fi
[[ -x $BIN/llama-bench ]] || { echo "no $BIN/llama-bench: bench/llamacpp/build_llama_bench.sh, or BIN=" >&2; exit 1; }
{ echo "date $(date -u +%FT%TZ)"; echo "loadavg $(cut -d' ' -f1-3 /proc/loadavg)"; uname -a
  grep -m1 'model name' /proc/cpuinfo; echo "nproc $(nproc)"; free -b | head -2; } > "$OUT/env.txt"

say "llama-bench -t $THREADS -p 64 -n 32 -r $ROUNDS"
BIN=$BIN OUT=$OUT NAME=llama-bench bench/llamacpp/run_llama_bench.sh "$F" -t "$THREADS" -p 64 -n 32 -r "$ROUNDS"

# auto: the default (gemv: the linears on the executor's kernel); static: the static cache with oneDNN's packed
# linears (auto's choice before gemv); eager: transformers' defaults (the path before decode=)
for v in auto static eager; do
    say "moe-engine bench --decode $v"
    /usr/bin/time -v -o "$OUT/ours-$v.time" $PY -m moe_engine.tools.cli bench "$F" -t "$THREADS" \
        -p 64 -n 32 -r "$ROUNDS" --json --quiet --decode "$v" > "$OUT/ours-$v.json" 2> "$OUT/ours-$v.err"
done

say "generate 32 tokens (peak RSS of the documented path)"
/usr/bin/time -v -o "$OUT/generate.time" $PY -m moe_engine.tools.cli generate "$F" --ids 1 --max-new-tokens 32 \
    -t "$THREADS" --json --quiet > "$OUT/generate.json" 2> "$OUT/generate.err"

say "token profile"
ggml_arg=()
[[ $GGML != 0 && -x $GGML ]] && ggml_arg=(--ggml "$GGML")
$PY -m moe_engine.tools.token_profile "$F" -n 16 -t "$THREADS" --rounds 2 "${ggml_arg[@]}" \
    --json "$OUT/token_profile.json" > "$OUT/token_profile.txt" 2> "$OUT/token_profile.err"
cat "$OUT/token_profile.txt"

$PY - "$OUT" "$F" "$THREADS" "$JSON" <<'PY'
import json, os, re, sys
out, f, threads, dest = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

def rss(name):
    t = open(os.path.join(out, name + ".time")).read()
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", t).group(1)) * 1024

def rate(rows, test):
    return next(r["avg_ts"] for r in rows if r.get("test", "") == test or (
        "n_prompt" in r and ("pp" if r["n_prompt"] else "tg") + str(r["n_prompt"] or r["n_gen"]) == test))

llama = json.load(open(os.path.join(out, "llama-bench.json")))
res = {"file": {"path": f, "bytes": os.path.getsize(f)}, "threads": threads,
       "env": open(os.path.join(out, "env.txt")).read().splitlines(),
       "llama_cpp": {"results": llama, "peak_rss_bytes": rss("llama-bench")}}
for d in ("auto", "static", "eager"):
    o = json.load(open(os.path.join(out, f"ours-{d}.json")))
    res[f"moe_engine_{d}"] = {**o, "peak_rss_bytes": rss(f"ours-{d}")}
res["generate_32"] = {**json.load(open(os.path.join(out, "generate.json"))), "peak_rss_bytes": rss("generate")}
res["token_profile"] = json.load(open(os.path.join(out, "token_profile.json")))
ratios = {}
for t in ("pp64", "tg32"):
    ll = rate(llama, t)
    ratios[t] = {d: rate(res[f"moe_engine_{d}"]["results"], t) / ll for d in ("auto", "static", "eager")}
res["ratios_vs_llama_cpp"] = ratios
g = res["token_profile"].get("ggml_experts")
if g:
    ratios["experts_share_ours_over_ggml_speed"] = g["ours_over_ggml_speed"]
json.dump(res, open(dest, "w"), indent=1)
print(json.dumps({"ratios_vs_llama_cpp": ratios,
                  "peak_rss_GB": {k: round(v["peak_rss_bytes"] / 1e9, 2) for k, v in res.items()
                                  if isinstance(v, dict) and "peak_rss_bytes" in v}}, indent=1))
PY
say "wrote $JSON"
