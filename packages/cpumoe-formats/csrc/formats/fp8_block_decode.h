// e4m3 decodes shared by the fp8_block kernels and fp8_block_x16's:
// - fp16_decode4 / bf16p_decode4 (AVX2 / AVX-512BW): e4m3 * 2^-8 / e4m3 * 2^-120 in fp32, fp8_block's avx512f /
//   avx2 decodes (CPUMOE_FP8_FP16) and fp8_block_x16's avx512f / avx2 ones (which multiply by 2^8 / 2^120 back);
// - Decoder (AVX512-VBMI): e4m3 -> bf16 by byte tables, fp8_block's avx512bf16 kernel (fp8_block_bf16.h), its amx
//   kernel (fp8_block_amx.h) and fp8_block_x16's avx512bf16 / amx ones. Every e4m3 value is a bf16 normal (or
//   zero), so the decode is exact and neither vdpbf16ps nor the tile unit (which read bf16 subnormals as zero)
//   ever meets a subnormal weight.
#pragma once
#include "../common.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
namespace fp8dec {

// Two decodes of e4m3 codes in 16-bit lanes (odd << 8 | even) into 4 fp32 vectors, exact for all 256 codes:
//
// fp16_decode4, e4m3 * 2^-8: for every code b, (b & 0x80) << 8 | (b & 0x7F) << 7 is the fp16 encoding of
//   e4m3(b) * 2^-8 (exponent field E -> fp16 field E, bias 15 = 7 + 8; E = 0: the fp16 subnormal m 2^-17 =
//   2^-8 m 2^-9; 0x7F -> 1.875 = 480 / 2^8); srai(1) & 0xBF80 builds the odd code's, slli(8) first the even
//   one's, and vcvtph2ps widens them exactly (fp16 subnormals in hardware). v[0] = the even codes of w's low
//   half (128 / 256 bits), v[1] of its high half, v[2], v[3] the odd codes likewise.
// bf16p_decode4, e4m3 * 2^-120: for every code b, (b & 0x80) << 8 | (b & 0x7F) << 4 is the bf16 encoding of
//   e4m3(b) * 2^-120 (normals get exponent field E; E = 0 gives the fp32 subnormal m 2^-129 = m 2^-9 2^-120;
//   0x7F gives 480 * 2^-120); srai(4) & 0x87F0 builds the odd code's, slli(8) first the even one's, and in each
//   32-bit lane the low pattern becomes fp32 by << 16, the high one by & 0xFFFF0000: 9 integer operations, no
//   conversion. v[0..3] = the codes at bytes 0, 1, 2, 3 of each 32-bit lane. The subnormal codes give fp32
//   subnormals, which must be read as such (no DAZ): free on AMD Zen, an FP assist on some Intel cores.
#if defined(__AVX2__) && defined(__F16C__)
CPUMOE_INLINE void fp16_decode4(__m256i w, __m256* v) {
  const __m256i m = _mm256_set1_epi16((short)0xBF80);
  const __m256i od = _mm256_and_si256(_mm256_srai_epi16(w, 1), m);
  const __m256i ev = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), m);
  v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(ev)), v[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(ev, 1));
  v[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(od)), v[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(od, 1));
}
CPUMOE_INLINE void bf16p_decode4(__m256i w, __m256* v) {
  const __m256i m = _mm256_set1_epi16((short)0x87F0), hi = _mm256_set1_epi32((int)0xFFFF0000u);
  const __m256i o = _mm256_and_si256(_mm256_srai_epi16(w, 4), m);
  const __m256i e = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 4), m);
  v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(e, 16)), v[1] = _mm256_castsi256_ps(_mm256_slli_epi32(o, 16));
  v[2] = _mm256_castsi256_ps(_mm256_and_si256(e, hi)), v[3] = _mm256_castsi256_ps(_mm256_and_si256(o, hi));
}
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
CPUMOE_INLINE void fp16_decode4(__m512i w, __m512* v) {
  const __m512i m = _mm512_set1_epi16((short)0xBF80);
  const __m512i od = _mm512_and_si512(_mm512_srai_epi16(w, 1), m);
  const __m512i ev = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 1), m);
  v[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(ev)), v[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(ev, 1));
  v[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(od)), v[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(od, 1));
}
CPUMOE_INLINE void bf16p_decode4(__m512i w, __m512* v) {
  const __m512i m = _mm512_set1_epi16((short)0x87F0), hi = _mm512_set1_epi32((int)0xFFFF0000u);
  const __m512i o = _mm512_and_si512(_mm512_srai_epi16(w, 4), m);
  const __m512i e = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 4), m);
  v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(e, 16)), v[1] = _mm512_castsi512_ps(_mm512_slli_epi32(o, 16));
  v[2] = _mm512_castsi512_ps(_mm512_and_si512(e, hi)), v[3] = _mm512_castsi512_ps(_mm512_and_si512(o, hi));
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX512BF16 || CPUMOE_TIER == CPUMOE_T_AMX  // (AVX512-VBMI)

