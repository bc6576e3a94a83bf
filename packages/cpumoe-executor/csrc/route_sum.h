// The reduction that ends a down row block (executor.cpp stage 2): a token's route terms summed in route order and
// rounded to bf16.
#pragma once
#include <cstdint>

namespace cpumoe_exec {

// y[h] = bf16(t[0][h] + t[1][h] + ... + t[n-1][h]) for h in [h0, h1), the adds left to right in fp32 (the same
// bits as the scalar loop: acc = t[0], acc += t[q] for q = 1..n-1), NaN kept quiet with its sign
// (cpumoe_f32_to_bf16). n >= 1.
using RouteSumFn = void (*)(const float* const* t, int n, int32_t h0, int32_t h1, uint16_t* y);
struct RouteSum {
  RouteSumFn fn;
  const char* isa;  // "avx512f", "avx2" or "sse2"
};

// The widest reduction a cpumoe_tier runs: avx512f from CPUMOE_TIER_AVX512F, avx2 from CPUMOE_TIER_AVX2, else sse2.
// The executor passes the formats library's tier (its CPUID and OS register-state checks, capped like the kernels:
// CPUMOE_ISA or the isa argument), so one detection and one cap decide every SIMD width.
RouteSum route_sum_for(int tier);

// The named one of those, if `tier` runs it (tests force each in turn); false where the name is not one of them or
// the tier is below it.
bool route_sum_named(const char* isa, int tier, RouteSum* out);

}  // namespace cpumoe_exec
