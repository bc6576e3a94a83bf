// Work-item loops of the row-major GGUF block formats (q8_0, q4_k, q5_k, q6_k): the banks are the GGUF tensors'
// bytes, one row a run of fixed-size blocks. A format supplies only its row dots for its tier:
//
//   struct Rows {
//     static constexpr int kGrid;      // most tokens one row takes at once (dot<1, NT>, NT <= kGrid)
//     static constexpr int kRowsDown;  // rows a lone route's down takes at once (dot<R, 1>, 2 or 4)
//     // out[r * NT + t] = dot(row w[r] (K elements), prepared activation act[t]); R <= kRowsDown for NT = 1,
//     // R = 1 otherwise
//     template <int R, int NT> static void dot(const uint8_t* const* w, int K, const void* const* act, float* out);
//   };
//
// Contract of dot: each (row, token) result depends only on its row, its token and K, never on R, NT or the
// other rows and tokens of the call (its own accumulators, filled in the same order and reduced the same way),
// so a token's output does not depend on its batch (tests/test_batch_identity.py) nor a row's on the work split.
//
// The loops are q4_0's (q4_0.cpp): a lone token runs its gate and up rows together (two weight streams in
// flight); several tokens run each row against up to kGrid of them, in 16-row chunks (rowmajor.h
// gate_up_row_chunks); a lone route's down takes its rows in quads of two far-apart pairs (two streams); several
// routes of one expert run each row against up to kGrid routes.
#pragma once
#include <algorithm>
#include <cstring>

#include "../rowmajor.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the AVX-512 intrinsics' internal _mm512_undefined_* operands as (maybe-)uninitialized (a known
// false positive of the headers).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// Software prefetch distance of a weight stream: q4_0's 3 KB (prefetcht0 3 KB ahead: 95-101% of the read ceiling
// against ~58% without, one Sapphire Rapids core). Build knob.
#ifndef CPUMOE_GGUF_PF
#define CPUMOE_GGUF_PF 3072
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace gguf {

constexpr int kPf = CPUMOE_GGUF_PF;

CPUMOE_INLINE uint16_t ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;  // x86 is little-endian, as GGUF blocks are
}
CPUMOE_INLINE uint32_t ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
// prefetcht0 of `lines` lines kPf ahead of p (a block step's bytes: 3 lines for 144 bytes)
CPUMOE_INLINE void prefetch_ahead(const uint8_t* p, int lines) {
  for (int i = 0; i < lines; ++i) __builtin_prefetch(p + kPf + 64 * i, 0, 3);
}

// out[t] = dot(w, act[t]) for nt <= NT tokens (the largest instantiation that fits nt).
template <class Rows, int NT = Rows::kGrid>
CPUMOE_INLINE void row_tokens(const uint8_t* w, int K, int nt, const void* const* act, float* out) {
  if constexpr (NT > 1) {
    if (nt < NT) return row_tokens<Rows, NT - 1>(w, K, nt, act, out);
  }
  Rows::template dot<1, NT>(&w, K, act, out);
}

template <class Rows>
void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  constexpr int G = Rows::kGrid;
  const cpumoe_params& p = k->params;
  ActSink sink(p);  // g in SIMD lanes (common.h)
  if (n > G) {      // several token blocks: row chunks (rowmajor.h)
    gate_up_row_chunks<G>(
        i0, i1, p.inter, n,
        [&](int32_t row, int32_t j0, int nt, float* out) {
          row_tokens<Rows>(bank_row<uint8_t>(banks[0], e, row), p.hidden, nt, xs + j0, out);
        },
        gate_up_put<false>(sink, g, w_in));
    return;
  }
  if (n == 1) {  // the first kPf bytes of the item's gate and up streams (the in-stream distance starts there)
    const int64_t w = std::min<int64_t>(kPf, (int64_t)(i1 - i0) * banks[0].row_stride);
    prefetch_span(bank_row<uint8_t>(banks[0], e, i0), w), prefetch_span(bank_row<uint8_t>(banks[0], e, p.inter + i0), w);
  }
  for (int32_t i = i0; i < i1; ++i) {
    const uint8_t* rows[2] = {bank_row<uint8_t>(banks[0], e, i), bank_row<uint8_t>(banks[0], e, p.inter + i)};
    float gate[G], up[G];
    if (n == 1) {
      float gu[2];
      Rows::template dot<2, 1>(rows, p.hidden, xs, gu);
      gate[0] = gu[0], up[0] = gu[1];
    } else {
      row_tokens<Rows>(rows[0], p.hidden, n, xs, gate);
      row_tokens<Rows>(rows[1], p.hidden, n, xs, up);
    }
    for (int t = 0; t < n; ++t) sink.put(&g[t][i], gate[t] * w_in[t], up[t] * w_in[t]);
  }
}

// R rows of expert e from row h (rows h + off[r]) against one route; adds weight * dot to the route's acc row.
template <class Rows, int R>
CPUMOE_INLINE void down_rows(const cpumoe_bank& b, int32_t e, int32_t h, const int32_t (&off)[R], int K,
                             const cpumoe_route& rt, float* o) {
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = bank_row<uint8_t>(b, e, h + off[r]);
  float y[R];
  Rows::template dot<R, 1>(rows, K, &rt.act, y);
  for (int r = 0; r < R; ++r) o[off[r]] += y[r] * rt.weight;
}

