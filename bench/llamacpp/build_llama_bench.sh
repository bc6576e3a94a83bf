#!/usr/bin/env bash
# Build llama.cpp's own llama-bench and llama-simple (its token check) with cmake, from the same
# llama-cpp-python 0.3.36 sdist that fetch_ggml.sh vendors ggml from (llama.cpp commit 0c1e570).
#
#   bench/llamacpp/build_llama_bench.sh                  # CPU build     -> .ggml/llama-cpu/bin/
#   CUDA=1 bench/llamacpp/build_llama_bench.sh           # CUDA build    -> .ggml/llama-cuda/bin/
#   .ggml/llama-cpu/bin/llama-bench -m F.gguf -t 2 -p 64 -n 32 -r 3 -o json
#
# The bin/ folder is self-contained apart from glibc >= 2.34 and the CUDA libraries (cudart, cublas, cublasLt):
# llama.cpp, ggml, libstdc++ and libgcc are linked statically, libgomp is copied beside the binaries and found
# through RPATH=$ORIGIN. In the CUDA build, bin/run.sh finds the CUDA 13 libraries of a pip-installed torch
# (site-packages/nvidia/cu13/lib, as torch 2.11+cu130 installs them) or CUDA_LIB_DIR, and execs the tool:
#   .ggml/llama-cuda/bin/run.sh llama-bench -m F.gguf -ngl 99 --n-cpu-moe 48 ...
# The CUDA bin/ is ~40-60 MB (the sm_90 kernels), so it can be carried to the GPU host as a folder.
#
# env:
#   SDIST      llama_cpp_python-0.3.36.tar.gz already downloaded (else `pip download` fetches it)
#   CUDA       0 | 1                           (0)
#   CUDA_ARCH  CMAKE_CUDA_ARCHITECTURES        (90: H100 / H200)
#   CUDA_FA    1 = compile ggml's FlashAttention CUDA kernels, as llama.cpp's default build does; 0 = leave them
#              out (GGML_CUDA_FA=OFF: a shorter build, and llama-bench's `-fa auto` then runs attention without
#              FA; the experts' mul_mat_id, which decode and prefill of a MoE model are mostly made of, is
#              the same code either way)                          (1)
#   CUBLAS_DIR a folder with include/cublas_v2.h and lib/libcublas.so.13 (the nvidia-cublas wheel's
#              nvidia/cu13), when the CUDA toolkit has no cuBLAS  (the toolkit's own, else the venv's wheel)
#   CPU_NATIVE 1 = -march=native (GGML_NATIVE=ON, llama.cpp's default);  0 = an explicit x86 feature set
#              (CPU_FEATURES), for a binary built here and run on another CPU.  (1 for CPU builds; 0 for CUDA
#              builds, which are made to be carried to the GPU host)
#   CPU_FEATURES  with CPU_NATIVE=0: GGML_* switches                 (AVX2 FMA F16C BMI2 AVX512 AVX512_VBMI
#              AVX512_VNNI AVX512_BF16: what the H200 host's Xeon and this VM's EPYC both have; add AMX_TILE
#              AMX_INT8 AMX_BF16 for AMX, which llama.cpp uses for MUL_MAT only, not the experts' MUL_MAT_ID)
#   JOBS       build jobs (nproc);  NICE  nice level of the compile (0)
#   OUT        output folder (.ggml/llama-cpu or .ggml/llama-cuda)
#   LLAMA_SRC  extracted llama.cpp source (.ggml/llama.cpp-src; extracted from the sdist when missing)
set -euo pipefail
VERSION=0.3.36
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
G=${GGML_DIR:-$ROOT/.ggml}
CUDA=${CUDA:-0}
CUDA_ARCH=${CUDA_ARCH:-90}
CUDA_FA=${CUDA_FA:-1}
JOBS=${JOBS:-$(nproc)}
NICE=${NICE:-0}
SRC=${LLAMA_SRC:-$G/llama.cpp-src}
if [[ $CUDA == 1 ]]; then
    OUT=${OUT:-$G/llama-cuda}
    CPU_NATIVE=${CPU_NATIVE:-0}
else
    OUT=${OUT:-$G/llama-cpu}
    CPU_NATIVE=${CPU_NATIVE:-1}
fi
CPU_FEATURES=${CPU_FEATURES:-AVX2 FMA F16C BMI2 AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16}
TARGETS=(llama-bench llama-simple)

