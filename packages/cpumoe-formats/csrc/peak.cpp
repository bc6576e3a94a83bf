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

#include "common.h"
#include "formats/amx_common.h"
#include "registry.h"
#include "tiers.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace cpumoe {
namespace {

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

// One loop per (tier, kind): N accumulators cI of type V, cI = INIT(I) and then cI = STEP(cI) each round (PRE: the
// loop-invariant operands; INIT and STEP name function-like macros), MACS multiply-adds per instruction. Named
// variables, not an array: GCC 12 kept an array of __m512i on the stack, storing it every round.
#define CPUMOE_R12(X, ...) \
  X(0, __VA_ARGS__) X(1, __VA_ARGS__) X(2, __VA_ARGS__) X(3, __VA_ARGS__) X(4, __VA_ARGS__) X(5, __VA_ARGS__) \
  X(6, __VA_ARGS__) X(7, __VA_ARGS__) X(8, __VA_ARGS__) X(9, __VA_ARGS__) X(10, __VA_ARGS__) X(11, __VA_ARGS__)
#define CPUMOE_R24(X, ...) \
  CPUMOE_R12(X, __VA_ARGS__) X(12, __VA_ARGS__) X(13, __VA_ARGS__) X(14, __VA_ARGS__) X(15, __VA_ARGS__) \
  X(16, __VA_ARGS__) X(17, __VA_ARGS__) X(18, __VA_ARGS__) X(19, __VA_ARGS__) X(20, __VA_ARGS__) X(21, __VA_ARGS__) \
  X(22, __VA_ARGS__) X(23, __VA_ARGS__)
#define CPUMOE_PK_DECL(i, V, INIT, STEP) V c##i = INIT(i);
#define CPUMOE_PK_STEP(i, V, INIT, STEP) c##i = STEP(c##i);
#define CPUMOE_PK_LIST(i, V, INIT, STEP) c##i,
#define CPUMOE_PEAK_LOOP(NAME, TARGET, R, N, V, PRE, INIT, STEP, MACS)   \
  __attribute__((target(TARGET))) uint64_t NAME(uint64_t iters) {        \
    PRE;                                                                \
    R(CPUMOE_PK_DECL, V, INIT, STEP)                                    \
    for (uint64_t n = 0; n < iters; ++n) {                              \
      R(CPUMOE_PK_STEP, V, INIT, STEP)                                  \
    }                                                                   \
    const V all[N] = {R(CPUMOE_PK_LIST, V, INIT, STEP)};                \
    sink(all, N);                                                       \
    return iters * N * MACS;                                            \
  }

#if defined(CPUMOE_BUILT_avx2)
#define CPUMOE_I(i) _mm256_set1_ps(1.f + i)
#define CPUMOE_S(c) _mm256_fmadd_ps(a, a, c)
CPUMOE_PEAK_LOOP(fma256, "avx2,fma", CPUMOE_R12, 12, __m256, const __m256 a = _mm256_set1_ps(1e-3f), CPUMOE_I, CPUMOE_S, 8)
#undef CPUMOE_I
#undef CPUMOE_S
// vpmaddubsw does not accumulate: each result is the next round's u8 operand
#define CPUMOE_I(i) _mm256_set1_epi8((char)(1 + i))
#define CPUMOE_S(c) _mm256_maddubs_epi16(c, a)
CPUMOE_PEAK_LOOP(maddubs256, "avx2", CPUMOE_R12, 12, __m256i, const __m256i a = _mm256_set1_epi8(3), CPUMOE_I, CPUMOE_S, 32)
#undef CPUMOE_I
#undef CPUMOE_S
#endif
#if defined(CPUMOE_BUILT_avxvnni)
#define CPUMOE_I(i) _mm256_set1_epi32(i)
#define CPUMOE_S(c) _mm256_dpbusd_avx_epi32(c, a, a)
CPUMOE_PEAK_LOOP(dpbusd256, "avx2,avxvnni", CPUMOE_R12, 12, __m256i, const __m256i a = _mm256_set1_epi8(3), CPUMOE_I,
                 CPUMOE_S, 32)
#undef CPUMOE_I
#undef CPUMOE_S
#endif
#if defined(CPUMOE_BUILT_avx512f)
#define CPUMOE_I(i) _mm512_set1_ps(1.f + i)
#define CPUMOE_S(c) _mm512_fmadd_ps(a, a, c)
CPUMOE_PEAK_LOOP(fma512, "avx512f", CPUMOE_R24, 24, __m512, const __m512 a = _mm512_set1_ps(1e-3f), CPUMOE_I, CPUMOE_S, 16)
#undef CPUMOE_I
#undef CPUMOE_S
#define CPUMOE_I(i) _mm512_set1_epi8((char)(1 + i))
#define CPUMOE_S(c) _mm512_maddubs_epi16(c, a)
CPUMOE_PEAK_LOOP(maddubs512, "avx512f,avx512bw", CPUMOE_R24, 24, __m512i, const __m512i a = _mm512_set1_epi8(3), CPUMOE_I,
                 CPUMOE_S, 64)
#undef CPUMOE_I
#undef CPUMOE_S
#endif
#if defined(CPUMOE_BUILT_avx512vnni)
#define CPUMOE_I(i) _mm512_set1_epi32(i)
#define CPUMOE_S(c) _mm512_dpbusd_epi32(c, a, a)
CPUMOE_PEAK_LOOP(dpbusd512, "avx512f,avx512vnni", CPUMOE_R24, 24, __m512i, const __m512i a = _mm512_set1_epi8(3),
                 CPUMOE_I, CPUMOE_S, 64)
#undef CPUMOE_I
#undef CPUMOE_S
#endif
#if defined(CPUMOE_BUILT_avx512bf16)
#define CPUMOE_I(i) _mm512_set1_ps(1.f + i)
#define CPUMOE_S(c) _mm512_dpbf16_ps(c, a, a)
CPUMOE_PEAK_LOOP(dpbf16512, "avx512f,avx512bf16", CPUMOE_R24, 24, __m512,
                 const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3A83) /* bf16 1e-3 */, CPUMOE_I, CPUMOE_S, 32)
#undef CPUMOE_I
#undef CPUMOE_S
#endif
#if defined(CPUMOE_BUILT_amx)
// Four independent tile products per round (C tiles 0-3, A tiles 4-5, B tiles 6-7, all 16 rows x 64 bytes), on
// zeroed tiles: AMX's timing does not depend on the values. The tile kernels' palette-1 configuration.
template <bool kInt8>
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) uint64_t amx_loop(uint64_t iters) {
  CPUMOE_NS::amx::TileConfig c;
  for (int t = 0; t < 8; ++t) c.set(t, 16, 64);
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
