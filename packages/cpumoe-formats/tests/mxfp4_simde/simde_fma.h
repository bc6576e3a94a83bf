// ../fp4_simde/simde_pre.h plus fused multiply-adds: SIMDe's portable _mm256/_mm512_fmadd_ps round twice
// ((a * b) + c), which would make the emulated avx512f tier differ from real hardware (and from avx2) in the
// last bit. Per-lane std::fma is exact.
#pragma once
#include <cmath>
#include "../fp4_simde/simde_pre.h"
#undef _mm512_fmadd_ps
#undef _mm256_fmadd_ps
static inline simde__m512 mx_fma512(simde__m512 a, simde__m512 b, simde__m512 c) {
  float x[16], y[16], z[16];
  simde_mm512_storeu_ps(x, a), simde_mm512_storeu_ps(y, b), simde_mm512_storeu_ps(z, c);
  for (int i = 0; i < 16; ++i) z[i] = std::fma(x[i], y[i], z[i]);
  return simde_mm512_loadu_ps(z);
}
static inline simde__m256 mx_fma256(simde__m256 a, simde__m256 b, simde__m256 c) {
  float x[8], y[8], z[8];
  simde_mm256_storeu_ps(x, a), simde_mm256_storeu_ps(y, b), simde_mm256_storeu_ps(z, c);
  for (int i = 0; i < 8; ++i) z[i] = std::fma(x[i], y[i], z[i]);
  return simde_mm256_loadu_ps(z);
}
#define _mm512_fmadd_ps(a, b, c) mx_fma512(a, b, c)
#define _mm256_fmadd_ps(a, b, c) mx_fma256(a, b, c)
