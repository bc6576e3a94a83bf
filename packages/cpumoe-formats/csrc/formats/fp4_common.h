// Shared e2m1 (fp4) helpers for the nvfp4 and ds_fp4 kernels (private header).
//
// Packing (both formats): two e2m1 codes per byte, LOW nibble first: byte j of
// a row holds K element 2j (low nibble) and 2j+1 (high nibble). Code bits
// s e1 e0 m: E2M1 = {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign (8 = -0).
//
// Contents: the prepared fp32 activation layout (nvfp4 native, ds_fp4 scalar), scalar
// and SIMD e2m1 decoders (exact fp32 via pshufb of the fp32 bit pattern; the integer
// 2*E2M1 table for the int8 paths: nvfp4 w4a8, ds_fp4 SIMD), e4m3 / e8m0 scale vector
// decoders, software prefetch, and the work-item loops both formats install.
//
// Prepared fp32 activations ("chunked even/odd layout"):
//   With NL 128-bit lanes per SIMD register (AVX2: NL = 2, AVX-512: NL = 4) the
//   first floor(K / C) * C elements, C = 32 * NL, are stored in chunks of C;
//   inside a chunk, vector V_q (q = 0..3, 4*NL floats) lane L sub-element d
//   (d = 0..3) holds the even element 2j and W_q the odd element 2j+1 of packed
//   byte j = 16 L + 8 (q >> 1) + 2 d + (q & 1) (chunk-local). Chunk order:
//   V0 V1 V2 V3 W0 W1 W2 W3. This is the order in which decode_e2m1 (two pshufb,
//   two in-lane byte unpacks, then shift/and) produces the weights of C / 2 packed
//   bytes, so the hot loop has no cross-lane shuffles. The 8 bytes 16 L + 8 h .. +7
//   (h = q >> 1) form one nvfp4 block. The remaining elements (K % C, a multiple of 16; only nvfp4 has
//   them) are stored per 16-element block as xe[8] then xo[8] (xe[m] = x[2m],
//   xo[m] = x[2m+1]). The scalar tier (NL = 0) stores every block that way.
#pragma once
#include "../rowmajor.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the AVX-512 intrinsics' internal _mm512_undefined_* operands as
// maybe-uninitialized (a false positive of the headers, not of this code).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace fp4 {

#if defined(__AVX512F__)
constexpr int kNL = 4;
#elif defined(__AVX2__)
constexpr int kNL = 2;
#else
constexpr int kNL = 0;
#endif

// Software prefetch of the weight streams: prefetcht0 (locality 3) kPrefetchBytes ahead
// of the packed-code read position, every 64-byte line, and the matching point of the
// (8x / 16x thinner) scale stream. Rows are contiguous, so this runs on into the next
// rows. The hardware streamers stop at 4 KB pages and gate_up reads two row streams;
// prefetchnta or short distances leave DRAM latency exposed (q4_0.cpp). 3 KB: nvfp4 w4a8 reads 86% of the read
// ceiling against 74% at 1 KB (H200 host).
#ifndef CPUMOE_FP4_PF
#define CPUMOE_FP4_PF 3072  // build knob (bench/device/kernel_sweep.sh)
#endif
constexpr int kPrefetchBytes = CPUMOE_FP4_PF;
// For the multi-row (dotr) loops only (nvfp4): bit 1 = down prefetches the next expert group's rows while it runs
// one (a down stream is only half the item's rows, 4 KB for I = 512, shorter than the in-stream distance); bit 2 =
// gate_up starts each item by prefetching the first kPrefetchBytes of both streams. Build knob; 3 (both): nvfp4 w4a8
// batch 1 reads a median 83% of the same-run read ceiling against 72% with 0 (H200 host, 16 threads).
#ifndef CPUMOE_FP4_AHEAD
#define CPUMOE_FP4_AHEAD 3
#endif
CPUMOE_INLINE void prefetch_stream(const uint8_t* p, int lines, const uint8_t* s, int scale_ratio) {
  for (int i = 0; i < lines; ++i) __builtin_prefetch(p + kPrefetchBytes + 64 * i, 0, 3);
  __builtin_prefetch(s + kPrefetchBytes / scale_ratio, 0, 3);
}

