// fp8_block experts on vdpbf16ps (tier avx512bf16, which includes AVX512-VBMI; included by fp8_block.cpp at that
// tier only).
//
// Why: avx512f decodes 64 codes to 4 fp32 vectors (fp16 patterns widened by vcvtph2ps) and spends 4 FMAs per token
// on them; here the byte tables of fp8_block_decode.h give 2 vectors of 32 exact bf16 weights, and one vdpbf16ps
// takes 32 weight-activation pairs: half the multiply-adds per token, no conversion. Zen 4, one core, a 2 KB row
// resident in L2 (microbenchmark): 32 GB/s against 20 for the fp16 path; the H200 host's Xeon: 11.3 vs 10.8.
//
// Arithmetic (mode W8A16: x consumed as its exact bf16): per (row, token) and 128-K block two partial sums
// (codes 0..31 + 64..95 and 32..63 + 96..127 of the block, each a vdpbf16ps chain started at zero), then
// acc_j = fma(partial_j, scale[row / 128][block], acc_j); the row's result is hsum(acc_0 + acc_1). The products are
// exact; what differs from avx512f is the summation order and that a bf16-subnormal activation (|x| < 2^-126)
// reads as zero (vdpbf16ps, as the bf16 format's kernels). Every (row, token) pair's operations are the same
// whatever rows and tokens share its call, so a token's result does not depend on its batch.
// Rows in flight: a lone token runs gate and up of rows i and i + q together (4 streams), a lone route's down rows
// h + j q (j < 4); several tokens of one expert run in blocks of up to 4 per row (each chunk decoded once).
#pragma once
#include <type_traits>

#include "fp8_block_decode.h"

// Software prefetch distance in each weight row (bytes, prefetcht0; 0 = off): as avx512f's CPUMOE_FP8_PF, one per
// 64-code chunk and row.
#ifndef CPUMOE_FP8_BF16_PF
#define CPUMOE_FP8_BF16_PF 1024
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
namespace bf8 {
constexpr int kBlk = 128, kGrid = 4;  // R * NT <= kGrid: 4 fp32 vectors per (row, token) pair

// out[r * NT + t] = dot(row w[r] with scale row s[r], token x[t]) over K.
template <int R, int NT>
CPUMOE_INLINE void grid(const fp8dec::Decoder& d, const uint8_t* const* w, const uint16_t* const* s, int K,
                        const uint16_t* const* x, float* out) {
  __m512 acc[R][NT][2];
  CPUMOE_UNROLL
  for (int r = 0; r < R; ++r)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
  const int nb = (K + kBlk - 1) / kBlk;
  for (int b = 0; b < nb; ++b) {
    const int o = b * kBlk, n = K - o < kBlk ? K - o : kBlk;  // codes of this block
    __m512 part[R][NT][2];
    // chunk c (64 codes) of the block into every pair's two partial sums; masked past K (codes and activations)
    auto chunk = [&](auto C) CPUMOE_LAMBDA_INLINE {
      constexpr int c = decltype(C)::value;
      const int oc = o + 64 * c, m = n - 64 * c < 64 ? n - 64 * c : 64;
      const __mmask32 m0 = m >= 32 ? ~0u : (1u << m) - 1u, m1 = m >= 64 ? ~0u : m > 32 ? (1u << (m - 32)) - 1u : 0u;
      __m512bh xv[NT][2];
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        xv[t][0] = (__m512bh)_mm512_maskz_loadu_epi16(m0, x[t] + oc);
        xv[t][1] = (__m512bh)_mm512_maskz_loadu_epi16(m1, x[t] + oc + 32);
      }
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        __m512i w0, w1;
        if (CPUMOE_FP8_BF16_PF) __builtin_prefetch(w[r] + oc + CPUMOE_FP8_BF16_PF, 0, 3);
        d.decode(w[r] + oc, m, w0, w1);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          __m512& p0 = part[r][t][0];
          __m512& p1 = part[r][t][1];
          if constexpr (c == 0) p0 = p1 = _mm512_setzero_ps();
          p0 = _mm512_dpbf16_ps(p0, (__m512bh)w0, xv[t][0]);
          p1 = _mm512_dpbf16_ps(p1, (__m512bh)w1, xv[t][1]);
        }
      }
    };
    chunk(std::integral_constant<int, 0>{});
    if (n > 64) chunk(std::integral_constant<int, 1>{});
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 sc = _mm512_set1_ps(bf16_to_f32(s[r][b]));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        acc[r][t][0] = _mm512_fmadd_ps(part[r][t][0], sc, acc[r][t][0]);
        acc[r][t][1] = _mm512_fmadd_ps(part[r][t][1], sc, acc[r][t][1]);
      }
    }
  }
  CPUMOE_UNROLL
  for (int r = 0; r < R; ++r)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum512(_mm512_add_ps(acc[r][t][0], acc[r][t][1]));
}

