#!/usr/bin/env bash
# Run by hand on the lent H200 host: OUT=DIR bench/device/ab_formats.sh A_DIR B_DIR [C_DIR...] (< 10 minutes).
# A/B(/C...) of format kernel sources: ab_executor.sh with the variants' files copied into packages/cpumoe-formats/csrc
# (subfolders mirrored: formats/nvfp4.cpp, rowmajor.h) and each variant's cpumoe-formats built once.
#   OUT=DIR [ROUNDS=2] [BENCH="--format nvfp4 --batch 1,8 --routing both --mode w4a8"] bench/device/ab_formats.sh A_DIR B_DIR...
DEST=packages/cpumoe-formats/csrc PKG=packages/cpumoe-formats exec bash "$(dirname "$0")/ab_executor.sh" "$@"
