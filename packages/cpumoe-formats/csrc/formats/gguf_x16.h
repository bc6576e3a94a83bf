// The x16.h layout of the GGUF "_x16" formats (q4_k_x16, q6_k_x16, q8_0_x16): a group of 16 rows is one bank row
// (gate_up in slot 0, down in slot 1), w4a8 only, its group dot in three forms that the kernels struct supplies:
//
//   struct Kern {
//     static constexpr int QK, kMaxNT;   // elements per block; tokens per group call
//     static constexpr int64_t kPf;      // x16.h's G16::kPf
//     // out[(g * NT + t) * 16 + r] = dot(row r of group g (bank rows w[g]), token t), nb blocks
//     template <int G, int NT> static void zmm(const uint8_t* const* w, int nb, const void* const* act, float* out);
//                                                                         // avx512vnni: 16 rows per zmm
//     template <int G, int NT, int H0, int NH> static void ymm(...same...); // avx2 / avxvnni: rows 8h..8h+7 per ymm,
//                                                                         // h in [H0, H0 + NH)
//     template <int G, int NT> static void scalar(...same...);            // the same integers, row by row
//   };
//
// A lone token takes both row halves per block on ymm (G x 2 streams); several take one half per pass (the second
// pass reads the group from L1 / L2), so only one half's accumulators are live.
#pragma once
#include "../x16.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace x16 {

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
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
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

// Installs RowG16<Kern> (w4a8) on the tiers with a group dot: scalar, avx2, avxvnni, avx512vnni.
template <class Kern>
bool install_row_groups(cpumoe_kernel* k, cpumoe_act_bytes_fn act_bytes, cpumoe_prep_act_fn prep) {
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || \
    CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  return install<RowG16<Kern>>(k, CPUMOE_MODE_W4A8, act_bytes, prep);
#else
  (void)k, (void)act_bytes, (void)prep;
  return false;  // avx512f / avx512bf16 / amx: the tier below (avxvnni or avx2) or avx512vnni runs
#endif
}

}  // namespace x16
}  // namespace CPUMOE_NS
}  // namespace cpumoe
