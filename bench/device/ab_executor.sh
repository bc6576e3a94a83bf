#!/usr/bin/env bash
# Run by hand on the lent H200 host: OUT=DIR bench/device/ab_executor.sh A_DIR B_DIR [C_DIR...] (< 10 minutes).
# A/B(/C...) of executor or format sources: each variant is built once into its own copy of the package, then the
# rounds (forward, then backward) interleave the variants' executor benches, so all of them see the same minutes of a
# noisy host.
#   OUT=DIR [ROUNDS=2] [BENCH="--format nvfp4 --batch 1,8 --routing both --mode w4a8"] bench/device/ab_executor.sh A_DIR B_DIR...
# A variant dir holds replacement files for $DEST (subfolders mirrored; default packages/cpumoe-executor/csrc) of the
# package $PKG (default packages/cpumoe-executor; ab_formats.sh sets both), and optionally a file `env` (shell lines,
# e.g. `export CPUMOE_ISA=avx512f`, sourced before that variant's bench) and a file `cxx` (the compiler line for its
# build, e.g. `c++ -DCPUMOE_NVX16_PF=6144`), neither copied. Summary (per round and variant: format, batch, routing,
# us/step, % of the ceiling, batch N / batch 1 lines, trace lines with --trace) in $OUT/ab.txt.
set -uo pipefail
: "${OUT:?set OUT}"
[ $# -ge 2 ] || { echo "usage: OUT=DIR bench/device/ab_executor.sh A_DIR B_DIR [C_DIR...]"; exit 2; }
BENCH=${BENCH:---format nvfp4 --batch 1,8 --routing both --mode w4a8}
DEST=${DEST:-packages/cpumoe-executor/csrc}
PKG=${PKG:-packages/cpumoe-executor}
export CPUMOE_BUILD_JOBS=${CPUMOE_BUILD_JOBS:-16}
. bench/device/cpu_setup.sh
base=$PYTHONPATH
for v in "$@"; do  # one build per variant, in /tmp/ab/<name>/<package>
  n=$(basename "$v"); c=/tmp/ab/$n/$(basename "$PKG")
  rm -rf "/tmp/ab/$n"; mkdir -p "/tmp/ab/$n"; cp -r "$PKG" "$c"
  (cd "$v" && find . -type f ! -name env ! -name cxx) | while read -r f; do cp "$v/$f" "$c/${DEST#"$PKG"/}/$f"; done
  cxx=c++; [ -f "$v/cxx" ] && cxx=$(cat "$v/cxx")
  (cd "$c" && CXX=$cxx PYTHONPATH=$base python3 hatch_build.py) >> "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
done
for r in $(seq "${ROUNDS:-2}"); do
  order=("$@"); [ $((r % 2)) -eq 0 ] && mapfile -t order < <(printf '%s\n' "$@" | tac)
  for v in "${order[@]}"; do
    n=$(basename "$v")
    echo "== round $r $n" | tee -a "$OUT/ab.txt"
    # shellcheck disable=SC1091,SC2086
    (if [ -f "$v/env" ]; then . "$v/env"; fi
     PYTHONPATH=/tmp/ab/$n/$(basename "$PKG")/src:$base timeout 200 python3 -m cpumoe_executor.bench $BENCH --repeats 5 \
       --steps 20 --json "$OUT/r$r-$n.json" 2>&1) | grep -E "^[a-z0-9_>]+ +[a-z0-9+]+ +[0-9]+ +[0-9]+ |batch [0-9]+ / batch 1| trace: " | tee -a "$OUT/ab.txt"
  done
done
