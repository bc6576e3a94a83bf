// q4_k experts (native GGUF Q4_K): gate_up [E, 2I, (H/256)*144], down [E, H, (I/256)*144], uint8. Block of 256
// weights, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc[j] and mins m[j] (j = sub-block of 32),
// qs[128] (sub-block pair p in qs[32p..32p+31]: element 64p + l in the low nibble of byte l, 64p + 32 + l in its
// high nibble); w = d sc[j] q - dmin m[j]. Banks (slots): 0 gate_up, 1 down. H, I multiples of 256. Blocks are
// 144 bytes, so weight loads are unaligned (bank alignment 1).
//
// Modes (k->params.mode):
//  w4a8 (default; ggml vec_dot_q4_K_q8_K): prep quantizes each 256-block of the activation by the Q8_0 rule with
//    the int16 sums of each 16 codes (gguf_rows.h prep_act_i8<256>). Per block two exact integers,
//    S = sum_j sc[j] sum(q q_a) and M = sum_j m[j] (bsum[2j] + bsum[2j+1]), folded into fp32 lanes as
//    acc += S * (d d_a), acc += M * (-(dmin d_a)). avx2: vpmaddubsw(nibbles, q_a) (a pair <= 2 * 15 * 127 = 3810,
//    no int16 saturation), vpmaddwd with sc[j] broadcast in int16; avxvnni / avx512vnni: vpdpwssd for the second
//    step. Every int32 lane is the same exact integer in the three, so they are bit-identical
//    (tests/test_kquant_kernels.py). The kernels are kquant_mins.h's block traits in gguf_block_kernels.h's skeleton.
//    The executor runs q4_k's CPU layout, q4_k_x16, by default (q4_k_x16.cpp).
//  native (W4A16): fp32 activations, the weights as gguf dequantizes them, fma(q, d sc, -(dmin m)) (d q sc exact,
//    one rounding), fp32 FMAs. Tiers: scalar, avx2, avx512f.
#include "kquant_mins.h"

bool CPUMOE_INIT_FN(q4_k)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  return gguf::init<gguf::KMinsBlock<144, false>>(k);
}
