#!/bin/sh
# Batch identity and tier agreement of the multi-token kernels for EVERY tier, on a CPU without AVX-512/VNNI:
# the avxvnni / avx512f / avx512vnni / avx512bf16 objects of bf16, fp8_block, nvfp4, ds_fp4, q4_0 and nvfp4_x16 are
# compiled against SIMDe's portable intrinsics (apt: libsimde-dev), scalar and avx2 natively, all linked with
# the package's own step (csrc/step.cpp) into one library that check.py drives through ctypes:
#   - every token of a batch (ragged shapes, batch 1..9, shared and random routing, duplicated and -1 routes)
#     gives the same bits as its single-token step, at every tier;
#   - every tier agrees with the float64 reference within the format's test tolerance;
#   - an x16 layout's tiers give scalar's bits (their definition).
# Not collected by pytest (needs SIMDe and ~2 minutes of compiling; SANITIZE=1: under ASan + UBSan, ~20 minutes).
#   [SANITIZE=1] sh packages/cpumoe-formats/tests/batch_simde/run.sh
HERE=$(cd "$(dirname "$0")" && pwd)
NAME=batch_simde
. "$HERE/../simde_env.sh"
EMU="-include $HERE/simde_extra.h"
for f in bf16 fp8_block nvfp4 ds_fp4 q4_0; do
  c++ $B -DCPUMOE_TIER=0 -DCPUMOE_TIER_TAG=scalar -fno-tree-vectorize -c csrc/formats/$f.cpp -o "$OUT/$f.scalar.o" &
  c++ $B $AVX2 -DCPUMOE_TIER=1 -DCPUMOE_TIER_TAG=avx2 -c csrc/formats/$f.cpp -o "$OUT/$f.avx2.o"
  c++ $B $AVX2 $EMU -DSIMD_AVX512=0 -DCPUMOE_TIER=2 -DCPUMOE_TIER_TAG=avxvnni -c csrc/formats/$f.cpp -o "$OUT/$f.avxvnni.o" &
  c++ $B $AVX2 $EMU -DSIMD_AVX512=1 -DCPUMOE_TIER=3 -DCPUMOE_TIER_TAG=avx512f -c csrc/formats/$f.cpp -o "$OUT/$f.avx512f.o"
  wait
  c++ $B $AVX2 $EMU -DSIMD_AVX512=1 -DCPUMOE_TIER=4 -DCPUMOE_TIER_TAG=avx512vnni -c csrc/formats/$f.cpp -o "$OUT/$f.avx512vnni.o" &
  c++ $B $AVX2 $EMU -DSIMD_AVX512=1 -DCPUMOE_TIER=5 -DCPUMOE_TIER_TAG=avx512bf16 -c csrc/formats/$f.cpp -o "$OUT/$f.avx512bf16.o"
  wait
done
# the amx tiers (bf16, fp8_block, q4_0): AVX-512 through SIMDe, the tile instructions through amx_emu.h
for f in bf16 fp8_block q4_0; do  # in the foreground: set -e stops at a failed compile
  c++ $B $AVX2 $EMU -include "$HERE/amx_emu.h" -DSIMD_AVX512=1 -DCPUMOE_TIER=6 -DCPUMOE_TIER_TAG=amx \
    -c csrc/formats/$f.cpp -o "$OUT/$f.amx.o"
done
# the x16 layouts' AVX-512 tiers: their {1to16} inline asm as intrinsics (CPUMOE_X16_NO_ASM), the VNNI and VBMI
# feature macros their zmm code tests, and fused multiply-adds that round once (mxfp4_simde/simde_fma.h: SIMDe's
# round twice, which flipped 1-4 bf16 outputs in 10^4 against scalar); avx2 natively (its inline asm blocks run
# here). avx512bf16 at -O1: SIMDe's vpermb emulation took over 20 minutes to compile at -O2.
X16="-DCPUMOE_X16_NO_ASM -include $HERE/../mxfp4_simde/simde_fma.h"
for f in nvfp4_x16; do
  c++ $B -DCPUMOE_TIER=0 -DCPUMOE_TIER_TAG=scalar -fno-tree-vectorize -c csrc/formats/$f.cpp -o "$OUT/$f.scalar.o" &
  c++ $B $AVX2 -DCPUMOE_TIER=1 -DCPUMOE_TIER_TAG=avx2 -c csrc/formats/$f.cpp -o "$OUT/$f.avx2.o"
  c++ $B $AVX2 $EMU $X16 -DSIMD_AVX512=0 -DCPUMOE_TIER=2 -DCPUMOE_TIER_TAG=avxvnni -c csrc/formats/$f.cpp -o "$OUT/$f.avxvnni.o" &
  c++ $B $AVX2 $EMU $X16 -DSIMD_AVX512=1 -DCPUMOE_TIER=3 -DCPUMOE_TIER_TAG=avx512f -c csrc/formats/$f.cpp -o "$OUT/$f.avx512f.o"
  wait
  c++ $B $AVX2 $EMU $X16 -DSIMD_AVX512=1 -D__AVX512VNNI__=1 -DCPUMOE_TIER=4 -DCPUMOE_TIER_TAG=avx512vnni \
    -c csrc/formats/$f.cpp -o "$OUT/$f.avx512vnni.o" &
  c++ $B -O1 $AVX2 $EMU $X16 -DSIMD_AVX512=1 -D__AVX512VNNI__=1 -D__AVX512VBMI__=1 -DCPUMOE_TIER=5 \
    -DCPUMOE_TIER_TAG=avx512bf16 -c csrc/formats/$f.cpp -o "$OUT/$f.avx512bf16.o"
  wait
done
c++ $B -shared "$HERE/harness.cpp" "$OUT"/*.o -o "$OUT/libbatch_simde.so"
LD_PRELOAD="$PRELOAD" PYTHONPATH="$PKG/src${PYTHONPATH:+:$PYTHONPATH}" python3 "$HERE/check.py" "$OUT/libbatch_simde.so"
