// Arithmetic peak loops (ABI 1.6): the compute roof next to read_sum's memory roof. Each loop runs `iters` rounds
// of 12 (ymm) or 24 (zmm) independent chains of one tier's widest multiply-add instruction and returns the multiply-adds done, so a
// caller timing it on every core gets the machine's multiply-adds per second for that instruction alone. That is
// an upper bound for any kernel of the tier (no decode, no fold, no loads): a step that needs more multiply-adds per
// second than it cannot run at that speed on this machine, whatever the layout (docs/bench-executor.md, "compute
// floor").
//
// The chains cover latency x ports of every instruction here (vpdpbusd: 5 cycles x 2 ports = 10): 12 of the 16
// ymm registers, 24 of the 32 zmm ones (vdpbf16ps read 31.6 G/s on one Sapphire Rapids core with 12). The integer
// loops without an accumulating instruction (vpmaddubsw) feed each result back as the next u8 operand, so no
// compiler can hoist the product out of the loop; the others accumulate. The fp32 and bf16 operands keep the
// accumulators far from subnormals and infinities (no microcode assists).
#include <cstdint>
#include <cstring>

#include "registry.h"
#include "tiers.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace cpumoe {
namespace {
#define CPUMOE_REP12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define CPUMOE_REP24(X) CPUMOE_REP12(X) X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)

// The loop's accumulators are summed into a sink the optimizer cannot drop.
volatile uint64_t g_peak_sink;

template <class V>
void sink(const V* v, int n) {
  uint64_t s = 0;
  for (int i = 0; i < n; ++i) {
    uint64_t w;
    std::memcpy(&w, &v[i], sizeof w);
    s += w;
  }
  g_peak_sink += s;
}

#if defined(CPUMOE_BUILT_avx2)
__attribute__((target("avx2,fma"))) uint64_t fma256(uint64_t iters) {
  const __m256 a = _mm256_set1_ps(1e-3f), b = _mm256_set1_ps(1e-3f);
#define D(i) __m256 c##i = _mm256_set1_ps(1.f + i);
  CPUMOE_REP12(D)
#undef D
  for (uint64_t n = 0; n < iters; ++n) {
#define D(i) c##i = _mm256_fmadd_ps(a, b, c##i);
    CPUMOE_REP12(D)
#undef D
  }
#define D(i) c##i,
  const __m256 all[12] = {CPUMOE_REP12(D)};
#undef D
  sink(all, 12);
  return iters * 12 * 8;
}
__attribute__((target("avx2"))) uint64_t maddubs256(uint64_t iters) {
  const __m256i b = _mm256_set1_epi8(3);
#define D(i) __m256i c##i = _mm256_set1_epi8((char)(1 + i));
  CPUMOE_REP12(D)
#undef D
  for (uint64_t n = 0; n < iters; ++n) {
#define D(i) c##i = _mm256_maddubs_epi16(c##i, b);
    CPUMOE_REP12(D)
#undef D
  }
#define D(i) c##i,
  const __m256i all[12] = {CPUMOE_REP12(D)};
#undef D
  sink(all, 12);
  return iters * 12 * 32;
}
#endif
#if defined(CPUMOE_BUILT_avxvnni)
__attribute__((target("avx2,avxvnni"))) uint64_t dpbusd256(uint64_t iters) {
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
#define D(i) __m256i c##i = _mm256_set1_epi32(i);
  CPUMOE_REP12(D)
#undef D
  for (uint64_t n = 0; n < iters; ++n) {
#define D(i) c##i = _mm256_dpbusd_avx_epi32(c##i, a, b);
    CPUMOE_REP12(D)
#undef D
  }
#define D(i) c##i,
  const __m256i all[12] = {CPUMOE_REP12(D)};
#undef D
  sink(all, 12);
  return iters * 12 * 32;
}
#endif
#if defined(CPUMOE_BUILT_avx512f)
__attribute__((target("avx512f"))) uint64_t fma512(uint64_t iters) {
  const __m512 a = _mm512_set1_ps(1e-3f), b = _mm512_set1_ps(1e-3f);
#define D(i) __m512 c##i = _mm512_set1_ps(1.f + i);
  CPUMOE_REP24(D)
#undef D
  for (uint64_t n = 0; n < iters; ++n) {
#define D(i) c##i = _mm512_fmadd_ps(a, b, c##i);
    CPUMOE_REP24(D)
#undef D
  }
#define D(i) c##i,
  const __m512 all[24] = {CPUMOE_REP24(D)};
#undef D
  sink(all, 24);
  return iters * 24 * 16;
}
__attribute__((target("avx512f,avx512bw"))) uint64_t maddubs512(uint64_t iters) {
  const __m512i b = _mm512_set1_epi8(3);
#define D(i) __m512i c##i = _mm512_set1_epi8((char)(1 + i));
  CPUMOE_REP24(D)
#undef D
  for (uint64_t n = 0; n < iters; ++n) {
#define D(i) c##i = _mm512_maddubs_epi16(c##i, b);
    CPUMOE_REP24(D)
#undef D
  }
#define D(i) c##i,
  const __m512i all[24] = {CPUMOE_REP24(D)};
#undef D
  sink(all, 24);
  return iters * 24 * 64;
}
#endif
#if defined(CPUMOE_BUILT_avx512vnni)
__attribute__((target("avx512f,avx512vnni"))) uint64_t dpbusd512(uint64_t iters) {
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
#define D(i) __m512i c##i = _mm512_set1_epi32(i);
  CPUMOE_REP24(D)
#undef D
  for (uint64_t n = 0; n < iters; ++n) {
#define D(i) c##i = _mm512_dpbusd_epi32(c##i, a, b);
    CPUMOE_REP24(D)
#undef D
  }
#define D(i) c##i,
  const __m512i all[24] = {CPUMOE_REP24(D)};
#undef D
  sink(all, 24);
  return iters * 24 * 64;
}
#endif
#if defined(CPUMOE_BUILT_avx512bf16)
__attribute__((target("avx512f,avx512bf16"))) uint64_t dpbf16512(uint64_t iters) {
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3A83), b = a;  // bf16 1e-3
#define D(i) __m512 c##i = _mm512_set1_ps(1.f + i);
  CPUMOE_REP24(D)
#undef D
  for (uint64_t n = 0; n < iters; ++n) {
#define D(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
    CPUMOE_REP24(D)
#undef D
  }
#define D(i) c##i,
  const __m512 all[24] = {CPUMOE_REP24(D)};
#undef D
  sink(all, 24);
  return iters * 24 * 32;
}
#endif
#if defined(CPUMOE_BUILT_amx)
// Four independent tile products per round (C tiles 0-3, A tiles 4-5, B tiles 6-7, all 16 rows x 64 bytes), on
// zeroed tiles: AMX's timing does not depend on the values.
struct alignas(64) PeakTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
template <bool kInt8>
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) uint64_t amx_loop(uint64_t iters) {
  PeakTileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);  // also zeroes every tile
  for (uint64_t n = 0; n < iters; ++n) {
    if constexpr (kInt8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) int32_t out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  sink(out, 16);
  return iters * 4 * 16 * 16 * (kInt8 ? 64 : 32);
}
#endif