// ---- prepared fp32 layout --------------------------------------------------

// Position of element k (0 <= k < K, K % 16 == 0) in the prepared vector.
CPUMOE_INLINE int32_t f32_pos(int32_t k, int32_t K, int NL) {
  const int32_t C = 32 * NL;
  const int32_t main = NL ? K / C * C : 0;
  if (k < main) {
    const int32_t c = k / C, r = k % C, half = r & 1, j = r >> 1;
    const int32_t L = j >> 4, q = ((j >> 2) & 2) | (j & 1), d = (j >> 1) & 3;
    return c * C + half * (16 * NL) + q * (4 * NL) + L * 4 + d;
  }
  const int32_t t = k - main, b = t >> 4, r = t & 15;
  return main + b * 16 + (r & 1) * 8 + (r >> 1);
}

// dst[f32_pos(k)] = v[k] for k < K.
inline void layout_f32(const float* v, int32_t K, int NL, float* dst) {
  const int32_t C = 32 * NL;
  const int32_t main = NL ? K / C * C : 0;
  for (int32_t c0 = 0; c0 < main; c0 += C)
    for (int32_t j = 0; j < C / 2; ++j) {
      const int32_t L = j >> 4, q = ((j >> 2) & 2) | (j & 1), d = (j >> 1) & 3;
      const int32_t o = c0 + q * (4 * NL) + L * 4 + d;
      dst[o] = v[c0 + 2 * j];
      dst[o + 16 * NL] = v[c0 + 2 * j + 1];
    }
  for (int32_t b0 = main; b0 < K; b0 += 16)
    for (int32_t m = 0; m < 8; ++m) {
      dst[b0 + m] = v[b0 + 2 * m];
      dst[b0 + 8 + m] = v[b0 + 2 * m + 1];
    }
}

// ---- scalar ------------------------------------------------------------------
// Integer form of the weights: w = 2 * E2M1 (exact, |w| <= 12). The SIMD integer dots feed
// vpmaddubsw / vpdpbusd the unsigned u = w + 12 (0..24) and subtract 12 * sum(activation).
static constexpr int8_t kW2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int kW2Offset = 12;


// sum over one 16-element block: 8 packed bytes against xe[8], xo[8] (unscaled).
CPUMOE_INLINE float block16_scalar(const uint8_t* p, const float* x) {
  float s = 0.f;
  for (int m = 0; m < 8; ++m) {
    s += kE2M1[p[m] & 15] * x[m];
    s += kE2M1[p[m] >> 4] * x[8 + m];
  }
  return s;
}

// nvfp4 w4a8 activations (nvfp4 and nvfp4_x16 prep), one 16-block: s = amax / 127 (1 if amax = 0), q = clamp(rint(v *
// (1 / s)), +-127) (a NaN from 0 * inf -> 0); a block holding a NaN or an inf gets s = NaN and codes 0 (common.h
// q8_block's rule: its dot products are NaN, as the reference's). The even elements' codes to qe[0..7], the odd
// ones' to qo[0..7]. Returns sum(q); *s_out = s.
CPUMOE_INLINE int32_t quant16(const uint16_t* src, int8_t* qe, int8_t* qo, float* s_out) {
#if defined(__AVX512BW__)  // the same fp32 operations on one 16-lane vector
  const __m256i bits = _mm256_loadu_si256((const __m256i*)src);
  const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  const __m512 av = _mm512_abs_ps(v);
  if (_mm512_cmp_ps_mask(av, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ)) {  // inf or NaN
    std::memset(qe, 0, 8), std::memset(qo, 0, 8);
    *s_out = nonfinite_scale();
    return 0;
  }
  const float amax = _mm512_reduce_max_ps(av);
  const float s = amax == 0.f ? 1.f : amax / 127.f;
  const float inv = 1.f / s;
  __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  t = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(t, t, _CMP_ORD_Q), t);
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
  const __m512i qi = _mm512_cvtps_epi32(t);
  const __m128i eo = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);  // even codes, then odd
  const __m128i b = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(qi), eo);
  _mm_storel_epi64((__m128i*)qe, b);
  _mm_storel_epi64((__m128i*)qo, _mm_unpackhi_epi64(b, b));
  *s_out = s;
  return _mm512_reduce_add_epi32(qi);
