// q5_k_x16: q5_k experts with 16 rows interleaved per 256-block, for CPUs (docs/formats/q5_k.md "q5_k_x16").
// Banks (slots): 0 gate_up [E, 2I/16, (H/256)*2816], 1 down [E, H/16, (I/256)*2816], uint8. A bank row is a group of
// 16 weight rows; per 256-block it holds 2816 bytes, the same 176 bytes per row as q5_k, moved
// (cpumoe_formats.repack_q5_k_x16):
//   [0, 32)       the 16 rows' fp16 d (row r at 2r)
//   [32, 64)      their fp16 dmin
//   [64, 256)     12 planes of 16 bytes: plane k byte r = row r's packed scale byte k
//   [256, 768)    8 vectors of 64 bytes: vector v, int32 lane r = row r's qh[4v .. 4v + 3] (the fifth bits)
//   [768, 2816)   32 vectors of 64 bytes: vector 8c + v, int32 lane r = row r's qs[32c + 4v .. 32c + 4v + 3]
// (q4_k_x16's layout with the fifth bits after the scales: kmins_x16.h).
//
// Modes (q5_k's):
//  w4a8 (default): kmins_x16.h's kernels with fifth bits (KMinsX16<true>): q4_k_x16's activation record and
//    integers S = sum_j sc[j] sum(q q_a), M = sum_j m[j] bs32[j] with q = nibble | fifth bit << 4, folded per
//    (row, token) block by block in K order as acc = fma(float(S), d d_a, acc), acc = fma(float(M), -(dmin d_a), acc).
//    Bounds: a run's sum <= 32 * 31 * 127, times sc <= 63, over 8 runs: |S| < 2^26 (int32, exact).
//  native (W5A16): q5_k_x16_native.h, q5_k's scalar native operations in its order.
// Every tier does the mode's operations in the same order: bit-identical, and a token's result does not depend on
// its batch.
#include "kmins_x16.h"
#include "x16_vec.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

#include "q5_k_x16_native.h"  // mode native (Q5KNativeBlock)

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

// w4a8: scalar, avx2, avxvnni, avx512vnni; native: scalar, avx2, avx512f (q5_k's tiers).
bool CPUMOE_INIT_FN(q5_k_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  return x16::install_native_or_w4a8<Q5KNativeBlock, KMinsX16<true>>(k, &act_bytes_x16, &prep_x16);
}
