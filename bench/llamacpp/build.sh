#!/usr/bin/env bash
# Build ggml's CPU backend (as llama.cpp's default CMake build configures it: GGML_NATIVE, OpenMP, llamafile
# sgemm, CPU repack, static) and bench/llamacpp/moe_ggml_bench.cpp with plain gcc/g++: no cmake needed.
#
#   bench/llamacpp/build.sh            # -> .ggml/build/moe_ggml_bench
#
# env: CC (gcc), CXX (g++), JOBS (nproc), GGML_OPENMP (1; 0 = ggml's own threadpool), ARCH (-march=native),
#      OPT (-O3), FORCE=1 (rebuild everything).
# Incremental: objects are rebuilt when their source is newer or the flags/compiler changed (.ggml/build/flags).
# -march=native: each machine gets its own ISA. ggml's x86 kernels test the compiler's macros (__AVX2__,
# __AVX512F__, __AVX512VNNI__, __AVX512BF16__, __AMX_INT8__ ...); the GGML_AVX512-style defines only feed
# cpu-feats.cpp of the GGML_BACKEND_DL variant build, which this build (like GGML_NATIVE=ON) does not use.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
G=${GGML_DIR:-$ROOT/.ggml}
S=$G/ggml/src
B=$G/build
CC=${CC:-gcc}
CXX=${CXX:-g++}
JOBS=${JOBS:-$(nproc)}
GGML_OPENMP=${GGML_OPENMP:-1}
ARCH=${ARCH:--march=native}
OPT=${OPT:--O3}

if [[ ! -f $S/ggml.c ]]; then
    echo "build.sh: no ggml sources in $G (run bench/llamacpp/fetch_ggml.sh first)" >&2
    exit 1
fi
mkdir -p "$B/obj"

# ggml-version.h, as ggml/src/CMakeLists.txt configures it
ver=$(awk '/^ggml version/ {print $3}' "$G/VERSION" 2>/dev/null || true)
commit=$(awk '/^llama.cpp commit/ {print substr($3,1,7)}' "$G/VERSION" 2>/dev/null || true)
printf '#pragma once\n\n#define GGML_VERSION "%s"\n#define GGML_COMMIT  "%s"\n' "${ver:-unknown}" "${commit:-unknown}" \
    > "$B/ggml-version.h.new"
cmp -s "$B/ggml-version.h.new" "$B/ggml-version.h" 2>/dev/null && rm "$B/ggml-version.h.new" \
    || mv "$B/ggml-version.h.new" "$B/ggml-version.h"

DEFS="-DNDEBUG -DGGML_USE_CPU -DGGML_USE_LLAMAFILE -DGGML_USE_CPU_REPACK -DGGML_SCHED_MAX_COPIES=4 \
-D_XOPEN_SOURCE=600 -D_GNU_SOURCE"
OMPFLAG=""
if [[ $GGML_OPENMP == 1 ]]; then
    DEFS="$DEFS -DGGML_USE_OPENMP"
    OMPFLAG=-fopenmp
fi
INC="-I$G/ggml/include -I$S -I$S/ggml-cpu -I$B"
COMMON="$OPT $ARCH $OMPFLAG -pthread $DEFS $INC"
CFLAGS="-std=gnu11 $COMMON"
CXXFLAGS="-std=gnu++17 $COMMON"