#elif defined(__AVX2__)  // the same fp32 operations on two 8-lane vectors (~0.6 ns an element on one Zen 3 core,
                         // the scalar loop ~4.8)
  const __m256 v0 = bf16x8_f32(src), v1 = bf16x8_f32(src + 8);
  const uint32_t amax_bits = hmax8(absmax8(v1, absmax8(v0, _mm256_setzero_si256())));
  if (amax_bits >= kInfBits) {
    std::memset(qe, 0, 8), std::memset(qo, 0, 8);
    *s_out = nonfinite_scale();
    return 0;
  }
  const float amax = bits_f32(amax_bits);
  const float s = amax == 0.f ? 1.f : amax / 127.f;
  const __m256 inv = _mm256_set1_ps(1.f / s);
  auto code = [&](__m256 v) {  // rint (half to even), NaN -> 0, clamp to +-127: exact in fp32, then the integer
    __m256 t = _mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm256_and_ps(t, _mm256_cmp_ps(t, t, _CMP_ORD_Q));
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f)));
  };
  const __m256i q0 = code(v0), q1 = code(v1);
  // the packs work per 128-bit lane: bytes hold elements 0-3, 8-11, 4-7, 12-15; then even codes, then odd
  const __m256i w = _mm256_packs_epi32(q0, q1);
  const __m128i b = _mm_shuffle_epi8(_mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)),
                                     _mm_setr_epi8(0, 2, 8, 10, 4, 6, 12, 14, 1, 3, 9, 11, 5, 7, 13, 15));
  _mm_storel_epi64((__m128i*)qe, b);
  _mm_storel_epi64((__m128i*)qo, _mm_unpackhi_epi64(b, b));
  *s_out = s;
  return hsum8_i32(_mm256_add_epi32(q0, q1));
#else
  float v[16], amax = 0.f;
  bool finite = true;
  for (int i = 0; i < 16; ++i) {
    v[i] = bf16_to_f32(src[i]);
    const float a = std::fabs(v[i]);
    finite &= a <= std::numeric_limits<float>::max();  // false for inf and NaN
    amax = std::fmax(amax, a);
  }
  if (!finite) {
    std::memset(qe, 0, 8), std::memset(qo, 0, 8);
    *s_out = nonfinite_scale();
    return 0;
  }
  const float s = amax == 0.f ? 1.f : amax / 127.f;
  const float inv = 1.f / s;
  auto code = [&](int i) {
    const float t = std::nearbyint(v[i] * inv);                              // round half to even (default mode)
    return (int8_t)(t != t ? 0.f : (t > 127.f ? 127.f : (t < -127.f ? -127.f : t)));  // NaN (0 * inf) -> 0
  };
  // Element pairs, not one loop with a selected destination: GCC 12.2 with -fsanitize=address,undefined compiled
  // `(i & 1 ? qo : qe)[i >> 1] = ...` into a wild store (the even elements' index came from a stack slot written
  // only on the odd path; ci/sanitize.sh asan crashed in test_batch_identity; plain builds were correct).
  int32_t qsum = 0;
  for (int m = 0; m < 8; ++m) {
    qe[m] = code(2 * m), qo[m] = code(2 * m + 1);
    qsum += qe[m] + qo[m];
  }
  *s_out = s;
  return qsum;
#endif
}

