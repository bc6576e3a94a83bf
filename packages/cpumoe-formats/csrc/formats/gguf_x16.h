// The x16.h layout of the GGUF "_x16" formats (q4_k_x16, q5_k_x16, q6_k_x16, q8_0_x16): a group of 16 rows is one
// bank row (gate_up in slot 0, down in slot 1), its group dot in three forms that the kernels struct supplies:
//
//   struct Kern {
//     static constexpr int QK, kMaxNT;   // elements per block; tokens per group call
//     static constexpr int64_t kPf;      // x16.h's G16::kPf
//     // out[(g * NT + t) * 16 + r] = dot(row r of group g (bank rows w[g]), token t), nb blocks
//     template <int G, int NT> static void zmm(const uint8_t* const* w, int nb, const void* const* act, float* out);
//                                                                         // avx512vnni (w4a8), avx512f (native):
//                                                                         // 16 rows per zmm
//     template <int G, int NT, int H0, int NH> static void ymm(...same...); // avx2 / avxvnni: rows 8h..8h+7 per ymm,
//                                                                         // h in [H0, H0 + NH)
//     template <int G, int NT> static void scalar(...same...);            // the same operations, row by row
//   };
//
// A lone token takes both row halves per block on ymm (G x 2 streams); several take one half per pass (the second
// pass reads the group from L1 / L2), so only one half's accumulators are live. The kernels' loops over groups,
// blocks and rows are group_blocks and scalar_rows below: a kernel supplies what it does with one block.
#pragma once
#include "../x16.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace x16 {

// The accumulator vectors of the frames: a zmm of a group's 16 rows, a ymm of rows 8h .. 8h + 7 (kRows each).
#if defined(__AVX512F__)
struct Zmm {
  using VF = __m512;
  static constexpr int kRows = 16;
  static CPUMOE_INLINE VF zero() { return _mm512_setzero_ps(); }
  static CPUMOE_INLINE void st(float* o, VF v) { _mm512_storeu_ps(o, v); }
};
#endif
#if defined(__AVX2__)
struct Ymm {
  using VF = __m256;
  static constexpr int kRows = 8;
  static CPUMOE_INLINE VF zero() { return _mm256_setzero_ps(); }
  static CPUMOE_INLINE void st(float* o, VF v) { _mm256_storeu_ps(o, v); }
};
#endif

// The vector kernels' frame: G groups x NT tokens over the row vectors H0 .. H0 + NH - 1 of V (zmm: H0 = 0, NH = 1),
// from zero, block by block in K order and per block group by group (G streams side by side):
// block(b, p, acc[g]) adds block b of group g (its gb bytes at p) to acc[g][hh][t]; then
// out[(g NT + t) 16 + kRows (H0 + hh) ..] = acc[g][hh][t].
template <class V, int G, int NT, int H0, int NH, class Block>
CPUMOE_INLINE void group_blocks(const uint8_t* const* w, int nb, int gb, float* out, const Block& block) {
  typename V::VF acc[G][NH][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int hh = 0; hh < NH; ++hh)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[g][hh][t] = V::zero();
  for (int b = 0; b < nb; ++b)
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) block(b, w[g] + (size_t)b * gb, acc[g]);
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      CPUMOE_UNROLL
      for (int hh = 0; hh < NH; ++hh) V::st(out + (size_t)(g * NT + t) * GR + V::kRows * (H0 + hh), acc[g][hh][t]);
}

// The scalar kernels' frame: per (group, token, row) from acc = 0, block by block in K order:
// acc = block(p, t, b, r, acc) (p: block b of the group, gb bytes); out[(g NT + t) 16 + r] = acc.
template <int G, int NT, class Block>
CPUMOE_INLINE void scalar_rows(const uint8_t* const* w, int nb, int gb, float* out, const Block& block) {
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < GR; ++r) {
        float acc = 0.f;
        for (int b = 0; b < nb; ++b) acc = block(w[g] + (size_t)b * gb, t, b, r, acc);
        out[(size_t)(g * NT + t) * GR + r] = acc;
      }
}

template <class Kern>
struct RowG16 {
  static constexpr int kMaxNT = Kern::kMaxNT;
  static constexpr int64_t kPf = Kern::kPf;
  static constexpr int kSlot[2] = {0, 1};
  struct Ref {
    const uint8_t* w;
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    return {bank_row<uint8_t>(banks[mat], e, g)};
  }
  template <int G, int NT>
  static void groups(const Ref* gp, int K, const void* const* act, float* out) {
    const uint8_t* w[G];
    for (int g = 0; g < G; ++g) w[g] = gp[g].w;
    const int nb = K / Kern::QK;
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI || CPUMOE_TIER == CPUMOE_T_AVX512F  // avx512f: the native kernels
    Kern::template zmm<G, NT>(w, nb, act, out);
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
    if constexpr (NT == 1) {
      Kern::template ymm<G, 1, 0, 2>(w, nb, act, out);
    } else {
      Kern::template ymm<G, NT, 0, 1>(w, nb, act, out);
      Kern::template ymm<G, NT, 1, 1>(w, nb, act, out);
    }
#else
    Kern::template scalar<G, NT>(w, nb, act, out);
#endif
  }
};

// Installs RowG16<Kern> (w4a8) on the tiers with a group dot: scalar, avx2, avxvnni, avx512vnni; RowG16<KernNoPf>
// where the prefetch is off (x16.h install_pf). A layout that always prefetches (q5_k_x16) leaves KernNoPf = Kern.
template <class Kern, class KernNoPf = Kern>
bool install_row_groups(cpumoe_kernel* k, cpumoe_act_bytes_fn act_bytes, cpumoe_prep_act_fn prep) {
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || \
    CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  return install_pf<RowG16<Kern>, RowG16<KernNoPf>>(k, CPUMOE_MODE_W4A8, act_bytes, prep);
#else
  (void)k, (void)act_bytes, (void)prep;
  return false;  // avx512f / avx512bf16 / amx: the tier below (avxvnni or avx2) or avx512vnni runs
#endif
}

}  // namespace x16
}  // namespace CPUMOE_NS
}  // namespace cpumoe
