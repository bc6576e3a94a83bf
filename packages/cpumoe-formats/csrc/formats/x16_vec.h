// The GGUF "_x16" native kernels (W*A16: fp32 activations, the bf16 values; q6_k_x16_native.h, q5_k_x16_native.h).
// NativeVec: their vector, avx512f a zmm of the 16 rows of a group, avx2 a ymm of rows 8 hr .. 8 hr + 7 (their bytes
// at +32 hr of a 64-byte vector, their fp16 d at +16 hr, their bytes of a 16-byte plane at +8 hr); other tiers:
// empty (scalar code). NativeX16<Dec>: gguf_x16.h's kernels struct of a native mode, its frames over the format's
// block decode Dec.
#pragma once
#include "gguf_x16.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace x16 {

#if CPUMOE_TIER == CPUMOE_T_AVX512F
struct NativeVec : Zmm {
  using VI = __m512i;
  static CPUMOE_INLINE VI ld(const uint8_t* p, int) { return _mm512_loadu_si512(p); }
  static CPUMOE_INLINE VI b8(int v) { return _mm512_set1_epi8((char)v); }
  static CPUMOE_INLINE VI b32(int v) { return _mm512_set1_epi32(v); }
  static CPUMOE_INLINE VI and_(VI a, VI b) { return _mm512_and_si512(a, b); }
  static CPUMOE_INLINE VI or_(VI a, VI b) { return _mm512_or_si512(a, b); }
  template <int N> static CPUMOE_INLINE VI sll16(VI a) { return _mm512_slli_epi16(a, N); }
  template <int N> static CPUMOE_INLINE VI srl16(VI a) { return _mm512_srli_epi16(a, N); }
  template <int N> static CPUMOE_INLINE VI sll32(VI a) { return _mm512_slli_epi32(a, N); }
  template <int N> static CPUMOE_INLINE VI srl32(VI a) { return _mm512_srli_epi32(a, N); }
  template <int N> static CPUMOE_INLINE VI sra32(VI a) { return _mm512_srai_epi32(a, N); }
  static CPUMOE_INLINE VI sub8(VI a, VI b) { return _mm512_sub_epi8(a, b); }
  static CPUMOE_INLINE VF cvt(VI a) { return _mm512_cvtepi32_ps(a); }
  static CPUMOE_INLINE VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  static CPUMOE_INLINE VF neg(VF a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a),
                                                                                  _mm512_set1_epi32((int)0x80000000u))); }
  static CPUMOE_INLINE VF set1(float v) { return _mm512_set1_ps(v); }
  static CPUMOE_INLINE VF d_of(const uint8_t* p, int) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static CPUMOE_INLINE VF sc_of(const uint8_t* plane, int) {  // int8 bytes
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)plane)));
  }
  static CPUMOE_INLINE VF uc_of(const uint8_t* plane, int) {  // uint8 bytes
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)plane)));
  }
};
#elif CPUMOE_TIER == CPUMOE_T_AVX2
struct NativeVec : Ymm {
  using VI = __m256i;
  static CPUMOE_INLINE VI ld(const uint8_t* p, int hr) { return _mm256_loadu_si256((const __m256i*)(p + 32 * hr)); }
  static CPUMOE_INLINE VI b8(int v) { return _mm256_set1_epi8((char)v); }
  static CPUMOE_INLINE VI b32(int v) { return _mm256_set1_epi32(v); }
  static CPUMOE_INLINE VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
  static CPUMOE_INLINE VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
  template <int N> static CPUMOE_INLINE VI sll16(VI a) { return _mm256_slli_epi16(a, N); }
  template <int N> static CPUMOE_INLINE VI srl16(VI a) { return _mm256_srli_epi16(a, N); }
  template <int N> static CPUMOE_INLINE VI sll32(VI a) { return _mm256_slli_epi32(a, N); }
  template <int N> static CPUMOE_INLINE VI srl32(VI a) { return _mm256_srli_epi32(a, N); }
  template <int N> static CPUMOE_INLINE VI sra32(VI a) { return _mm256_srai_epi32(a, N); }
  static CPUMOE_INLINE VI sub8(VI a, VI b) { return _mm256_sub_epi8(a, b); }
  static CPUMOE_INLINE VF cvt(VI a) { return _mm256_cvtepi32_ps(a); }
  static CPUMOE_INLINE VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  static CPUMOE_INLINE VF neg(VF a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static CPUMOE_INLINE VF set1(float v) { return _mm256_set1_ps(v); }
  static CPUMOE_INLINE VF d_of(const uint8_t* p, int hr) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * hr)));
  }
  static CPUMOE_INLINE VF sc_of(const uint8_t* plane, int hr) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(plane + 8 * hr))));
  }
  static CPUMOE_INLINE VF uc_of(const uint8_t* plane, int hr) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(plane + 8 * hr))));
  }
};
#else
struct NativeVec {};
#endif

