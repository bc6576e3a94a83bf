// The reduction that ends a down row block (executor.cpp stage 2): a token's route terms summed in route order and
// rounded to bf16.
#pragma once
#include <cstdint>

namespace cpumoe_exec {

// y[h] = bf16(t[0][h] + t[1][h] + ... + t[n-1][h]) for h in [h0, h1), the adds left to right in fp32 (the same
// bits as the scalar loop: acc = t[0], acc += t[q] for q = 1..n-1), NaN kept quiet with its sign
// (cpumoe_f32_to_bf16). n >= 1. Vectorized for the widest of avx512f / avx2 / sse2 this CPU runs.
void route_sum(const float* const* t, int n, int32_t h0, int32_t h1, uint16_t* y);

// Which of those route_sum runs here ("avx512f", "avx2" or "sse2").
const char* route_sum_isa();

// route_sum with the named one of those (tests force each in turn); false, and nothing written, where this CPU
// cannot run it or the name is not one of them.
bool route_sum_as(const char* isa, const float* const* t, int n, int32_t h0, int32_t h1, uint16_t* y);

}  // namespace cpumoe_exec
