#!/usr/bin/env bash
# Recreate .ggml/ (gitignored) from the llama-cpp-python 0.3.36 sdist on PyPI: the ggml sources the CPU
# backend needs (include/, src/*.c *.cpp *.h, src/ggml-cpu/), llama.cpp's src/llama-graph.cpp (build_moe_ffn,
# for reference only, not compiled) and the licence; .ggml/VERSION names the vendored llama.cpp commit.
#
#   bench/llamacpp/fetch_ggml.sh                # pip download (needs the internet)
#   SDIST=/path/llama_cpp_python-0.3.36.tar.gz bench/llamacpp/fetch_ggml.sh   # an sdist already downloaded
#
# Run from anywhere; writes <repo>/.ggml (or GGML_DIR), replacing ggml/, llama.cpp-ref/ and build/ there.
# Needs python3 -m pip (for the download) and tar.
set -euo pipefail
VERSION=0.3.36
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${GGML_DIR:-$ROOT/.ggml}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

if [[ -z "${SDIST:-}" ]]; then
    python3 -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$TMP/dl" >&2
    SDIST=$(ls "$TMP"/dl/llama_cpp_python-$VERSION.tar.gz)
fi
echo "fetch_ggml: extracting $SDIST" >&2
top=llama_cpp_python-$VERSION
v=$top/vendor/llama.cpp
tar xzf "$SDIST" -C "$TMP" "$v/ggml" "$v/src/llama-graph.cpp" "$v/LICENSE" "$top/.git/modules/vendor/llama.cpp/HEAD"
src=$TMP/$v

rm -rf "$DEST/ggml" "$DEST/llama.cpp-ref" "$DEST/build"
mkdir -p "$DEST/ggml/src" "$DEST/llama.cpp-ref/src"
cp -r "$src/ggml/include" "$DEST/ggml/"
cp "$src"/ggml/src/*.c "$src"/ggml/src/*.cpp "$src"/ggml/src/*.h "$src"/ggml/src/ggml-version.h.in "$DEST/ggml/src/"
cp -r "$src/ggml/src/ggml-cpu" "$DEST/ggml/src/"
cp "$src/ggml/CMakeLists.txt" "$DEST/ggml/"          # version numbers and default options, for the record
cp "$src/LICENSE" "$DEST/ggml/LICENSE"
cp "$src/src/llama-graph.cpp" "$DEST/llama.cpp-ref/src/"
commit=$(cat "$TMP/$top/.git/modules/vendor/llama.cpp/HEAD")
ggml_version=$(awk '/set\(GGML_VERSION_(MAJOR|MINOR|PATCH)/ {gsub(/\)/,"",$2); printf "%s%s", sep, $2; sep="."}' "$src/ggml/CMakeLists.txt")
cat > "$DEST/VERSION" <<V
llama-cpp-python $VERSION (PyPI sdist)
llama.cpp commit $commit
ggml version $ggml_version
V
cat "$DEST/VERSION" >&2
du -sh "$DEST" >&2
