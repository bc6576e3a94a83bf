// e4m3 -> bf16 by byte tables (AVX512-VBMI): shared by fp8_block's avx512bf16 kernel (fp8_block_bf16.h) and its
// amx kernel (fp8_block_amx.h). Every e4m3 value is a bf16 normal (or zero), so the decode is exact and neither
// vdpbf16ps nor the tile unit (which read bf16 subnormals as zero) ever meets a subnormal weight.
#pragma once
#include "../common.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
namespace fp8dec {

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

}  // namespace fp8dec
}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
