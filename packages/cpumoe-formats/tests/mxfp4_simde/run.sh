#!/bin/sh
# Runs the mxfp4 avxvnni / avx512f / avx512vnni tiers on a CPU without them, compiled against SIMDe's portable
# intrinsics (apt: libsimde-dev; shim: ../fp4_simde/simde_pre.h + simde_fma.h, exact FMAs), next to the natively compiled scalar and
# avx2 tiers, and checks every work item bit for bit (check_mxfp4.cpp): w4a8 tiers == scalar, native avx512f ==
# avx2, and in every tier n tokens per item == each token alone. Not collected by pytest (needs SIMDe, ~1 min).
#   sh packages/cpumoe-formats/tests/mxfp4_simde/run.sh
HERE=$(cd "$(dirname "$0")" && pwd)
NAME=mxfp4_simde
. "$HERE/../simde_env.sh"
EMU="-D__mmask16=simde__mmask16 -include $HERE/simde_fma.h"
F=csrc/formats/mxfp4.cpp
c++ $B -DCPUMOE_TIER=0 -DCPUMOE_TIER_TAG=scalar -fno-tree-vectorize -c $F -o "$OUT/scalar.o"
c++ $B $AVX2 -DCPUMOE_TIER=1 -DCPUMOE_TIER_TAG=avx2 -c $F -o "$OUT/avx2.o"
c++ $B $EMU -DSIMD_AVX512=0 -DCPUMOE_TIER=2 -DCPUMOE_TIER_TAG=avxvnni -c $F -o "$OUT/avxvnni.o"
c++ $B $EMU -DSIMD_AVX512=1 -DCPUMOE_TIER=3 -DCPUMOE_TIER_TAG=avx512f -c $F -o "$OUT/avx512f.o"
c++ $B $EMU -DSIMD_AVX512=1 -DCPUMOE_TIER=4 -DCPUMOE_TIER_TAG=avx512vnni -c $F -o "$OUT/avx512vnni.o"
c++ $B "$HERE/check_mxfp4.cpp" "$OUT"/scalar.o "$OUT"/avx2.o "$OUT"/avxvnni.o "$OUT"/avx512f.o "$OUT"/avx512vnni.o \
  -o "$OUT/check_mxfp4"
"$OUT/check_mxfp4"
