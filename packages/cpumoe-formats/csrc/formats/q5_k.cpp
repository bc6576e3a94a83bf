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
//    same exact integer in the three, so they are bit-identical (tests/test_q5_k.py).
//  native (W5A16): fp32 activations, the weights as gguf dequantizes them, fma(q, d sc, -(dmin m)) (d q sc exact,
//    one rounding), fp32 FMAs. Tiers: scalar, avx2, avx512f.
#include "gguf_rows.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace gguf;

constexpr int QK = 256, QB = 176, QH = 16, QS = 48;  // QH, QS: byte offsets of qh and qs in a block
#if defined(__clang__)
#define Q5K_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define Q5K_UNROLL _Pragma("GCC unroll 8")
#else
#define Q5K_UNROLL
#endif

// The eight 6-bit scales (bytes 0..7 of *sc) and mins (*m) of the 12 packed bytes at s (q4_k's packing).
CPUMOE_INLINE void scales_mins(const uint8_t* s, uint64_t* sc, uint64_t* m) {
  const uint32_t a = ld32(s), b = ld32(s + 4), c = ld32(s + 8);
  const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);  // (a >> 6) << 4 per byte
  const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
  *sc = (uint64_t)(a & 0x3F3F3F3Fu) | (uint64_t)sc_hi << 32;
  *m = (uint64_t)(b & 0x3F3F3F3Fu) | (uint64_t)m_hi << 32;
}

#if CPUMOE_TIER == CPUMOE_T_SCALAR
// Code of element 32j + l of the block at p, 0..31.
CPUMOE_INLINE int code(const uint8_t* p, int j, int l) {
  return ((p[QS + 32 * (j / 2) + l] >> 4 * (j & 1)) & 15) | ((p[QH + l] >> j) & 1) << 4;
}
struct RowsW4A8 {
  static constexpr int kGrid = 4, kRowsDown = 2;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) {
        const ActI8<QK> a(act[t], K);
        float acc = 0.0f;
        for (int b = 0; b < K / QK; ++b) {
          const uint8_t* p = w[r] + (size_t)b * QB;
          uint64_t sc, m;
          scales_mins(p + 4, &sc, &m);
          const int8_t* qa = a.q + (size_t)b * QK;
          const int16_t* bs = a.bsum + (size_t)b * 16;
          int32_t S = 0, M = 0;
          for (int j = 0; j < 8; ++j) {
            int32_t s = 0;
            for (int l = 0; l < 32; ++l) s += code(p, j, l) * qa[32 * j + l];
            S += (int32_t)(sc >> 8 * j & 63) * s;
            M += (int32_t)(m >> 8 * j & 63) * (bs[2 * j] + bs[2 * j + 1]);
          }
          const float da = a.d[(size_t)b];
          acc += (float)S * (fp16_to_f32(ld16(p)) * da);
          acc += (float)M * -(fp16_to_f32(ld16(p + 2)) * da);
        }
        out[r * NT + t] = acc;
      }
  }
};
struct RowsNative {
  static constexpr int kGrid = 4, kRowsDown = 2;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) {
        const float* x = (const float*)act[t];
        float acc = 0.0f;
        for (int b = 0; b < K / QK; ++b) {
          const uint8_t* p = w[r] + (size_t)b * QB;
          uint64_t sc, m;
          scales_mins(p + 4, &sc, &m);
          const float d = fp16_to_f32(ld16(p)), dmin = fp16_to_f32(ld16(p + 2));
          for (int j = 0; j < 8; ++j) {
            const float ds = d * (float)(sc >> 8 * j & 63), dm = dmin * (float)(m >> 8 * j & 63);
            for (int l = 0; l < 32; ++l)
              acc = std::fma(std::fma((float)code(p, j, l), ds, -dm), x[(size_t)b * QK + 32 * j + l], acc);
          }
        }
        out[r * NT + t] = acc;
      }
  }
};
#endif

