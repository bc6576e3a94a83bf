// q6_k experts (native GGUF Q6_K): gate_up [E, 2I, (H/256)*210], down [E, H, (I/256)*210], uint8. Block of 256
// weights, 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8 scales (one per 16 elements), fp16 d.
// Half h (elements 128h ..) takes ql[64h ..], qh[32h ..]; its four runs of 32 elements are
//   (ql[l] & 15, qh[l] bits 0-1), (ql[32 + l] & 15, bits 2-3), (ql[l] >> 4, bits 4-5), (ql[32 + l] >> 4, bits 6-7)
// as (low 4 bits, high 2 bits) of the code q in 0..63; w = d sc[e / 16] (q - 32). Banks (slots): 0 gate_up, 1 down.
// H, I multiples of 256. Blocks are 210 bytes: weight loads are unaligned (bank alignment 1).
//
// Modes (k->params.mode):
//  w4a8 (default; ggml vec_dot_q6_K_q8_K, W6A8): the activations as q4_k's (gguf_rows.h prep_act_i8<256>: the Q8_0
//    rule per 256-block). Per block the exact integer S = sum_j sc[j] sum((q - 32) q_a), in 8 int32 lanes, folded
//    as acc += S * (d d_a) in fp32 lanes. avx2: ggml's sign trick on the signed codes, vpmaddubsw(|q - 32|,
//    sign(q_a, q - 32)) (|q - 32| <= 32: a pair <= 2 * 32 * 127 = 8128), then vpmaddwd with the two sub-blocks'
//    scales; avxvnni / avx512vnni: vpdpwssd for the second step. A lane sums 4 products of each of a block's 8 runs
//    times its scale, |lane| <= 8 * 128 * 4 * 32 * 127 < 2^24: converted exactly (all codes 32 give exactly 0). The
//    int32 lanes are the same in the three tiers, so they are bit-identical (tests/test_kquant_kernels.py).
//  native (W6A16): fp32 activations, per sub-block (d sc[j]) * sum((q - 32) x) in fp32. Tiers: scalar, avx2,
//    avx512f.
#include "gguf_block_kernels.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace gguf;

#if defined(__AVX2__)
// The four 32-code runs of half h of the block at p, element order (128h + 32g ..), as unsigned bytes 0..63.
struct Half {
  __m256i q[4];
  CPUMOE_INLINE Half(const uint8_t* p, int h) {
    const __m256i ql0 = _mm256_loadu_si256((const __m256i*)(p + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i*)(p + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    // the high bits 2g, 2g+1 of qh moved to bits 4-5 (16-bit shifts: the mask keeps each byte's own bits)
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
    // (lo & 0x0F) | (hi & 0xF0) in one vpternlogd (0xE4: C ? A : B), then & 0x3F: 3 ops a run where 4 were
    const __m256i m3f = _mm256_set1_epi8(0x3F);
    q[0] = _mm256_and_si256(_mm256_ternarylogic_epi32(ql0, _mm256_slli_epi16(qh, 4), m4, 0xE4), m3f);
    q[1] = _mm256_and_si256(_mm256_ternarylogic_epi32(ql1, _mm256_slli_epi16(qh, 2), m4, 0xE4), m3f);
    q[2] = _mm256_and_si256(_mm256_ternarylogic_epi32(_mm256_srli_epi16(ql0, 4), qh, m4, 0xE4), m3f);
    q[3] = _mm256_and_si256(_mm256_ternarylogic_epi32(_mm256_srli_epi16(ql1, 4), _mm256_srli_epi16(qh, 2), m4, 0xE4), m3f);
    (void)m30;
#else
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
#endif
  }
};
#endif

struct Q6KBlock {
  static constexpr int QK = 256, QB = 210, kActQB = 256, kStep = 1;
  static constexpr int kPfLines = 4, kPfNativeEvery = 1, kPfNativeLines = 4;  // 210 bytes a block

  // Code of element e (0..255) of the block at p, 0..63.
  static CPUMOE_INLINE int code(const uint8_t* p, int e) {
    const int h = e / 128, g = e % 128 / 32, l = e % 32;
    const uint8_t lo = p[64 * h + 32 * (g & 1) + l], hi = p[128 + 32 * h + l];
    return ((g < 2 ? lo & 15 : lo >> 4)) | ((hi >> 2 * g) & 3) << 4;
  }

#if CPUMOE_TIER == CPUMOE_T_SCALAR
  static void scalar_i8(const uint8_t* p, const ActI8<256>& a, int b, float& acc) {
    const int8_t* sc = (const int8_t*)(p + 192);
    const int8_t* qa = a.q + (size_t)b * QK;
    int32_t S = 0;
    for (int j = 0; j < 16; ++j) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += (code(p, 16 * j + i) - 32) * qa[16 * j + i];
      S += sc[j] * s;
    }
    acc += (float)S * (fp16_to_f32(ld16(p + 208)) * a.d[b]);
  }
  static void scalar_native(const uint8_t* p, const float* x, float& acc) {
    const float d = fp16_to_f32(ld16(p + 208));
    for (int j = 0; j < 16; ++j) {
      float s = 0.0f;
      for (int i = 0; i < 16; ++i) s += (float)(code(p, 16 * j + i) - 32) * x[16 * j + i];
      acc = std::fma(d * (float)((const int8_t*)(p + 192))[j], s, acc);
    }
  }
#endif

#if CPUMOE_GGUF_I8_SIMD
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  // The block's 16 scales as int16 (s16), and [sc[j] x 8 | sc[j+1] x 8] from them in one vpermw: 9 ops a block
  // where a shuffle and a widening per run took 16. With the vpternlogd runs below (q6_k is bound by its decode in
  // L3, ~95 vector ops a block): batch 1 from L3 786 -> 760 us, 4 of 4 alternating rounds faster (Zen 4, 2 threads)
  static CPUMOE_INLINE __m256i scales16(__m128i sc) { return _mm256_cvtepi8_epi16(sc); }
  static CPUMOE_INLINE __m256i pair_scales16(__m256i s16, int j) {
    const __m256i idx = _mm256_setr_epi16(j, j, j, j, j, j, j, j, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1);
    return _mm256_permutexvar_epi16(idx, s16);
  }
#else
  static CPUMOE_INLINE __m128i scales16(__m128i sc) { return sc; }
  // [sc[j] x 8 | sc[j+1] x 8] as int16 (a run of 32 codes spans sub-blocks j and j + 1)
  static CPUMOE_INLINE __m256i pair_scales16(__m128i sc, int j) {
    const long long b = 0x0101010101010101ll;
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_set_epi64x(b * (j + 1), b * j)));
  }