// ---- AVX2 -------------------------------------------------------------------
#if defined(__AVX2__)
// Bytes 2 and 3 of the fp32 bit pattern of E2M1[code] (bytes 0 and 1 are zero).
CPUMOE_INLINE __m256i tbl_byte2() {
  return _mm256_setr_epi8(0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0, 0, 0, (char)0x80,
                          (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0, 0, 0, (char)0x80, (char)0xC0, 0, 0x40,
                          (char)0x80, (char)0xC0, 0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0);
}
CPUMOE_INLINE __m256i tbl_byte3() {
  return _mm256_setr_epi8(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xBF, (char)0xBF,
                          (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0, 0, 0x3F, 0x3F, 0x3F, 0x40,
                          0x40, 0x40, 0x40, (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0,
                          (char)0xC0, (char)0xC0);
}

// 32 codes (one per byte, 0..15) -> 4 fp32 vectors, exactly: v[q] lane L sub d
// holds the code of byte 16 L + 8 (q >> 1) + 2 d + (q & 1). The byte unpack gives
// 16-bit upper halves (bf16 patterns); dword d of it holds the pair (2d, 2d+1),
// split into two fp32 vectors by a shift and a mask (no more shuffles).
CPUMOE_INLINE void decode_e2m1(__m256i c, __m256i t2, __m256i t3, __m256& v0, __m256& v1, __m256& v2, __m256& v3) {
  const __m256i b2 = _mm256_shuffle_epi8(t2, c), b3 = _mm256_shuffle_epi8(t3, c);
  const __m256i w01 = _mm256_unpacklo_epi8(b2, b3), w23 = _mm256_unpackhi_epi8(b2, b3);
  const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
  v0 = _mm256_castsi256_ps(_mm256_slli_epi32(w01, 16));
  v1 = _mm256_castsi256_ps(_mm256_and_si256(w01, hi));
  v2 = _mm256_castsi256_ps(_mm256_slli_epi32(w23, 16));
  v3 = _mm256_castsi256_ps(_mm256_and_si256(w23, hi));
}

// 32 packed bytes -> the 8 weight vectors of one 64-element chunk, in the
// prepared-activation order (V0..V3 from the low nibbles, W0..W3 from the high).
struct Chunk8 {
  __m256 v0, v1, v2, v3, w0, w1, w2, w3;
};
CPUMOE_INLINE Chunk8 decode_chunk(const uint8_t* p, __m256i t2, __m256i t3) {
  const __m256i m = _mm256_set1_epi8(0x0F), b = _mm256_loadu_si256((const __m256i*)p);
  Chunk8 r;
  decode_e2m1(_mm256_and_si256(b, m), t2, t3, r.v0, r.v1, r.v2, r.v3);
  decode_e2m1(_mm256_and_si256(_mm256_srli_epi16(b, 4), m), t2, t3, r.w0, r.w1, r.w2, r.w3);
  return r;
}

// One 16-element block (8 packed bytes) against xe[8], xo[8]: per-lane partial sums
// (unscaled) for the K % C tail. vpermps with a table pre-XORed by (index << 28):
// (tbl[c & 7] ^ (c & 7) << 28) ^ (c << 28) leaves E2M1[c & 7] with the sign bit c & 8.
CPUMOE_INLINE __m256 block16_avx2(const uint8_t* p, const float* x) {
  const __m256i tbl = _mm256_setr_epi32(0x00000000, 0x3F000000 ^ (1 << 28), 0x3F800000 ^ (2 << 28),
                                        0x3FC00000 ^ (3 << 28), 0x40000000 ^ (4 << 28), 0x40400000 ^ (5 << 28),
                                        0x40800000 ^ (6 << 28), 0x40C00000 ^ (7 << 28));
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)), h = _mm256_srli_epi32(c, 4);
  const __m256 wl = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_permutevar8x32_epi32(tbl, c), _mm256_slli_epi32(c, 28)));
  const __m256 wh = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_permutevar8x32_epi32(tbl, h), _mm256_slli_epi32(h, 28)));
  return _mm256_fmadd_ps(wh, _mm256_loadu_ps(x + 8), _mm256_mul_ps(wl, _mm256_loadu_ps(x)));
}

// Byte loads that never read past the given count.
CPUMOE_INLINE __m128i load8(const uint8_t* p) { return _mm_loadl_epi64((const __m128i*)p); }
CPUMOE_INLINE __m128i load4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm_cvtsi32_si128(v);
}