// The native mode's kernels over a block decode:
//   struct Dec : NativeVec {
//     static constexpr int QK, GB;       // elements and bytes of a group-block
//     static constexpr int64_t kPf;      // x16.h's G16::kPf
//     // (avx512f, avx2) adds block b (at p) of a group to acc[hh][t], rows 8 (H0 + hh) .. (all 16 on zmm)
//     template <int NT, int H0, int NH>
//     static void block(const uint8_t* p, int b, const void* const* act, VF (&acc)[NH][NT]);
//     // (every tier) acc plus row `row`'s dot over the block at p with the token's QK fp32 at x, in the vector
//     // tiers' order of operations
//     static float scalar(const uint8_t* p, const float* x, int row, float acc);
//   };
// ymm is group_blocks over NativeVec, zmm (avx512f) its one pass over all 16 rows; RowG16 runs them as the w4a8
// kernels (on avx2 a lone token both row halves per block, several one half per pass).
template <class Dec>
struct NativeX16 {
  static constexpr int QK = Dec::QK;
  // tokens per group call: per token its accumulators (zmm: 32 registers, ymm: 16)
  static constexpr int kMaxNT = CPUMOE_TIER == CPUMOE_T_AVX512F ? 4 : 2;
  static constexpr int64_t kPf = Dec::kPf;

#if CPUMOE_TIER == CPUMOE_T_AVX512F || CPUMOE_TIER == CPUMOE_T_AVX2
  template <int G, int NT, int H0, int NH>
  static CPUMOE_INLINE void ymm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    auto block = [&](int b, const uint8_t* p, NativeVec::VF (&acc)[NH][NT]) CPUMOE_LAMBDA_INLINE {
      Dec::template block<NT, H0, NH>(p, b, act, acc);
    };
    group_blocks<NativeVec, G, NT, H0, NH>(w, nb, Dec::GB, out, block);
  }
  template <int G, int NT>
  static CPUMOE_INLINE void zmm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    ymm<G, NT, 0, 1>(w, nb, act, out);
  }
#endif

  template <int G, int NT>
  static void scalar(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    auto block = [&](const uint8_t* p, int t, int b, int r, float acc) CPUMOE_LAMBDA_INLINE {
      return Dec::scalar(p, (const float*)act[t] + (size_t)b * QK, r, acc);
    };
    scalar_rows<G, NT>(w, nb, Dec::GB, out, block);
  }
};

// A GGUF "_x16" format with a native mode: RowG16<NativeX16<Dec>> where the mode is native and the tier has its
// kernel (scalar, avx2, avx512f), else the w4a8 group dots RowG16<Kern> (install_row_groups). A tier without the
// mode's kernel declines and the tier below runs. KernNoPf: install_row_groups'.
template <class Dec, class Kern, class KernNoPf = Kern>
bool install_native_or_w4a8(cpumoe_kernel* k, cpumoe_act_bytes_fn act_bytes, cpumoe_prep_act_fn prep) {
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
  if (k->params.mode == CPUMOE_MODE_NATIVE)
    return install<RowG16<NativeX16<Dec>>>(k, CPUMOE_MODE_NATIVE, &act_bytes_f32, &prep_act_f32);
#endif
  return install_row_groups<Kern, KernNoPf>(k, act_bytes, prep);
}

}  // namespace x16
}  // namespace CPUMOE_NS
}  // namespace cpumoe