template <class Rows>
void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  constexpr int G = Rows::kGrid;
  const int K = k->params.inter;
  const int64_t rs = banks[1].row_stride;
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int32_t e = routes[a].expert;
    if (b - a > 1) {  // several routes: each row against blocks of up to G routes
      for (int32_t h = h0; h < h1; ++h) {
        const uint8_t* w = bank_row<uint8_t>(banks[1], e, h);
        for (int32_t r0 = a; r0 < b; r0 += G) {
          const int nt = b - r0 < G ? b - r0 : G;
          const void* acts[G];
          float y[G];
          for (int t = 0; t < nt; ++t) acts[t] = routes[r0 + t].act;
          row_tokens<Rows>(w, K, nt, acts, y);
          for (int t = 0; t < nt; ++t) acc[routes[r0 + t].token * acc_stride + (h - h0)] += y[t] * routes[r0 + t].weight;
        }
      }
      a = b;
      continue;
    }
    // one route: an expert's rows [h0, h1) are one contiguous span of short rows (q4_k at I = 768: 432 bytes, under
    // the 3 KB in-stream distance, so that prefetch never covers a row's start): the first group fetches its own,
    // every group fetches the next group's rows as it reaches the same rows (q4_0's CPUMOE_Q4_AHEAD bit 1)
    const cpumoe_route& rt = routes[a];
    float* o = acc + rt.token * acc_stride - h0;
    const uint8_t* next = b < n ? bank_row<uint8_t>(banks[1], routes[b].expert, 0) : nullptr;
    if (a == 0) prefetch_span(bank_row<uint8_t>(banks[1], e, h0), (h1 - h0) * rs);
    int32_t h = h0;
    if constexpr (Rows::kRowsDown == 4) {  // two far-apart row pairs: two weight streams in flight
      const int32_t half = (h1 - h0) / 2 & ~1;
      const int32_t off[4] = {0, 1, half, half + 1};
      for (; h < h0 + half; h += 2) {
        if (next) prefetch_span(next + h * rs, 2 * rs), prefetch_span(next + (h + half) * rs, 2 * rs);
        down_rows<Rows, 4>(banks[1], e, h, off, K, rt, o + h);
      }
      h = h0 + 2 * half;
    }
    for (; h + 2 <= h1; h += 2) {
      if (next) prefetch_span(next + h * rs, 2 * rs);
      down_rows<Rows, 2>(banks[1], e, h, {0, 1}, K, rt, o + h);
    }
    if (h < h1) {
      if (next) prefetch_span(next + h * rs, rs);
      down_rows<Rows, 1>(banks[1], e, h, {0}, K, rt, o + h);
    }
    a = b;
  }
}

template <class Rows>
void install(cpumoe_kernel* k) {
  k->gate_up = &gate_up<Rows>;
  k->down = &down<Rows>;
}

// ---- integer activations: the Q8_0 rule per block (common.h q8_block / q8_block32), natural element order -----
// A prepared vector of length K with block size QB (32: q8_0's Q8_0 activations; 256: the K-quants' q8_K):
//   int8  q[K]          the codes, element order
//   float d[K/QB]       the scale per block (NaN where the block holds a NaN or an inf, codes 0)
//   int16 bsum[K/16]    (QB = 256 only) the sum of each 16 codes, as ggml's block_q8_K.bsums
template <int QB>
struct ActI8 {
  const int8_t* q;
  const float* d;
  const int16_t* bsum;
  CPUMOE_INLINE ActI8(const void* act, int K)
      : q((const int8_t*)act), d((const float*)(q + K)), bsum((const int16_t*)(d + K / QB)) {}
};
template <int QB>
size_t act_bytes_i8(const cpumoe_kernel*, int32_t K) {
  return (size_t)K + (size_t)(K / QB) * 4 + (QB == 256 ? (size_t)(K / 16) * 2 : 0);
}
template <int QB>
void prep_act_i8(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  int8_t* q = (int8_t*)dst;
  float* d = (float*)(q + K);
  int16_t* bsum = (int16_t*)(d + K / QB);
  for (int b = 0; b < K / QB; ++b) {
    const uint16_t* s = src + (size_t)b * QB;
    int8_t* qb = q + (size_t)b * QB;
#if defined(__AVX2__)
    // amax over the block first (a 256-block is 8 Q8_0-sized pieces), then the codes; bit for bit the scalar rule
    __m256 x[QB / 8];
    __m256i m = _mm256_setzero_si256();
    for (int i = 0; i < QB / 8; ++i) x[i] = bf16x8_f32(s + 8 * i), m = absmax8(x[i], m);
    const uint32_t amax = hmax8(m);
    if (amax >= kInfBits) {
      d[b] = nonfinite_scale();
      std::memset(qb, 0, QB);
    } else {
      d[b] = bits_f32(amax) / 127.0f;
      const __m256 vid = _mm256_set1_ps(q8_inv(d[b]));
      const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
      for (int i = 0; i < QB / 32; ++i) {
        __m256i qi[4];
        for (int j = 0; j < 4; ++j) {
          const __m256 r = _mm256_round_ps(_mm256_mul_ps(x[4 * i + j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          qi[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(r), lim), nlim);
        }
        const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
        _mm256_storeu_si256((__m256i*)(qb + 32 * i), _mm256_permutevar8x32_epi32(
                                                         _mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      }
    }
#else
    float x[QB];
    for (int j = 0; j < QB; ++j) x[j] = bf16_to_f32(s[j]);
    d[b] = q8_block(x, QB, qb);
#endif
  }
  if (QB == 256)
    for (int j = 0; j < K / 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += q[16 * j + i];
      bsum[j] = (int16_t)s;
    }
}

}  // namespace gguf
}  // namespace CPUMOE_NS
}  // namespace cpumoe
