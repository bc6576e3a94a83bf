#!/usr/bin/env bash
# Pack the CUDA llama-bench (build_llama_bench.sh with CUDA=1) for the GPU host: llama-bench stripped, libgomp, run.sh,
# BUILD_INFO as .ggml/llama-cuda-bin.tar.xz (~27 MB, under the device tool's 64 MiB carry); bench/device/e2e_h200.sh
# unpacks it into .ggml/llama-cuda/bin instead of building there (~8 min of the call's 10).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/.ggml/llama-cuda/bin}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
mkdir "$T/llama-cuda-bin"
cp "$BIN"/{llama-bench,libgomp.so.1,run.sh,BUILD_INFO} "$T/llama-cuda-bin/"
strip "$T/llama-cuda-bin/llama-bench"
tar cJf "$ROOT/.ggml/llama-cuda-bin.tar.xz" -C "$T" llama-cuda-bin
ls -la "$ROOT/.ggml/llama-cuda-bin.tar.xz"
