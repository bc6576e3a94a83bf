// route_sum: a down row block's per-token sum of route terms, then bf16. The terms were written by other threads
// (each down item's expert group), so this reads 4 * (h1 - h0) bytes per route from other cores' caches. H200 host,
// nvfp4 shared batch 8 (8 tokens x 8 routes x 128 rows per row block): the scalar loop it replaces, which also wrote
// the sums back into the first route's slot, cost 15-20 us of the 16 threads' down time per step.
#include "route_sum.h"

#include <cstring>

#include "cpumoe_formats/abi.h"

namespace cpumoe_exec {
namespace {

template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(4 * W)));
  typedef uint32_t u __attribute__((vector_size(4 * W)));
  typedef uint16_t h __attribute__((vector_size(2 * W)));
};

// W floats: the adds, and cpumoe_f32_to_bf16 lane by lane (GCC vector extensions, lowered for the calling
// function's target)
template <int W>
__attribute__((always_inline)) inline void sum_lanes(const float* const* t, int n, int32_t h, uint16_t* y) {
  typedef typename Vec<W>::u vu;
  typename Vec<W>::f v, w;
  std::memcpy(&v, t[0] + h, sizeof v);
  for (int q = 1; q < n; ++q) std::memcpy(&w, t[q] + h, sizeof w), v += w;
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vu rne = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x0040u;
  const vu nan = (vu)((u & 0x7FFFFFFFu) > 0x7F800000u);  // all ones where NaN
  const vu r = (quiet & nan) | (rne & ~nan);
  const typename Vec<W>::h o = __builtin_convertvector(r, typename Vec<W>::h);
  std::memcpy(y + h, &o, sizeof o);
}

template <int W>
__attribute__((always_inline)) inline void sum_span(const float* const* t, int n, int32_t h0, int32_t h1,
                                                    uint16_t* y) {
  int32_t h = h0;
  for (; h + W <= h1; h += W) sum_lanes<W>(t, n, h, y);
  for (; h < h1; ++h) {
    float v = t[0][h];
    for (int q = 1; q < n; ++q) v += t[q][h];
    y[h] = cpumoe_f32_to_bf16(v);
  }
}

__attribute__((target("avx512f,avx512bw"))) void sum_avx512(const float* const* t, int n, int32_t h0, int32_t h1,
                                                             uint16_t* y) {
  sum_span<16>(t, n, h0, h1, y);
}
__attribute__((target("avx2"))) void sum_avx2(const float* const* t, int n, int32_t h0, int32_t h1, uint16_t* y) {
  sum_span<8>(t, n, h0, h1, y);
}
void sum_sse2(const float* const* t, int n, int32_t h0, int32_t h1, uint16_t* y) { sum_span<4>(t, n, h0, h1, y); }

struct Impl {
  RouteSum rs;
  int min_tier;
};
constexpr Impl kImpls[] = {{{&sum_avx512, "avx512f"}, CPUMOE_TIER_AVX512F},  // widest first
                           {{&sum_avx2, "avx2"}, CPUMOE_TIER_AVX2},
                           {{&sum_sse2, "sse2"}, CPUMOE_TIER_SCALAR}};  // x86-64's baseline

}  // namespace

RouteSum route_sum_for(int tier) {
  for (const Impl& i : kImpls)
    if (tier >= i.min_tier) return i.rs;
  return kImpls[2].rs;
}

bool route_sum_named(const char* isa, int tier, RouteSum* out) {
  for (const Impl& i : kImpls)
    if (std::strcmp(i.rs.isa, isa) == 0 && tier >= i.min_tier) return *out = i.rs, true;
  return false;
}

}  // namespace cpumoe_exec