#if defined(__AVX2__)
// q4_k's scales_mins_x: the 12 packed bytes at s -> bytes 0..7 sc[0..7], bytes 8..15 m[0..7] of an xmm. Reads 16
// bytes from s (the 12, then 4 of the block's qh).
CPUMOE_INLINE __m128i scales_mins_x(const uint8_t* s) {
  const __m128i x = _mm_loadu_si128((const __m128i*)s);               // a b c .
  const __m128i t = _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 2, 2));    // c c a b
  const __m128i v = _mm_and_si128(_mm_srlv_epi32(t, _mm_setr_epi32(0, 4, 2, 2)),
                                  _mm_setr_epi32(0x0F0F0F0F, 0x0F0F0F0F, 0x30303030, 0x30303030));
  const __m128i hi = _mm_or_si128(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 2)));  // sc[4..7], m[4..7]
  const __m128i lo = _mm_and_si128(x, _mm_set1_epi8(0x3F));                          // sc[0..3], m[0..3]
  return _mm_unpacklo_epi32(lo, hi);  // sc[0..3] sc[4..7] m[0..3] m[4..7]
}
// Bit j of every byte of qh moved to bit 4, the other bits 0 (16-bit shifts by |4 - j| < 8: bit 4 of each byte
// comes from bit j of the same byte).
template <int J>
CPUMOE_INLINE __m256i fifth_bits(__m256i qh) {
  const __m256i sh = J <= 4 ? _mm256_slli_epi16(qh, 4 - J) : _mm256_srli_epi16(qh, J - 4);
  return _mm256_and_si256(sh, _mm256_set1_epi8(0x10));
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
// s + the int16 pairs p times the broadcast int16 scale sc: int32 lanes, exact (|p| <= 7874, sc <= 63)
CPUMOE_INLINE __m256i madd_acc(__m256i s, __m256i p, __m256i sc) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
  return _mm256_dpwssd_avx_epi32(s, p, sc);
#elif CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  return _mm256_dpwssd_epi32(s, p, sc);
#else
  return _mm256_add_epi32(s, _mm256_madd_epi16(p, sc));
#endif
}
// int16 lanes 2j, 2j+1 (bytes 4j .. 4j+3) of every 128-bit lane: shuffle indices that broadcast int16 element j
CPUMOE_INLINE __m256i bcast16(__m256i v, int j) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
}