# 1. the source: vendor/llama.cpp of the sdist, without models/ docs/ media/ (vocab files and pictures, ~120 MB)
if [[ ! -f $SRC/CMakeLists.txt ]]; then
    TMP=$(mktemp -d)
    trap 'rm -rf "$TMP"' EXIT
    if [[ -z "${SDIST:-}" ]]; then
        python3 -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$TMP/dl" >&2
        SDIST=$(ls "$TMP"/dl/llama_cpp_python-$VERSION.tar.gz)
    fi
    top=llama_cpp_python-$VERSION
    echo "build_llama_bench: extracting vendor/llama.cpp from $SDIST" >&2
    tar xzf "$SDIST" -C "$TMP" --exclude="$top/vendor/llama.cpp/models" --exclude="$top/vendor/llama.cpp/docs" \
        --exclude="$top/vendor/llama.cpp/media" "$top/vendor/llama.cpp" "$top/.git/modules/vendor/llama.cpp/HEAD"
    rm -rf "$SRC"
    mkdir -p "$(dirname "$SRC")"
    mv "$TMP/$top/vendor/llama.cpp" "$SRC"
    cp "$TMP/$top/.git/modules/vendor/llama.cpp/HEAD" "$SRC/COMMIT"
fi
commit=$(cat "$SRC/COMMIT" 2>/dev/null || echo unknown)

# 2. configure: llama.cpp's default Release build (OpenMP, llamafile sgemm, CPU repack), nothing that downloads
#    (web UI, CCCL, curl/openssl), only the tools needed
args=(
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DGGML_OPENMP=ON
    "-DCMAKE_BUILD_RPATH=\$ORIGIN" -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON "-DCMAKE_INSTALL_RPATH=\$ORIGIN"
)
# libstdc++ and libgcc linked in: a carried binary then needs the other machine's glibc >= 2.34 only, not GCC 12's
# GLIBCXX_3.4.30
LDFLAGS_EXE="-static-libstdc++ -static-libgcc"
if [[ $CPU_NATIVE == 1 ]]; then
    args+=(-DGGML_NATIVE=ON)
else
    args+=(-DGGML_NATIVE=OFF)
    for f in $CPU_FEATURES; do args+=("-DGGML_$f=ON"); done
