# Sourced (with `.`) by the SIMDe checks (batch_simde/, fp4_simde/, mxfp4_simde/ run.sh) after they set HERE
# (their own directory) and NAME: cwd becomes the package root, OUT a scratch directory, B the base compile
# flags and AVX2 the avx2 tier's (as hatch_build.py's).
set -e
PKG=$(cd "$HERE/../.." && pwd)
OUT=${TMPDIR:-/tmp}/cpumoe_$NAME
mkdir -p "$OUT"
cd "$PKG"
B="-std=c++17 -O2 -fPIC -ffp-contract=off -Icsrc -Isrc/cpumoe_formats/include -w ${CPUMOE_TEST_DEFS:-}"  # CPUMOE_TEST_DEFS: -D build knobs under test
# SANITIZE=1: every object under AddressSanitizer + UBSan (abort on the first report); $PRELOAD then holds the
# runtimes a python3 that loads the library through ctypes needs (batch_simde), empty otherwise.
PRELOAD=
if [ "${SANITIZE:-}" = 1 ]; then
  B="$B -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
  PRELOAD="$(c++ -print-file-name=libasan.so) $(c++ -print-file-name=libubsan.so)"
  export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  OUT=$OUT-sanitize
  mkdir -p "$OUT"
fi
AVX2="-mavx2 -mfma -mf16c -mbmi -mbmi2 -mlzcnt -mpopcnt"