// q4_k's row dot with the fifth bits or'ed into the codes: R rows x NT tokens; per (row, token) one 8-lane fp32
// accumulator and per block 8 int32 lanes of S (lane l: sum_j sc[j] (products of elements 4l .. 4l+3 of each
// 32-run j), the same integers in every tier); acc += S (d d_a), acc += M (-(dmin d_a)), M = m[j] (bsum[2j] +
// bsum[2j+1]) in lane j.
struct RowsW4A8 {
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  static constexpr int kGrid = 8;  // zmm / ymm16-31 hold the extra accumulators
#else
  static constexpr int kGrid = 4;
#endif
  static constexpr int kRowsDown = 4;
  // sub-blocks 2C, 2C + 1 (qs[32C ..]) of the block at p against NT tokens, into S
  template <int C, int NT>
  static CPUMOE_INLINE void pair(const uint8_t* p, __m256i qh, __m256i scv, int b, const int8_t* const* qa,
                                 __m256i (&S)[NT]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + QS + 32 * C));
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, m4), fifth_bits<2 * C>(qh));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), fifth_bits<2 * C + 1>(qh));
    const __m256i sa = bcast16(scv, 2 * C), sb = bcast16(scv, 2 * C + 1);
    Q5K_UNROLL
    for (int t = 0; t < NT; ++t) {
      const int8_t* q = qa[t] + (size_t)b * QK + 64 * C;
      S[t] = madd_acc(S[t], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)q)), sa);
      S[t] = madd_acc(S[t], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(q + 32))), sb);
    }
  }
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    const int nb = K / QK;
    const int8_t* qa[NT];
    const float* da[NT];
    const int16_t* bs[NT];
    Q5K_UNROLL
    for (int t = 0; t < NT; ++t) {
      const ActI8<QK> a(act[t], K);
      qa[t] = a.q, da[t] = a.d, bs[t] = a.bsum;
    }
    __m256 acc[R][NT];
    Q5K_UNROLL
    for (int r = 0; r < R; ++r)
      Q5K_UNROLL
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b)
      Q5K_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p, 3);  // 176 bytes a block
        const __m256i s16 = _mm256_cvtepu8_epi16(scales_mins_x(p + 4));  // int16 sc[0..7], m[0..7]
        const __m256i scv = _mm256_permute2x128_si256(s16, s16, 0x00);                   // sc[0..7] in both lanes
        const __m256i mw = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(s16, 1));     // m[j] in int32 lane j
        const __m256i mins = _mm256_or_si256(mw, _mm256_slli_epi32(mw, 16));            // int16 lanes 2j, 2j+1
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(p + QH));
        __m256i S[NT];
        Q5K_UNROLL
        for (int t = 0; t < NT; ++t) S[t] = _mm256_setzero_si256();
        pair<0, NT>(p, qh, scv, b, qa, S);
        pair<1, NT>(p, qh, scv, b, qa, S);
        pair<2, NT>(p, qh, scv, b, qa, S);
        pair<3, NT>(p, qh, scv, b, qa, S);
        const float d = _cvtsh_ss(ld16(p)), dmin = _cvtsh_ss(ld16(p + 2));
        Q5K_UNROLL
        for (int t = 0; t < NT; ++t) {
          const __m256i M = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(bs[t] + (size_t)b * 16)), mins);
          const float dd = da[t][b];
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[t]), _mm256_set1_ps(d * dd), acc[r][t]);
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(-(dmin * dd)), acc[r][t]);
        }
      }
    Q5K_UNROLL
    for (int r = 0; r < R; ++r)
      Q5K_UNROLL
      for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum256(acc[r][t]);
  }
};
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
// native: per (row, token) one fp32 accumulator of the tier's width; the weights decoded per element by
// fma(q, d sc[j], -(dmin m[j])) (gguf's value), then FMA'd with x.
struct RowsNative {
  // the codes (bytes, 0..31) of run j from its qs bytes and qh bytes (the same elements, byte for byte)
  static CPUMOE_INLINE __m128i codes_x(__m128i qs, __m128i qh, int j) {
    const __m128i n = _mm_and_si128(_mm_srli_epi16(qs, 4 * (j & 1)), _mm_set1_epi8(15));
    const __m128i h = _mm_and_si128(_mm_srli_epi16(qh, j), _mm_set1_epi8(1));
    return _mm_or_si128(n, _mm_slli_epi16(h, 4));  // h is 0 / 1 per byte: the shift stays in its byte
  }
#if CPUMOE_TIER == CPUMOE_T_AVX512F
  using F = __m512;
  static constexpr int kW = 16, kGrid = 8;
  // the codes of elements l0 .. l0+15 of run j: qs bytes at qs, qh bytes at qh (l0 .. l0+7 on avx2)
  static CPUMOE_INLINE F codes(const uint8_t* qs, const uint8_t* qh, int j) {
    const __m128i c = codes_x(_mm_loadu_si128((const __m128i*)qs), _mm_loadu_si128((const __m128i*)qh), j);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c));
  }
  static CPUMOE_INLINE F ld(const float* x) { return _mm512_loadu_ps(x); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE F set1(float v) { return _mm512_set1_ps(v); }
  static CPUMOE_INLINE F zero() { return _mm512_setzero_ps(); }
  static CPUMOE_INLINE float hsum(F v) { return hsum512(v); }
#else
  using F = __m256;
  static constexpr int kW = 8, kGrid = 4;
  static CPUMOE_INLINE F codes(const uint8_t* qs, const uint8_t* qh, int j) {
    const __m128i c = codes_x(_mm_loadl_epi64((const __m128i*)qs), _mm_loadl_epi64((const __m128i*)qh), j);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
  }
  static CPUMOE_INLINE F ld(const float* x) { return _mm256_loadu_ps(x); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static CPUMOE_INLINE F zero() { return _mm256_setzero_ps(); }
  static CPUMOE_INLINE float hsum(F v) { return hsum256(v); }
#endif
  static constexpr int kRowsDown = 2;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    const int nb = K / QK;
    F acc[R][NT];
    Q5K_UNROLL
    for (int r = 0; r < R; ++r)
      Q5K_UNROLL
      for (int t = 0; t < NT; ++t) acc[r][t] = zero();
    for (int b = 0; b < nb; ++b)
      Q5K_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p, 3);
        uint64_t sc, m;
        scales_mins(p + 4, &sc, &m);
        const float d = _cvtsh_ss(ld16(p)), dmin = _cvtsh_ss(ld16(p + 2));
        for (int j = 0; j < 8; ++j) {
          const F ds = set1(d * (float)(sc >> 8 * j & 63)), ndm = set1(-(dmin * (float)(m >> 8 * j & 63)));
          const uint8_t* qs = p + QS + 32 * (j / 2);
          Q5K_UNROLL
          for (int i = 0; i < 32 / kW; ++i) {
            const F wv = fma(codes(qs + i * kW, p + QH + i * kW, j), ds, ndm);
            Q5K_UNROLL
            for (int t = 0; t < NT; ++t)
              acc[r][t] = fma(wv, ld((const float*)act[t] + (size_t)b * QK + 32 * j + i * kW), acc[r][t]);
          }
        }
      }
    Q5K_UNROLL
    for (int r = 0; r < R; ++r)
      Q5K_UNROLL
      for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum(acc[r][t]);
  }
};
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(q5_k)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  const bool w4a8 = k->params.mode == CPUMOE_MODE_W4A8;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2
  if (w4a8) {
    k->act_bytes = &gguf::act_bytes_i8<256>;
    k->prep_act = &gguf::prep_act_i8<256>;
    gguf::install<RowsW4A8>(k);
  } else {
    k->act_bytes = &act_bytes_f32;
    k->prep_act = &prep_act_f32;
    gguf::install<RowsNative>(k);
  }
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  if (!w4a8) return false;  // native has no int8 work: the tier below runs (avx2 / avx512f)
  k->act_bytes = &gguf::act_bytes_i8<256>;
  k->prep_act = &gguf::prep_act_i8<256>;
  gguf::install<RowsW4A8>(k);
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AVX512F
  if (w4a8) return false;  // w4a8 without VNNI: avxvnni (if the CPU has it) or avx2 runs
  k->act_bytes = &act_bytes_f32;
  k->prep_act = &prep_act_f32;
  gguf::install<RowsNative>(k);
  return true;
#else
  (void)k;
  (void)w4a8;
  return false;  // avx512bf16 / amx: nothing specific; avx512vnni (w4a8) / avx512f (native) run
#endif
}