fi
if [[ $CUDA == 1 ]]; then
    args+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH" -DGGML_CUDA_NCCL=OFF)
    [[ $CUDA_FA == 1 ]] && args+=(-DGGML_CUDA_FA=ON) || args+=(-DGGML_CUDA_FA=OFF)
    NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    args+=("-DCMAKE_CUDA_COMPILER=$NVCC")
    toolkit=${CUDA_HOME:-}
    for d in "$(dirname "$(readlink -f "$NVCC")")/.." /usr/local/cuda; do  # (nvcc may be a wrapper script)
        [[ -z $toolkit && -f $d/include/cuda.h ]] && toolkit=$(cd "$d" && pwd)
    done
    [[ -n $toolkit ]] || { echo "build_llama_bench: no CUDA toolkit with include/cuda.h (set CUDA_HOME)" >&2; exit 1; }
    if [[ -z "${CUBLAS_DIR:-}" && ! -f $toolkit/include/cublas_v2.h ]]; then
        CUBLAS_DIR=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' \
            2>/dev/null || true)
    fi
    if [[ -n "${CUBLAS_DIR:-}" ]]; then
        [[ -f $CUBLAS_DIR/include/cublas_v2.h && -f $CUBLAS_DIR/lib/libcublas.so.13 ]] || {
            echo "build_llama_bench: CUBLAS_DIR=$CUBLAS_DIR has no include/cublas_v2.h + lib/libcublas.so.13" \
                "(pip download nvidia-cublas==13.1.0.3 and unzip it: nvidia/cu13)" >&2; exit 1; }
        # FindCUDAToolkit looks for the unversioned names the wheel lacks: link stubs in the build dir
        stub=$OUT/build/cublas-link
        mkdir -p "$stub"
        for l in cublas cublasLt; do ln -sf "$CUBLAS_DIR/lib/lib$l.so.13" "$stub/lib$l.so"; done
        args+=("-DCUDA_cublas_LIBRARY=$stub/libcublas.so" "-DCUDA_cublasLt_LIBRARY=$stub/libcublasLt.so"
               "-DCMAKE_CUDA_FLAGS=-I$CUBLAS_DIR/include" "-DCMAKE_CXX_FLAGS=-I$CUBLAS_DIR/include")
        LDFLAGS_EXE="$LDFLAGS_EXE -Wl,-rpath-link,$CUBLAS_DIR/lib"  # libcublas.so.13 needs libcublasLt.so.13
    fi
    # ggml-cuda calls the driver API (cuMem* for its VMM pool), so it links libcuda.so.1. A machine without the
    # driver and without the toolkit's lib64/stubs gets a link-only stub: the driver-API functions ggml-cuda names
    # (resolved through cuda.h's macros), each an empty function, in a libcuda.so whose soname is libcuda.so.1.
    # It is never carried: at run time the GPU host's driver provides libcuda.so.1.
    if [[ ! -f $toolkit/lib64/stubs/libcuda.so ]] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
        drv=$OUT/build/cuda-driver-stub
        mkdir -p "$drv"
        fns=$(grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' "$SRC"/ggml/src/ggml-cuda/*.cu "$SRC"/ggml/src/ggml-cuda/*.cuh \
            | tr -d ' (' | grep -v '^cuBLAS' | sort -u)
        { echo '#include <cuda.h>'; echo 'void *refs[] = {'; for f in $fns; do echo "(void *) $f,"; done; echo '};'; } \
            > "$drv/refs.c"
        gcc -c -I"$toolkit/include" "$drv/refs.c" -o "$drv/refs.o"
        nm -u "$drv/refs.o" | awk '{print "void " $2 "(void) {}"}' > "$drv/stub.c"
        gcc -shared -fPIC -Wl,-soname,libcuda.so.1 "$drv/stub.c" -o "$drv/libcuda.so"
        args+=("-DCUDA_cuda_driver_LIBRARY=$drv/libcuda.so")
    fi
fi

args+=("-DCMAKE_EXE_LINKER_FLAGS=$LDFLAGS_EXE")

t0=$(date +%s)
mkdir -p "$OUT/build"
cmake -S "$SRC" -B "$OUT/build" "${args[@]}" > "$OUT/cmake-configure.log" 2>&1 || {
    tail -30 "$OUT/cmake-configure.log" >&2; exit 1; }
nice -n "$NICE" cmake --build "$OUT/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" \
    > "$OUT/cmake-build.log" 2>&1 || { grep -m20 -B2 -A10 'error' "$OUT/cmake-build.log" >&2 || tail -40 "$OUT/cmake-build.log" >&2; exit 1; }
t1=$(date +%s)

# 3. the carried folder: the tools, libgomp (RPATH $ORIGIN), a runner that finds the CUDA libraries
mkdir -p "$OUT/bin"
for t in "${TARGETS[@]}"; do cp "$OUT/build/bin/$t" "$OUT/bin/"; done
gomp=$(g++ -print-file-name=libgomp.so.1)
[[ -f $gomp ]] && cp -L "$gomp" "$OUT/bin/"
cat > "$OUT/bin/run.sh" <<'RUN'
#!/usr/bin/env bash
# run.sh TOOL ARGS...: run a tool of this folder with the CUDA 13 libraries it links (cudart, cublas, cublasLt)
# on LD_LIBRARY_PATH: CUDA_LIB_DIR if set, else a pip-installed torch's site-packages/nvidia/cu13/lib.
here=$(cd "$(dirname "$0")" && pwd)
tool=$1; shift
libs=${CUDA_LIB_DIR:-}
if [[ -z $libs ]]; then
    libs=$(python3 -c 'import nvidia, os; print(":".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' \
        2>/dev/null || true)
fi
export LD_LIBRARY_PATH=$here${libs:+:$libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
exec "$here/$tool" "$@"
RUN
chmod +x "$OUT/bin/run.sh"
{
    echo "llama.cpp commit $commit (llama-cpp-python $VERSION sdist)"
    echo "cuda=$CUDA cuda_arch=$CUDA_ARCH cuda_fa=$CUDA_FA cpu_native=$CPU_NATIVE$([[ $CPU_NATIVE == 1 ]] || echo " cpu_features=${CPU_FEATURES// /,}")"
    echo "built $(date -u +%FT%TZ) on $(uname -m) in $((t1 - t0)) s with $JOBS jobs"
    echo "needed at run time:"
    for t in "${TARGETS[@]}"; do ldd "$OUT/bin/$t" | awk '{print "  " $1 " -> " $3}'; done | sort -u
} > "$OUT/bin/BUILD_INFO"
cat "$OUT/bin/BUILD_INFO" >&2
du -sh "$OUT/bin" >&2