#endif
  template <int NT>
  static CPUMOE_INLINE void step_i8(const uint8_t* p, int b, const ActsI8<256, NT>& a, __m256 (&acc)[NT]) {
    const auto s16 = scales16(_mm_loadu_si128((const __m128i*)(p + 192)));
    __m256i S[NT];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) S[t] = _mm256_setzero_si256();
    CPUMOE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const Half H(p, h);
      CPUMOE_UNROLL
      for (int g = 0; g < 4; ++g) {
        const __m256i qm = _mm256_sub_epi8(H.q[g], _mm256_set1_epi8(32)), aq = _mm256_abs_epi8(qm);
        const __m256i sv = pair_scales16(s16, 8 * h + 2 * g);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          const __m256i q = _mm256_loadu_si256((const __m256i*)(a.q[t] + (size_t)b * QK + 128 * h + 32 * g));
          S[t] = madd_acc(S[t], _mm256_maddubs_epi16(aq, _mm256_sign_epi8(q, qm)), sv);
        }
      }
    }
    const float d = _cvtsh_ss(ld16(p + 208));
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[t]), _mm256_set1_ps(d * a.d[t][b]), acc[t]);
  }
#endif

#if CPUMOE_GGUF_NATIVE_SIMD
  // per sub-block of 16: s = sum((q - 32) x) in lanes, acc += s * (d sc[j])
  template <class V, int NT>
  static CPUMOE_INLINE void block_native(const uint8_t* p, const float* const* x, typename V::F (&acc)[NT]) {
    const float d = _cvtsh_ss(ld16(p + 208));
    const int8_t* sc = (const int8_t*)(p + 192);
    const __m256i k32 = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const Half H(p, h);
      alignas(32) int8_t qm[128];  // q - 32, signed, element order of the half
      for (int g = 0; g < 4; ++g) _mm256_store_si256((__m256i*)(qm + 32 * g), _mm256_sub_epi8(H.q[g], k32));
      CPUMOE_UNROLL
      for (int j = 0; j < 8; ++j) signed_run<V, 16, NT>(qm + 16 * j, x, 128 * h + 16 * j, V::set1(d * (float)sc[8 * h + j]), acc);
    }
  }
#endif
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(q6_k)(cpumoe_kernel* k) { return cpumoe::CPUMOE_NS::gguf::init<cpumoe::CPUMOE_NS::Q6KBlock>(k); }
