// q8_0 experts (native GGUF Q8_0): gate_up [E, 2I, (H/32)*34], down [E, H, (I/32)*34], uint8. Block of 32
// weights, 34 bytes: fp16 d (LE), then 32 int8 codes in element order; w = q * d. Banks (slots): 0 gate_up,
// 1 down. H, I multiples of 32. Blocks are 34 bytes, so every weight load is unaligned (bank alignment 1).
//
// Modes (k->params.mode):
//  w4a8 (default; ggml vec_dot_q8_0_q8_0, W8A8): prep quantizes each 32-block of the activation by the Q8_0 rule
//    (gguf_rows.h prep_act_i8<32>). Per block the exact integer sum(q_w * q_a), times fp32(fp16(d)) * d_a, summed
//    in fp32 lanes. avx2: ggml's sign trick, vpmaddubsw(|q_w|, sign(q_a, q_w)) (|q_w| <= 128 as an unsigned byte,
//    |q_a| <= 127: a pair sums to <= 2 * 128 * 127 = 32512, no int16 saturation) then vpmaddwd with ones;
//    avxvnni / avx512vnni: vpdpbusd on the same operands. Every int32 lane is the exact sum of 4 products in every
//    tier, so avx2, avxvnni and avx512vnni are bit-identical (tests/test_q8_0.py).
//  native (W8A16): fp32 activations, per block d * sum(q * x) in fp32. Tiers: scalar, avx2, avx512f.
#include "gguf_block_kernels.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace gguf;

struct Q8Block {
  static constexpr int QK = 32, QB = 34, kActQB = 32;
  static constexpr int kStep = 4, kPfLines = 3;                 // w4a8: 4 blocks (136 bytes) a step
  static constexpr int kPfNativeEvery = 2, kPfNativeLines = 2;  // native: 68 bytes a pair of blocks

#if CPUMOE_TIER == CPUMOE_T_SCALAR
  static void scalar_i8(const uint8_t* p, const ActI8<32>& a, int b, float& acc) {
    const int8_t* qw = (const int8_t*)(p + 2);
    const int8_t* qa = a.q + (size_t)b * QK;
    int32_t s = 0;
    for (int j = 0; j < QK; ++j) s += qw[j] * qa[j];
    acc += (float)s * (fp16_to_f32(ld16(p)) * a.d[b]);
  }
  static void scalar_native(const uint8_t* p, const float* x, float& acc) {
    const int8_t* qw = (const int8_t*)(p + 2);
    float s = 0.0f;
    for (int j = 0; j < QK; ++j) s += (float)qw[j] * x[j];
    acc += fp16_to_f32(ld16(p)) * s;
  }
#endif

#if CPUMOE_GGUF_I8_SIMD
  // sum over each 4 bytes of |w| * sign(a, w) = w * a, as int32 lanes (exact)
  static CPUMOE_INLINE __m256i dot4(__m256i aw, __m256i sa) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, sa);
#elif CPUMOE_TIER == CPUMOE_T_AVX512VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sa);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), _mm256_set1_epi16(1));
#endif
  }
  // one block: acc += float(lanes of block b) * (d_w * d_a)
  template <int NT>
  static CPUMOE_INLINE void block(const uint8_t* p, int b, const ActsI8<32, NT>& a, float dw, __m256 (&acc)[NT]) {
    const __m256i qw = _mm256_loadu_si256((const __m256i*)(p + 2));
    const __m256i aw = _mm256_sign_epi8(qw, qw);
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m256i sa = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(a.q[t] + (size_t)b * QK)), qw);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(aw, sa)), _mm256_set1_ps(dw * a.d[t][b]), acc[t]);
    }
  }
  // 4 blocks, their 4 fp16 d in one vcvtph2ps
  template <int NT>
  static CPUMOE_INLINE void step_i8(const uint8_t* p, int b, const ActsI8<32, NT>& a, __m256 (&acc)[NT]) {
    alignas(16) float dw[4];
    _mm_store_ps(dw, _mm_cvtph_ps(_mm_setr_epi16((short)ld16(p), (short)ld16(p + QB), (short)ld16(p + 2 * QB),
                                                 (short)ld16(p + 3 * QB), 0, 0, 0, 0)));
    CPUMOE_UNROLL
    for (int j = 0; j < 4; ++j) block<NT>(p + j * QB, b + j, a, dw[j], acc);
  }
  template <int NT>
  static CPUMOE_INLINE void tail_i8(const uint8_t* p, int b, const ActsI8<32, NT>& a, __m256 (&acc)[NT]) {
    block<NT>(p, b, a, _cvtsh_ss(ld16(p)), acc);
  }
#endif

#if CPUMOE_GGUF_NATIVE_SIMD
  // acc += (sum over the block of q * x) * d
  template <class V, int NT>
  static CPUMOE_INLINE void block_native(const uint8_t* p, const float* const* x, typename V::F (&acc)[NT]) {
    signed_run<V, QK, NT>((const int8_t*)(p + 2), x, 0, V::set1(_cvtsh_ss(ld16(p))), acc);
  }
#endif
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(q8_0)(cpumoe_kernel* k) { return cpumoe::CPUMOE_NS::gguf::init<cpumoe::CPUMOE_NS::Q8Block>(k); }
