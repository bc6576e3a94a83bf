// q4_k_x16: q4_k experts with 16 rows interleaved per 256-block, for CPUs (docs/formats/q4_k.md "q4_k_x16").
// Banks (slots): 0 gate_up [E, 2I/16, (H/256)*2304], 1 down [E, H/16, (I/256)*2304], uint8. A bank row is a group of
// 16 weight rows; per 256-block it holds 2304 bytes, the same 144 bytes per row as q4_k, moved
// (cpumoe_formats.repack_q4_k_x16):
//   [0, 32)      the 16 rows' fp16 d (row r at 2r)
//   [32, 64)     their fp16 dmin
//   [64, 256)    12 planes of 16 bytes: plane k byte r = row r's packed scale byte k
//   [256, 2304)  32 vectors of 64 bytes: vector 8c + v, int32 lane r = row r's qs[32c + 4v .. 32c + 4v + 3]
//                (low nibbles: elements 64c + 4v .. of sub-block 2c; high: 64c + 32 + 4v .. of sub-block 2c + 1)
//
// Mode w4a8 only (q4_k's default): kmins_x16.h's kernels without fifth bits (KMinsX16<false>): the Q8_0-rule
// activation record with the sums of each 32 codes, per (row, token) and block the exact S = sum_j sc[j] sum(q q_a)
// and M = sum_j m[j] bs32[j], folded as acc = fma(float(S), d d_a, acc), acc = fma(float(M), -(dmin d_a), acc).
// Every tier does these operations in this order: the tiers are bit-identical, and a token's result does not depend
// on its batch.
#include "kmins_x16.h"

bool CPUMOE_INIT_FN(q4_k_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  return x16::install_row_groups<KMinsX16<false, true>, KMinsX16<false, false>>(k, &act_bytes_x16, &prep_x16);
}