// 8 e4m3fn codes (low 8 bytes) -> code / 256, exact for all 256 codes (0x7F/0xFF -> +-480 / 256, subnormals
// m * 2^-17): the code sign-extended and shifted into fp16 (sign to bit 15, exponent+mantissa to bits 7..13, bit 14
// cleared) is an fp16 with bias 15 instead of 7, i.e. the value / 2^8. nvfp4_x16 folds the 2^8 into its global.
CPUMOE_INLINE __m256 e4m3x8_div256(__m128i codes) {
  const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(codes), 7);
  return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16((short)0xBFFF)));
}

// 8 e4m3fn codes (low 8 bytes) -> 8 floats, their exact values (e4m3x8_div256 times 2^8).
CPUMOE_INLINE __m256 e4m3x8(__m128i codes) { return _mm256_mul_ps(e4m3x8_div256(codes), _mm256_set1_ps(256.f)); }

// 16 e4m3fn codes at p -> the fp16 encodings of code / 256 (e4m3x8_div256's operations lane by lane): one widening
// and one shift-mask for 16 codes. nvfp4_x16 widens them to one zmm, or to two halves (below).
CPUMOE_INLINE __m256i e4m3x16_fp16_div256(const uint8_t* p) {
  const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
  return _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBFFF));
}

// 16 e4m3fn codes at p -> e4m3x8_div256 of the first 8 (d[0]) and of the last 8 (d[1]) (nvfp4_x16's one-token pass
// reads both halves' scales).
CPUMOE_INLINE void e4m3x16_div256(const uint8_t* p, __m256* d) {
  const __m256i h = e4m3x16_fp16_div256(p);
  d[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  d[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// 8 e8m0 codes (low 8 bytes) -> 8 floats: 2^(min(s, 254) - 127), s = 0 -> 2^-127 (subnormal), exactly.
CPUMOE_INLINE __m256 e8m0x8(__m128i codes) {
  const __m256i b = _mm256_cvtepu8_epi32(codes);
  const __m256i v = _mm256_slli_epi32(_mm256_min_epu32(b, _mm256_set1_epi32(254)), 23);
  const __m256i z = _mm256_cmpeq_epi32(b, _mm256_setzero_si256());
  return _mm256_castsi256_ps(_mm256_blendv_epi8(v, _mm256_set1_epi32(0x00400000), z));
}

// u = w + kW2Offset per code (see kW2 above).
CPUMOE_INLINE __m256i w2_offset() {
  return _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24, 12,
                          11, 10, 9, 8, 6, 4, 0);
}

// Lane-broadcast patterns: a[i0] in lanes 0..3, a[i1] in lanes 4..7.
CPUMOE_INLINE __m256 bcast2x4(__m256 a, int i0, int i1) {
  return _mm256_permutevar8x32_ps(a, _mm256_setr_epi32(i0, i0, i0, i0, i1, i1, i1, i1));
}
#endif  // __AVX2__

// ---- AVX-512 ------------------------------------------------------------------
#if defined(__AVX512F__)
CPUMOE_INLINE __m512i tbl512(__m256i t) { return _mm512_broadcast_i64x4(t); }

// tbl[nibble] of the low / the high nibble of each of 64 code bytes (tbl: tbl512 of a 16-entry table, so its 4
// copies fill the 64 bytes). With VBMI (the avx512bf16 tier) vpermb takes 6 index bits, and the copies answer
// whatever the 2 bits above the nibble hold: no mask (nvfp4_x16 gate_up at 8 tokens: 197-216 -> 144-195 us, H200
// host, one thread in cache).
CPUMOE_INLINE __m512i nib_lo512(__m512i v, __m512i tbl) {
#if defined(__AVX512VBMI__)
  return _mm512_permutexvar_epi8(v, tbl);
#else
  return _mm512_shuffle_epi8(tbl, _mm512_and_si512(v, _mm512_set1_epi8(0x0F)));
#endif
}
CPUMOE_INLINE __m512i nib_hi512(__m512i v, __m512i tbl) { return nib_lo512(_mm512_srli_epi16(v, 4), tbl); }

// 64 codes (one per byte) -> 4 fp32 vectors: v[q] lane L sub d = byte
// 16 L + 8 (q >> 1) + 2 d + (q & 1), as decode_e2m1.
CPUMOE_INLINE void decode_e2m1_512(__m512i c, __m512i t2, __m512i t3, __m512& v0, __m512& v1, __m512& v2, __m512& v3) {
  const __m512i b2 = _mm512_shuffle_epi8(t2, c), b3 = _mm512_shuffle_epi8(t3, c);
  const __m512i w01 = _mm512_unpacklo_epi8(b2, b3), w23 = _mm512_unpackhi_epi8(b2, b3);
  const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
  v0 = _mm512_castsi512_ps(_mm512_slli_epi32(w01, 16));
  v1 = _mm512_castsi512_ps(_mm512_and_si512(w01, hi));
  v2 = _mm512_castsi512_ps(_mm512_slli_epi32(w23, 16));
  v3 = _mm512_castsi512_ps(_mm512_and_si512(w23, hi));
}

// 64 packed bytes -> the 8 weight vectors of one 128-element chunk.
struct Chunk16 {
  __m512 v0, v1, v2, v3, w0, w1, w2, w3;
};
CPUMOE_INLINE Chunk16 decode_chunk_512(const uint8_t* p, __m512i t2, __m512i t3) {
  const __m512i m = _mm512_set1_epi8(0x0F), b = _mm512_loadu_si512((const void*)p);
  Chunk16 r;
  decode_e2m1_512(_mm512_and_si512(b, m), t2, t3, r.v0, r.v1, r.v2, r.v3);
  decode_e2m1_512(_mm512_and_si512(_mm512_srli_epi16(b, 4), m), t2, t3, r.w0, r.w1, r.w2, r.w3);
  return r;
}

// Lane-broadcast pattern from 8 floats: a[i_L] in lanes 4L..4L+3.
CPUMOE_INLINE __m512 bcast4x4(__m256 a, int i0, int i1, int i2, int i3) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(i0, i0, i0, i0, i1, i1, i1, i1, i2, i2, i2, i2, i3, i3, i3, i3),
                               _mm512_castps256_ps512(a));
}
#endif  // __AVX512F__