# The sources of ggml-base, ggml (the registry) and ggml-cpu for x86 (ggml/src/CMakeLists.txt,
# ggml/src/ggml-cpu/CMakeLists.txt) that a link of the bench needs (checked by leaving each out):
# ggml-backend-dl.cpp and ggml-backend-meta.cpp are referenced by ggml-backend(-reg).cpp, tiled/ and traits.cpp
# by ggml-cpu.c, llamafile/sgemm.cpp with GGML_USE_LLAMAFILE, amx/ where the compiler defines __AMX_INT8__ and
# __AVX512VNNI__ (the AMX extra buffer type: MUL_MAT only, not MUL_MAT_ID). Not needed: ggml-opt.cpp, gguf.cpp,
# ggml.cpp (a terminate handler), hbm.cpp (GGML_USE_CPU_HBM), arch/x86/cpu-feats.cpp (GGML_BACKEND_DL variants).
SRCS=(
    ggml.c ggml-alloc.c ggml-backend.cpp ggml-backend-meta.cpp ggml-threading.cpp ggml-quants.c
    ggml-backend-reg.cpp ggml-backend-dl.cpp
    ggml-cpu/ggml-cpu.c ggml-cpu/ggml-cpu.cpp ggml-cpu/repack.cpp ggml-cpu/quants.c ggml-cpu/traits.cpp
    ggml-cpu/amx/amx.cpp ggml-cpu/amx/mmq.cpp ggml-cpu/tiled/tiled.cpp ggml-cpu/tiled/tiled-kernel.cpp
    ggml-cpu/binary-ops.cpp ggml-cpu/unary-ops.cpp ggml-cpu/vec.cpp ggml-cpu/ops.cpp ggml-cpu/llamafile/sgemm.cpp
    ggml-cpu/arch/x86/quants.c ggml-cpu/arch/x86/repack.cpp
)
case $(uname -m) in
    x86_64|i?86) ;;
    aarch64|arm64) SRCS=("${SRCS[@]/ggml-cpu\/arch\/x86/ggml-cpu/arch/arm}") ;;
    *) echo "build.sh: $(uname -m): only x86_64 (and, untested, aarch64) are wired up" >&2; exit 1 ;;
esac

# the stamp names what -march=native means on this machine (the compiler's predefined macros: __AVX512F__ ...),
# so a build dir carried to another machine is rebuilt there, not reused
isa=$($CC $ARCH -dM -E - < /dev/null | LC_ALL=C sort | md5sum | cut -c1-12)
stamp="$($CC --version | head -1) | $($CXX --version | head -1) | isa $isa | $CFLAGS | $CXXFLAGS"
if [[ ${FORCE:-0} == 1 || ! -f $B/flags || $(cat "$B/flags") != "$stamp" ]]; then
    rm -rf "$B/obj" "$B/libggml.a"
    mkdir -p "$B/obj"
fi

todo=()
for s in "${SRCS[@]}"; do
    o=$B/obj/${s//\//_}.o
    if [[ ! -f $o || $S/$s -nt $o || $B/ggml-version.h -nt $o ]]; then
        todo+=("$s")
    fi
done
t0=$(date +%s)
if ((${#todo[@]})); then
    echo "build.sh: compiling ${#todo[@]} ggml sources with $JOBS jobs ($CC/$CXX $OPT $ARCH${OMPFLAG:+ $OMPFLAG})" >&2
    export S B CC CXX CFLAGS CXXFLAGS
    printf '%s\n' "${todo[@]}" | xargs -P "$JOBS" -I{} bash -c '
        s={}; o=$B/obj/${s//\//_}.o
        case $s in *.c) cmd="$CC $CFLAGS";; *) cmd="$CXX $CXXFLAGS";; esac
        $cmd -c "$S/$s" -o "$o.tmp" && mv "$o.tmp" "$o" || { echo "build.sh: FAILED $s" >&2; exit 255; }'
    rm -f "$B/libggml.a"
fi
echo "$stamp" > "$B/flags"
if [[ ! -f $B/libggml.a ]]; then
    objs=()
    for s in "${SRCS[@]}"; do objs+=("$B/obj/${s//\//_}.o"); done
    ar rcs "$B/libggml.a" "${objs[@]}"
fi

bench=("$ROOT"/bench/llamacpp/*.cpp)  # moe_ggml_bench.cpp (main), util.cpp, bank.cpp, graph.cpp; moe_ggml.h
stale=0
for f in "${bench[@]}" "$ROOT/bench/llamacpp/moe_ggml.h" "$B/libggml.a"; do
    [[ $f -nt $B/moe_ggml_bench ]] && stale=1
done
if [[ ! -x $B/moe_ggml_bench || $stale == 1 ]]; then
    $CXX -std=gnu++17 $OPT $ARCH $OMPFLAG -pthread -I"$G/ggml/include" -DBENCH_GGML_OPENMP=$GGML_OPENMP \
        -DBENCH_BUILD_FLAGS="\"$OPT $ARCH${OMPFLAG:+ $OMPFLAG} ($($CXX -dumpfullversion 2>/dev/null || $CXX -dumpversion))\"" \
        "${bench[@]}" "$B/libggml.a" -o "$B/moe_ggml_bench.tmp" -ldl -lm
    mv "$B/moe_ggml_bench.tmp" "$B/moe_ggml_bench"
fi
echo "build.sh: $B/moe_ggml_bench ready ($(( $(date +%s) - t0 )) s)" >&2
