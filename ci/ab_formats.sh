#!/usr/bin/env bash
# A/B of format kernel sources on the lent GPU host (< 10 minutes): ci/ab_executor.sh with the variants' files
# copied into packages/cpumoe-formats/csrc/formats and cpumoe-formats rebuilt per variant.
#   OUT=DIR [ROUNDS=2] [BENCH="--format nvfp4 --batch 1,8 --routing both --mode w4a8"] ci/ab_formats.sh A_DIR B_DIR
# A_DIR / B_DIR hold replacement files for packages/cpumoe-formats/csrc/formats (e.g. nvfp4.cpp).
DEST=packages/cpumoe-formats/csrc/formats PKG=packages/cpumoe-formats exec bash "$(dirname "$0")/ab_executor.sh" "$@"