// ---- work-item loops ------------------------------------------------------------
// The rowmajor.h loops with the row pointers walked incrementally and the format's row
// dot inlined, so the per-row cost is the dot itself (short rows, e.g. I = 512 down rows
// of 256 bytes, were paying ~40 cycles of pointer math, constant setup and calls).
// Same semantics and same fp32 operations as rowmajor_gate_up / rowmajor_down.
//
// A format's policy D provides:
//   static constexpr int kBanks;                 // banks per pass: packed, scale (, fp16 global)
//   static constexpr bool kRoundGateUp, kRoundRouteTerm;
//   static float dot(const uint8_t* p, const uint8_t* s, float global, int32_t K, const void* act);
// (or the multi-token dotn below instead of dot)
template <int NB>
struct Rows {
  const uint8_t *p, *s, *g;
  int64_t ps, ss, gs;
  CPUMOE_INLINE Rows(const cpumoe_bank* b, int32_t e, int32_t row) {
    p = bank_row<uint8_t>(b[0], e, row), ps = b[0].row_stride;
    s = bank_row<uint8_t>(b[1], e, row), ss = b[1].row_stride;
    g = NB > 2 ? bank_row<uint8_t>(b[NB > 2 ? 2 : 0], e, row) : nullptr, gs = NB > 2 ? b[NB > 2 ? 2 : 0].row_stride : 0;
  }
  CPUMOE_INLINE void next() { p += ps, s += ss, g += gs; }
  CPUMOE_INLINE float global() const {
    if (NB <= 2) return 1.f;
    uint16_t h;
    std::memcpy(&h, g, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);  // exact for every code, subnormals included
#else
    return fp16_to_f32(h);
#endif
  }
};