// One row against nt <= NT tokens through grid<1, nt>.
template <int NT = kGrid>
CPUMOE_INLINE void row_tokens(const fp8dec::Decoder& d, const uint8_t* w, const uint16_t* s, int K, int nt,
                              const uint16_t* const* x, float* out) {
  if constexpr (NT > 1) {
    if (nt < NT) return row_tokens<NT - 1>(d, w, s, K, nt, x, out);
  }
  grid<1, NT>(d, &w, &s, K, x, out);
}

// Weight row `row` of bank slot `wslot` and its 128-row block's scale row (slot wslot + 1).
struct Row {
  const uint8_t* w;
  const uint16_t* s;
  CPUMOE_INLINE Row(const cpumoe_bank* banks, int wslot, int e, int row)
      : w(bank_row<uint8_t>(banks[wslot], e, row)), s(bank_row<uint16_t>(banks[wslot + 1], e, row / kBlk)) {}
};

void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  const cpumoe_params& p = k->params;
  const int H = p.hidden, I = p.inter;
  const fp8dec::Decoder d;
  ActSink sink(p);  // g in SIMD lanes (common.h)
  const uint16_t* const* x = (const uint16_t* const*)xs;
  int32_t i = i0;
  if (n == 1) {  // a lone token: gate and up of rows i and i + q, four weight streams
    const int32_t q = (i1 - i0) / 2;
    for (; i < i0 + q; ++i) {
      const Row a(banks, 0, e, i), b(banks, 0, e, I + i), c(banks, 0, e, i + q), f(banks, 0, e, I + i + q);
      const uint8_t* w[4] = {a.w, b.w, c.w, f.w};
      const uint16_t* s[4] = {a.s, b.s, c.s, f.s};
      float y[4];
      grid<4, 1>(d, w, s, H, x, y);
      sink.put(&g[0][i], y[0] * w_in[0], y[1] * w_in[0]);
      sink.put(&g[0][i + q], y[2] * w_in[0], y[3] * w_in[0]);
    }
    i = i0 + 2 * q;  // at most one row left
  }
  if (n > kGrid) {  // several token blocks: row chunks (rowmajor.h)
    gate_up_row_chunks<kGrid>(
        i, i1, I, n,
        [&](int32_t row, int32_t j0, int nt, float* out) {
          const Row r(banks, 0, e, row);
          row_tokens(d, r.w, r.s, H, nt, x + j0, out);
        },
        gate_up_put<false>(sink, g, w_in));
    return;
  }
  for (; i < i1; ++i) {
    const Row rg(banks, 0, e, i), ru(banks, 0, e, I + i);
    for (int32_t j0 = 0; j0 < n; j0 += kGrid) {  // token blocks: each row chunk decoded once per block
      const int nt = n - j0 < kGrid ? n - j0 : kGrid;
      float gate[kGrid], up[kGrid];
      row_tokens(d, rg.w, rg.s, H, nt, x + j0, gate);
      row_tokens(d, ru.w, ru.s, H, nt, x + j0, up);
      for (int t = 0; t < nt; ++t) sink.put(&g[j0 + t][i], gate[t] * w_in[j0 + t], up[t] * w_in[j0 + t]);
    }
  }
}

void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  const int I = k->params.inter;
  const fp8dec::Decoder d;
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int e = routes[a].expert;
    int32_t h = h0;
    if (b - a == 1) {  // a lone route: rows h + j q (j < 4) in one pass, weight streams far apart
      const int32_t q = (h1 - h0) / kGrid;
      const uint16_t* x = (const uint16_t*)routes[a].act;
      float* o = acc + routes[a].token * acc_stride - h0;
      for (; h < h0 + q; ++h) {
        const uint8_t* w[kGrid];
        const uint16_t* s[kGrid];
        float y[kGrid];
        CPUMOE_UNROLL
        for (int j = 0; j < kGrid; ++j) {
          const Row r(banks, 2, e, h + j * q);
          w[j] = r.w, s[j] = r.s;
        }
        grid<kGrid, 1>(d, w, s, I, &x, y);
        CPUMOE_UNROLL
        for (int j = 0; j < kGrid; ++j) o[h + j * q] += y[j] * routes[a].weight;
      }
      h = h0 + kGrid * q;  // at most kGrid - 1 rows left
    }
    for (; h < h1; ++h) {
      const Row r(banks, 2, e, h);
      for (int32_t q0 = a; q0 < b; q0 += kGrid) {  // route blocks of the expert group
        const int nt = b - q0 < kGrid ? b - q0 : kGrid;
        const uint16_t* x[kGrid];
        float y[kGrid];
        for (int t = 0; t < nt; ++t) x[t] = (const uint16_t*)routes[q0 + t].act;
        row_tokens(d, r.w, r.s, I, nt, x, y);
        for (int t = 0; t < nt; ++t) acc[routes[q0 + t].token * acc_stride + (h - h0)] += y[t] * routes[q0 + t].weight;
      }
    }
    a = b;
  }
}

}  // namespace bf8
}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
