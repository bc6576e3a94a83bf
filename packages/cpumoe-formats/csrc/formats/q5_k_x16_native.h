// q5_k_x16's native mode (W5A16, q5_k's native): fp32 activations (the bf16 values); per (row, token), from acc = 0,
// block by block in K order, sub-block j = 0..7, its 32 elements e in order:
//   w = fma(float(q_e), d * sc[j], -(dmin * m[j]));  acc = fma(w, x_e, acc)
// w is gguf's dequantized weight (d q sc exact, one rounding), as q5_k's scalar tier: the same operations in the same
// order, so q5_k_x16 native equals q5_k's scalar native bit for bit. Every tier does them in this order (std::fma in
// scalar): bit-identical, and a token's result does not depend on its batch. Lanes are rows: per element one
// conversion and one weight fma serve 16 rows (zmm, avx512f) or 8 (ymm, avx2); each token pays one fma.
// Q5KNativeBlock is the block decode of x16_vec.h's NativeX16 (the frames over groups, tokens and blocks). Included
// by q5_k_x16.cpp inside its anonymous namespace (KMinsX16<true>'s layout, x16::NativeVec).
#pragma once

struct Q5KNativeBlock : x16::NativeVec {
  using L = KMinsX16<true>;
  static constexpr int QK = L::QK, GB = L::GB;
  static constexpr int64_t kPf = L::kPf;

#if CPUMOE_TIER == CPUMOE_T_AVX512F || CPUMOE_TIER == CPUMOE_T_AVX2
  // block b (at p) of a group into acc[hh][t]: rows 8 hr .. (all 16 on zmm), hr = H0 + hh
  template <int NT, int H0, int NH>
  static CPUMOE_INLINE void block(const uint8_t* p, int b, const void* const* act, VF (&acc)[NH][NT]) {
    const VI m4 = b8(0x0F), m255 = b32(255);
    if (H0 == 0)
      for (int l = 0; l < L::QS / 64; ++l) __builtin_prefetch(p + kPf + 64 * l, 0, 3);
    alignas(64) uint8_t sm[256];
    unpack_scales(p + 64, sm);
    CPUMOE_UNROLL
    for (int hh = 0; hh < NH; ++hh) {
      const int hr = H0 + hh;
      const VF d = d_of(p, hr), dmin = d_of(p + 32, hr);
      for (int j = 0; j < 8; ++j) {  // sub-block j: run pair j / 2, its low (even j) or high nibbles
        const int c = j / 2;
        const uint8_t* v = p + L::QS + 512 * c;
        if (H0 == 0 && hh == 0 && j % 2 == 0)
          for (int l = 0; l < 8; ++l) __builtin_prefetch(v + kPf + 64 * l, 0, 3);
        const VF ds = mul(d, uc_of(sm + 16 * j, hr)), ndm = neg(mul(dmin, uc_of(sm + 128 + 16 * j, hr)));
        CPUMOE_UNROLL
        for (int s = 0; s < 8; ++s) {  // elements 32j + 4s .. 32j + 4s + 3
          const VI x = ld(v + 64 * s, hr);
          const VI n = j % 2 ? and_(srl16<4>(x), m4) : and_(x, m4);
          const VI q = or_(n, gguf::fifth_bits(ld(p + L::QH + 64 * s, hr), j));
          const VF e[4] = {cvt(and_(q, m255)), cvt(and_(srl32<8>(q), m255)), cvt(and_(srl32<16>(q), m255)),
                           cvt(srl32<24>(q))};
          CPUMOE_UNROLL
          for (int i = 0; i < 4; ++i) {
            const VF wv = fma(e[i], ds, ndm);
            CPUMOE_UNROLL
            for (int t = 0; t < NT; ++t) {
              const float* xt = (const float*)act[t] + (size_t)b * QK + 32 * j + 4 * s;
              acc[hh][t] = fma(wv, set1(xt[i]), acc[hh][t]);
            }
          }
        }
      }
    }
  }
#endif

  // scalar: the same fp32 operations, row by row
  static CPUMOE_INLINE float scalar(const uint8_t* p, const float* x, int row, float acc) {
    uint8_t sm[256];
    unpack_scales(p + 64, sm);
    uint16_t dh, mh;
    std::memcpy(&dh, p + 2 * row, 2);
    std::memcpy(&mh, p + 32 + 2 * row, 2);
    const float d = fp16_to_f32(dh), dmin = fp16_to_f32(mh);
    for (int j = 0; j < 8; ++j) {
      const float ds = d * (float)sm[16 * j + row], dm = dmin * (float)sm[128 + 16 * j + row];
      for (int l = 0; l < 32; ++l) {
        const float q = (float)L::code(p, j / 2, l / 4, row, l % 4, j % 2);
        acc = std::fma(std::fma(q, ds, -dm), x[32 * j + l], acc);
      }
    }
    return acc;
  }
};