// The bf16 bits of |e4m3(c)| for the 7-bit codes c = 0..127, split into low and high bytes (the two 128-byte
// tables of the vpermt2b decode below). Non-zero exponent field: ((c << 4) & 0x7F0) + (120 << 7), the exponent
// and mantissa shifted into place and rebiased (0x7F: 0x43F0 = 480); exponent field 0: m * 2^-9, bf16 normals.
struct DecodeTables {
  alignas(64) uint8_t lo[128], hi[128];
  constexpr DecodeTables() : lo(), hi() {
    constexpr uint16_t kSub[8] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
    for (int c = 0; c < 128; ++c) {
      const uint16_t v = c >> 3 ? (uint16_t)(((c << 4) & 0x7F0) + (120 << 7)) : kSub[c];
      lo[c] = (uint8_t)(v & 0xFF), hi[c] = (uint8_t)(v >> 8);
    }
  }
};
constexpr DecodeTables kTables{};

// n codes of one row (0 < n; the first min(n, 64)) -> two vectors of 32 bf16: codes 0..31 and 32..63 in order
// (zero past n; nothing past n is read), each e4m3 exactly. The low and the high byte of each bf16 come from the
// code's low 7 bits (vpermt2b, 128 entries), the sign goes into the high byte, and the bytes are interleaved into
// words. vpunpck{l,h}bw interleave within 128-bit lanes, so the codes are first permuted (vpermb) so that the low
// unpack yields codes 0..31 and the high one 32..63. ~7 vector ops per 64 codes; the tables and constants stay in
// registers for a whole work item (one Decoder per call).
struct Decoder {
  const __m512i lo0 = _mm512_load_si512(kTables.lo), lo1 = _mm512_load_si512(kTables.lo + 64);
  const __m512i hi0 = _mm512_load_si512(kTables.hi), hi1 = _mm512_load_si512(kTables.hi + 64);
  const __m512i sign = _mm512_set1_epi8((char)0x80);
  // byte 16L + j <- code 8L + j, byte 16L + 8 + j <- code 32 + 8L + j (L = 128-bit lane, j < 8)
  const __m512i perm = _mm512_set_epi64(0x3F3E3D3C3B3A3938ll, 0x1F1E1D1C1B1A1918ll, 0x3736353433323130ll,
                                        0x1716151413121110ll, 0x2F2E2D2C2B2A2928ll, 0x0F0E0D0C0B0A0908ll,
                                        0x2726252423222120ll, 0x0706050403020100ll);
  CPUMOE_INLINE void decode(const uint8_t* src, int n, __m512i& w0, __m512i& w1) const {
    const __m512i raw = n >= 64 ? _mm512_loadu_si512(src)
                                : _mm512_maskz_loadu_epi8((uint64_t)((1ull << n) - 1ull), src);  // zero codes: +0
    const __m512i b = _mm512_permutexvar_epi8(perm, raw);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, b, lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, b, hi1), b, sign,
                                                 0xF8);  // hi | (b & 0x80): the sign
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
  }
};
#endif

}  // namespace fp8dec
}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