using Loop = uint64_t (*)(uint64_t);

// The loop a tier runs for a kind (nullptr: none in this build). Below avx512bf16 bf16 kernels multiply in fp32.
Loop loop_for(int32_t kind, int32_t tier) {
  switch (tier) {
#if defined(CPUMOE_BUILT_avx2)
    case CPUMOE_TIER_AVX2:
      return kind == CPUMOE_PEAK_INT8 ? &maddubs256 : &fma256;
#endif
#if defined(CPUMOE_BUILT_avxvnni)
    case CPUMOE_TIER_AVXVNNI:
      return kind == CPUMOE_PEAK_INT8 ? &dpbusd256 : &fma256;
#endif
#if defined(CPUMOE_BUILT_avx512f)
    case CPUMOE_TIER_AVX512F:
      return kind == CPUMOE_PEAK_INT8 ? &maddubs512 : &fma512;
#endif
#if defined(CPUMOE_BUILT_avx512vnni)
    case CPUMOE_TIER_AVX512VNNI:
      return kind == CPUMOE_PEAK_INT8 ? &dpbusd512 : &fma512;
#endif
#if defined(CPUMOE_BUILT_avx512bf16)
    case CPUMOE_TIER_AVX512BF16:
      return kind == CPUMOE_PEAK_INT8 ? &dpbusd512 : kind == CPUMOE_PEAK_BF16 ? &dpbf16512 : &fma512;
#endif
#if defined(CPUMOE_BUILT_amx)
    case CPUMOE_TIER_AMX:
      return kind == CPUMOE_PEAK_INT8 ? &amx_loop<true> : kind == CPUMOE_PEAK_BF16 ? &amx_loop<false> : &fma512;
#endif
    default:
      return nullptr;
  }
}
}  // namespace

uint64_t peak_loop(int32_t kind, int32_t tier, uint64_t iters) {
  if (kind < 0 || kind >= CPUMOE_PEAK_COUNT || tier < 0 || tier >= CPUMOE_TIER_COUNT) return 0;
  if (!(usable_tier_mask() & (1u << tier))) return 0;
  const Loop f = loop_for(kind, tier);
  return f ? f(iters) : 0;
}
}  // namespace cpumoe