// Optional multi-token policy (rowmajor.h's MaxNT detects kMaxNT):
//   static constexpr int kMaxNT;
//   template <int NT> static void dotn(const uint8_t* p, const uint8_t* s, float global, int32_t K,
//                                      const void* const* acts, float* out);   // out[t] = dot(.., acts[t])
// decoding each weight chunk once for NT tokens, with every token's arithmetic independent of NT.
template <class D, int NT = MaxNT<D>::value>
CPUMOE_INLINE void fp4_dot_tokens(const uint8_t* p, const uint8_t* s, float gl, int32_t K, int nt,
                                  const void* const* acts, float* out) {
  if constexpr (NT == 1) {
    (void)nt;
    if constexpr (MaxNT<D>::has_dotn)
      D::template dotn<1>(p, s, gl, K, acts, out);
    else
      out[0] = D::dot(p, s, gl, K, acts[0]);
  } else {
    if (nt == NT)
      D::template dotn<NT>(p, s, gl, K, acts, out);
    else
      fp4_dot_tokens<D, NT - 1>(p, s, gl, K, nt, acts, out);
  }
}

// Optional multi-row policy (single token): kRowsGateUp (2: a gate row and its up row together), kRowsDown (2:
// down rows h and h + half of the work item together) and
//   template <int R> static void dotr(const uint8_t* const* p, const uint8_t* const* s, const float* global,
//                                     int32_t K, const void* act, float* out);   // out[r] = dot(row r, act)
// with each row's arithmetic exactly that of dot (so a row's result does not depend on R).
template <class D, class = void>
struct MultiRow {
  static constexpr int gate_up = 1, down = 1;
};
template <class D>
struct MultiRow<D, std::void_t<decltype(D::kRowsGateUp)>> {
  static constexpr int gate_up = D::kRowsGateUp, down = D::kRowsDown;
};

template <class D>
void fp4_gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
                 const void* const* xs, const float* w_in, uint16_t* const* g) {
  constexpr int NT = MaxNT<D>::value;
  const cpumoe_params& P = k->params;
  ActSink sink(P);  // g in SIMD lanes (common.h)
  if (MaxNT<D>::has_dotn && n > NT) {  // several token blocks: row chunks (rowmajor.h)
    gate_up_row_chunks<NT>(
        i0, i1, P.inter, n,
        [&](int32_t row, int32_t j0, int nt, float* out) {
          const Rows<D::kBanks> r(banks, e, row);
          fp4_dot_tokens<D>(r.p, r.s, r.global(), P.hidden, nt, xs + j0, out);
        },
        gate_up_put<D::kRoundGateUp>(sink, g, w_in));
    return;
  }
  Rows<D::kBanks> rg(banks, e, i0), ru(banks, e, P.inter + i0);
  for (int32_t i = i0; i < i1; ++i, rg.next(), ru.next()) {
    const float sg = rg.global(), su = ru.global();
    if constexpr (MultiRow<D>::gate_up == 2) {
      if ((n == 1 || !MaxNT<D>::has_dotn)) {  // a token's gate and up rows in one call
        if (CPUMOE_FP4_AHEAD & 2 && i == i0) {
          const int64_t w = std::min<int64_t>(kPrefetchBytes, (int64_t)(i1 - i0) * rg.ps);
          prefetch_span(rg.p, w), prefetch_span(ru.p, w);
        }
        const uint8_t* pp[2] = {rg.p, ru.p};
        const uint8_t* ss[2] = {rg.s, ru.s};
        const float gg[2] = {sg, su};
        for (int32_t j = 0; j < n; ++j) {
          float gu[2];
          D::template dotr<2>(pp, ss, gg, P.hidden, xs[j], gu);
          float gt = gu[0] * w_in[j], ut = gu[1] * w_in[j];
          if (D::kRoundGateUp) gt = round_bf16(gt), ut = round_bf16(ut);
          sink.put(&g[j][i], gt, ut);
        }
        continue;
      }
    }
    for (int32_t j0 = 0; j0 < n; j0 += NT) {  // token blocks: a row chunk is decoded once per block
      const int nt = n - j0 < NT ? n - j0 : NT;
      float gate[NT], up[NT];
      fp4_dot_tokens<D>(rg.p, rg.s, sg, P.hidden, nt, xs + j0, gate);
      fp4_dot_tokens<D>(ru.p, ru.s, su, P.hidden, nt, xs + j0, up);
      for (int t = 0; t < nt; ++t) {
        float gt = gate[t] * w_in[j0 + t], ut = up[t] * w_in[j0 + t];
        if (D::kRoundGateUp) gt = round_bf16(gt), ut = round_bf16(ut);
        sink.put(&g[j0 + t][i], gt, ut);
      }
    }
  }
}

