# Sourced (with `.`) by the SIMDe checks (batch_simde/, fp4_simde/, mxfp4_simde/ run.sh) after they set HERE
# (their own directory) and NAME: cwd becomes the package root, OUT a scratch directory, B the base compile
# flags and AVX2 the avx2 tier's (as hatch_build.py's).
set -e
PKG=$(cd "$HERE/../.." && pwd)
OUT=${TMPDIR:-/tmp}/cpumoe_$NAME
mkdir -p "$OUT"
cd "$PKG"
B="-std=c++17 -O2 -fPIC -ffp-contract=off -Icsrc -Isrc/cpumoe_formats/include -w ${CPUMOE_TEST_DEFS:-}"  # CPUMOE_TEST_DEFS: -D build knobs under test
AVX2="-mavx2 -mfma -mf16c -mbmi -mbmi2 -mlzcnt -mpopcnt"
