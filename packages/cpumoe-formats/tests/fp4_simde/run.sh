#!/bin/sh
# Runs the nvfp4 / ds_fp4 AVX-512 and VNNI tiers on a CPU without them, by compiling those tiers against
# SIMDe's portable intrinsics (apt: libsimde-dev), and compares every work item (prep_act, gate_up, down) with
# the natively compiled scalar and avx2 tiers on random banks and several shapes (ragged included).
# Expectation (checked): nvfp4 w4a8 avxvnni/avx512vnni bit-identical to avx2; native avx512f within fp32 rounding; ds_fp4
# w4a8 within fp32 rounding (bf16 route terms may flip one ulp), its avx512vnni bit-identical to avx512f; ds_fp4 native
# usually bit-identical. Not collected by pytest (needs SIMDe and ~1 minute of compiling).
#   sh packages/cpumoe-formats/tests/fp4_simde/run.sh
HERE=$(cd "$(dirname "$0")" && pwd)
NAME=fp4_simde
. "$HERE/../simde_env.sh"
EMU="-include $HERE/simde_pre.h"
for f in nvfp4 ds_fp4; do
  c++ $B -DCPUMOE_TIER=0 -DCPUMOE_TIER_TAG=scalar -fno-tree-vectorize -c csrc/formats/$f.cpp -o "$OUT/$f.scalar.o"
  c++ $B $AVX2 -DCPUMOE_TIER=1 -DCPUMOE_TIER_TAG=avx2 -c csrc/formats/$f.cpp -o "$OUT/$f.avx2.o"
  c++ $B $EMU -DSIMD_AVX512=1 -DCPUMOE_TIER=3 -DCPUMOE_TIER_TAG=avx512f -c csrc/formats/$f.cpp -o "$OUT/$f.avx512f.o"
done
c++ $B $EMU -DSIMD_AVX512=0 -DCPUMOE_TIER=2 -DCPUMOE_TIER_TAG=avxvnni -c csrc/formats/nvfp4.cpp -o "$OUT/nvfp4.avxvnni.o"
for f in nvfp4 ds_fp4; do
  c++ $B $EMU -DSIMD_AVX512=1 -DCPUMOE_TIER=4 -DCPUMOE_TIER_TAG=avx512vnni -c csrc/formats/$f.cpp -o "$OUT/$f.avx512vnni.o"
done
c++ $B "$HERE/check_tiers.cpp" "$OUT"/*.o -o "$OUT/check_tiers"
"$OUT/check_tiers"