template <class D>
void fp4_down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
              int32_t n, float* acc, int64_t acc_stride) {
  constexpr int NT = MaxNT<D>::value;
  const int32_t I = k->params.inter;
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    Rows<D::kBanks> r(banks + D::kBanks, routes[a].expert, h0);
    int32_t h = h0;
    if constexpr (MultiRow<D>::down == 2) {
      if ((b - a == 1 || !MaxNT<D>::has_dotn)) {
        // row h with row h + half: two weight streams far apart (on the Zen 3 dev VM adjacent row pairs streamed
        // no faster than single rows, far-apart ones did), each route of the group in turn
        const int32_t half = (h1 - h0) / 2;
        Rows<D::kBanks> r2(banks + D::kBanks, routes[a].expert, h0 + half);
        const uint8_t *n1 = nullptr, *n2 = nullptr, *m1 = nullptr, *m2 = nullptr;  // the next group's rows h, h + half
        if (CPUMOE_FP4_AHEAD & 1) {
          if (a == 0)  // the first group has no predecessor to fetch it
            prefetch_span(r.p, half * r.ps), prefetch_span(r2.p, half * r.ps);
          if (b < n) {
            const Rows<D::kBanks> x1(banks + D::kBanks, routes[b].expert, h0), x2(banks + D::kBanks, routes[b].expert, h0 + half);
            n1 = x1.p, n2 = x2.p, m1 = x1.s, m2 = x2.s;
          }
        }
        for (; h < h0 + half; ++h, r.next(), r2.next()) {
          if (CPUMOE_FP4_AHEAD & 1 && n1) {
            prefetch_span(n1, r.ps), prefetch_span(n2, r.ps);
            __builtin_prefetch(m1, 0, 3), __builtin_prefetch(m2, 0, 3);
            n1 += r.ps, n2 += r.ps, m1 += r.ss, m2 += r.ss;
          }
          const uint8_t* pp[2] = {r.p, r2.p};
          const uint8_t* ss[2] = {r.s, r2.s};
          const float gg[2] = {r.global(), r2.global()};
          for (int32_t q = a; q < b; ++q) {
            float y[2];
            D::template dotr<2>(pp, ss, gg, I, routes[q].act, y);
            float* o = acc + routes[q].token * acc_stride + (h - h0);
            float v0 = y[0] * routes[q].weight, v1 = y[1] * routes[q].weight;
            if (D::kRoundRouteTerm) v0 = round_bf16(v0), v1 = round_bf16(v1);
            o[0] += v0;
            o[half] += v1;
          }
        }
        h = h0 + 2 * half;  // at most one row left
        r = Rows<D::kBanks>(banks + D::kBanks, routes[a].expert, h);
      }
    }
    for (; h < h1; ++h, r.next()) {
      const float gl = r.global();
      for (int32_t q0 = a; q0 < b; q0 += NT) {  // route blocks of the expert group
        const int nt = b - q0 < NT ? b - q0 : NT;
        const void* acts[NT];
        float y[NT];
        for (int t = 0; t < nt; ++t) acts[t] = routes[q0 + t].act;
        fp4_dot_tokens<D>(r.p, r.s, gl, I, nt, acts, y);
        for (int t = 0; t < nt; ++t) {
          float v = y[t] * routes[q0 + t].weight;
          if (D::kRoundRouteTerm) v = round_bf16(v);
          acc[routes[q0 + t].token * acc_stride + (h - h0)] += v;
        }
      }
    }
    a = b;
  }
}

template <class D>
void install_fp4(cpumoe_kernel* k) {
  k->gate_up = &fp4_gate_up<D>;
  k->down = &fp4_down<D>;
}

}  // namespace fp4
}  // namespace CPUMOE_NS
}  // namespace cpumoe
