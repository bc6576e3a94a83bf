#!/usr/bin/env bash
# Called by: nox -s sanitize (noxfile.py), once per mode; bench/device/device_amx.sh runs it with SANITIZE=1.
# Builds cpumoe-formats and cpumoe-executor with sanitizers into a scratch copy and runs both test suites against
# them. Usage: ci/sanitize.sh asan|tsan [pytest args]
#   asan: AddressSanitizer + UndefinedBehaviorSanitizer
#   tsan: ThreadSanitizer (ASLR disabled with setarch -R: TSan needs its fixed shadow layout)
# The Python interpreter is not instrumented, so the runtime is LD_PRELOADed.
set -euo pipefail
mode=${1:?usage: ci/sanitize.sh asan|tsan}; shift
root=$(cd "$(dirname "$0")/.." && pwd)
work=${SANITIZE_DIR:-$root/build/sanitize-$mode}
rm -rf "$work" && mkdir -p "$work"
cp -r "$root/packages/cpumoe-formats/src" "$work/formats"
cp -r "$root/packages/cpumoe-executor/src" "$work/executor"
find "$work" -name '*.so' -delete
case $mode in
  asan)
    export CPUMOE_SANITIZE=address,undefined
    preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
    export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
    export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
    wrap=() ;;
  tsan)
    export CPUMOE_SANITIZE=thread
    preload="$(gcc -print-file-name=libtsan.so)"
    export TSAN_OPTIONS="halt_on_error=1 exitcode=66 report_signal_unsafe=0 suppressions=$root/ci/tsan.supp"
    # numpy's OpenBLAS threads are not instrumented: their hand-off of a float64 reference's result (test_linear's
    # 128x2048 product) reads to TSan as a race with the array's free. One BLAS thread leaves our threads alone.
    export OPENBLAS_NUM_THREADS=1
    wrap=(setarch "$(uname -m)" -R) ;;
  *) echo "unknown mode $mode (asan|tsan)" >&2; exit 2 ;;
esac
export CPUMOE_DEBUG=1
# The real interpreter (not a pyenv/venv shell shim): the preload must reach Python itself.
# PYTHON picks the interpreter (default `python`; e.g. PYTHON=python3 on images without a `python`).
PY=$(${PYTHON:-python} -c 'import sys; print(sys.executable)')
# The executor is built with PYTHONPATH cleared (so it finds the formats headers in the source tree, not the
# sanitized module) but pybind11 may live on a PYTHONPATH entry (a wheel target dir): keep that one.
PYBIND_SITE=$("$PY" -c 'import os, pybind11; print(os.path.dirname(os.path.dirname(pybind11.__file__)))')
(cd "$root/packages/cpumoe-formats" && "$PY" -c "import hatch_build, pathlib; hatch_build.build(pathlib.Path('$work/formats/cpumoe_formats'))")
(cd "$root/packages/cpumoe-executor" && PYTHONPATH="$PYBIND_SITE" "$PY" -c "import hatch_build, pathlib; hatch_build.build(pathlib.Path('$work/executor/cpumoe_executor'))")
export PYTHONPATH="$work/formats:$work/executor"
# Each package's suite in its own pytest run (each has its own conftest). The bench smoke
# tests only add runtime under a sanitizer; everything else runs.
for suite in ${SUITES:-cpumoe-formats cpumoe-executor}; do  # SUITES: a subset, e.g. SUITES=cpumoe-executor
  echo "== $mode: $suite"
  LD_PRELOAD="$preload" "${wrap[@]}" "$PY" -m pytest -q -p no:cacheprovider "$root/packages/$suite/tests" \
    -k "not bench" "$@"
done
