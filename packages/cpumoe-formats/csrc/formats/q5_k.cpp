// q5_k experts (native GGUF Q5_K): gate_up [E, 2I, (H/256)*176], down [E, H, (I/256)*176], uint8. Block of 256
// weights, 176 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc[j] and mins m[j] (Q4_K's packing),
// qh[32] (element 32j + l's fifth bit is bit j of qh[l]), qs[128] (Q4_K's nibbles: sub-block pair p in
// qs[32p..32p+31], element 64p + l in the low nibble of byte l, 64p + 32 + l in its high nibble); the code
// q = nibble | fifth bit << 4 in 0..31, w = d sc[j] q - dmin m[j]. Banks (slots): 0 gate_up, 1 down. H, I
// multiples of 256. Blocks are 176 bytes, so weight loads are unaligned (bank alignment 1).
//
// Modes (k->params.mode):
//  w4a8 (default; ggml vec_dot_q5_K_q8_K, W5A8): q4_k's activations (gguf_rows.h prep_act_i8<256>) and q4_k's two
//    exact integers per block, S = sum_j sc[j] sum(q q_a) and M = sum_j m[j] (bsum[2j] + bsum[2j+1]), folded as
//    acc += S * (d d_a), acc += M * (-(dmin d_a)). avx2: vpmaddubsw(codes, q_a) (a pair <= 2 * 31 * 127 = 7874,
//    no int16 saturation), vpmaddwd with sc[j] broadcast in int16 (a lane of S <= 8 runs * 63 * 4 * 31 * 127 =
//    7.9e6 < 2^24: converted exactly); avxvnni / avx512vnni: vpdpwssd for the second step. Every int32 lane is the
//    same exact integer in the three, so they are bit-identical (tests/test_kquant_kernels.py). The kernels are
//    kquant_mins.h's block traits (q4_k's with the fifth bits) in gguf_block_kernels.h's skeleton.
//  native (W5A16): fp32 activations, the weights as gguf dequantizes them, fma(q, d sc, -(dmin m)) (d q sc exact,
//    one rounding), fp32 FMAs. Tiers: scalar, avx2, avx512f.
#include "kquant_mins.h"

bool CPUMOE_INIT_FN(q5_k)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  return gguf::init<gguf::KMinsBlock<176, true>>(k);
}
