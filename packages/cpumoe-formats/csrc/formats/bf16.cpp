// bf16 experts: gate_up [E, 2I, H], down [E, H, I], both bf16, row-major.
// Banks (slots): 0 gate_up, 1 down. Ragged H and I allowed (scalar tails).
// Tiers: scalar; avx2 and avx512f widen bf16 to fp32 (x prepared as fp32,
// 4 independent FMA chains; avx2 runs two rows per pass for a lone token, see
// dot_rows2); avx512bf16 feeds vdpbf16ps with bf16 x.
#include "../rowmajor.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

CPUMOE_INLINE const uint16_t* row_of(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row, int* K) {
  *K = pass == 0 ? k->params.hidden : k->params.inter;
  return bank_row<uint16_t>(banks[pass], e, row);
}

// Each token has 4 accumulator chains (chunk c of the main loop goes to chain c % 4, the one-vector tail to
// chain 0), summed as (a0 + a1) + (a2 + a3), then the scalar tail in order: the same operations for every NT,
// so a token's dot never depends on which tokens share the call. A weight vector is loaded (and widened)
// once per NT tokens. NT <= 3 on AVX2 (12 of 16 ymm hold accumulators), <= 4 on AVX-512 (16 of 32 zmm).
struct Dot {
  static constexpr bool kRoundGateUp = false, kRoundRouteTerm = false;
#if CPUMOE_TIER == CPUMOE_T_SCALAR
  static constexpr int kMaxNT = 1;
#elif CPUMOE_TIER == CPUMOE_T_AVX2
  static constexpr int kMaxNT = 3;
#else
  static constexpr int kMaxNT = 4;
#endif
  template <int NT>
  static void dotn(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row,
                   const void* const* acts, float* out) {
    int K;
    const uint16_t* w = row_of(k, banks, pass, e, row, &K);
    int i = 0;
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
    const uint16_t* x[NT];
    __m512 a[NT][4];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) {
      x[t] = (const uint16_t*)acts[t];
      a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm512_setzero_ps();
    }
    for (; i + 128 <= K; i += 128) {
      CPUMOE_PREFETCH(w + i + 512);
      CPUMOE_UNROLL
      for (int c = 0; c < 4; ++c) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i + 32 * c);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t)
          a[t][c] = _mm512_dpbf16_ps(a[t][c], wv, (__m512bh)_mm512_loadu_si512(x[t] + i + 32 * c));
      }
    }
    for (; i < K; i += 32) {  // masked tail: zero lanes contribute nothing
      const __mmask32 m = K - i >= 32 ? 0xFFFFFFFFu : ((1u << (K - i)) - 1u);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t)
        a[t][0] = _mm512_dpbf16_ps(a[t][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, x[t] + i));
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      out[t] = hsum512(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
#else
    const float* x[NT];
    float s[NT];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) x[t] = (const float*)acts[t], s[t] = 0.f;
#if CPUMOE_TIER == CPUMOE_T_AVX512F
    auto wide = [&](int o) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + o))), 16));
    };
    __m512 a[NT][4];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm512_setzero_ps();
    for (; i + 64 <= K; i += 64) {
      CPUMOE_PREFETCH(w + i + 512);
      CPUMOE_UNROLL
      for (int c = 0; c < 4; ++c) {
        const __m512 wv = wide(i + 16 * c);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) a[t][c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[t] + i + 16 * c), a[t][c]);
      }
    }
    for (; i + 16 <= K; i += 16) {
      const __m512 wv = wide(i);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) a[t][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[t] + i), a[t][0]);
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      s[t] = hsum512(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
#elif CPUMOE_TIER == CPUMOE_T_AVX2
    auto wide = [&](int o) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + o))), 16));
    };
    __m256 a[NT][4];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm256_setzero_ps();
    for (; i + 32 <= K; i += 32) {
      CPUMOE_PREFETCH(w + i + 256);
      CPUMOE_UNROLL
      for (int c = 0; c < 4; ++c) {
        const __m256 wv = wide(i + 8 * c);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) a[t][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + i + 8 * c), a[t][c]);
      }
    }
    for (; i + 8 <= K; i += 8) {
      const __m256 wv = wide(i);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) a[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + i), a[t][0]);
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      s[t] = hsum256(_mm256_add_ps(_mm256_add_ps(a[t][0], a[t][1]), _mm256_add_ps(a[t][2], a[t][3])));
#endif
    for (; i < K; ++i) {
      const float wf = bf16_to_f32(w[i]);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) s[t] += wf * x[t][i];
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) out[t] = s[t];
#endif
  }
};

#if CPUMOE_TIER == CPUMOE_T_AVX2
// One token's gate row and up row in one pass (two weight streams in flight, 8 chains): each row's chains, their
// order and the final reduction are exactly those of Dot::dotn<1> (chunk c -> chain c, the one-vector tail ->
// chain 0, (a0 + a1) + (a2 + a3), then the scalar tail in order), so the result equals the one-row dot bit for
// bit and a token's output never depends on its batch.
CPUMOE_INLINE void dot_rows2(const uint16_t* w0, const uint16_t* w1, int K, const float* x, float* out) {
  auto wide = [](const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  };
  __m256 a[2][4];
  CPUMOE_UNROLL
  for (int r = 0; r < 2; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
  const uint16_t* w[2] = {w0, w1};
  int i = 0;
  for (; i + 32 <= K; i += 32) {
    CPUMOE_UNROLL
    for (int r = 0; r < 2; ++r) CPUMOE_PREFETCH(w[r] + i + 256);
    CPUMOE_UNROLL
    for (int c = 0; c < 4; ++c) {
      const __m256 xv = _mm256_loadu_ps(x + i + 8 * c);
      CPUMOE_UNROLL
      for (int r = 0; r < 2; ++r) a[r][c] = _mm256_fmadd_ps(wide(w[r] + i + 8 * c), xv, a[r][c]);
    }
  }
  for (; i + 8 <= K; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    CPUMOE_UNROLL
    for (int r = 0; r < 2; ++r) a[r][0] = _mm256_fmadd_ps(wide(w[r] + i), xv, a[r][0]);
  }
  float s[2];
  CPUMOE_UNROLL
  for (int r = 0; r < 2; ++r) s[r] = hsum256(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
  for (; i < K; ++i)
    CPUMOE_UNROLL
    for (int r = 0; r < 2; ++r) s[r] += bf16_to_f32(w[r][i]) * x[i];
  out[0] = s[0], out[1] = s[1];
}

// gate_up: a lone token runs its gate and up rows together (dot_rows2); several tokens keep rowmajor.h's
// multi-token loop (each row decoded once per block of tokens).
void gate_up_avx2(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
                  const void* const* xs, const float* w_in, uint16_t* const* g) {
  if (n != 1) return rowmajor_gate_up<Dot>(k, banks, e, i0, i1, n, xs, w_in, g);
  const cpumoe_params& p = k->params;
  for (int32_t i = i0; i < i1; ++i) {
    float gu[2];
    dot_rows2(bank_row<uint16_t>(banks[0], e, i), bank_row<uint16_t>(banks[0], e, p.inter + i), p.hidden,
              (const float*)xs[0], gu);
    g[0][i] = f32_to_bf16(activate(p, gu[0] * w_in[0], gu[1] * w_in[0]));
  }
}

// down: an expert with one route pairs output row h with row h + (h1 - h0) / 2 (dot_rows2): two weight streams
// far apart. Measured on the Zen 3 dev VM (A/B in one process): adjacent row pairs were slower than one row at a
// time, far-apart pairs faster (the hardware prefetchers run two independent streams). An expert with several
// routes keeps rowmajor.h's multi-token loop.
void down_avx2(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
               int32_t n, float* acc, int64_t acc_stride) {
  const int K = k->params.inter;
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    if (b - a > 1) {
      rowmajor_down<Dot>(k, banks, h0, h1, routes + a, b - a, acc, acc_stride);
      a = b;
      continue;
    }
    const cpumoe_route& r = routes[a];
    float* o = acc + r.token * acc_stride - h0;
    const int32_t half = (h1 - h0) / 2;
    for (int32_t h = h0; h < h0 + half; ++h) {
      float y[2];
      dot_rows2(bank_row<uint16_t>(banks[1], r.expert, h), bank_row<uint16_t>(banks[1], r.expert, h + half), K,
                (const float*)r.act, y);
      o[h] += y[0] * r.weight;
      o[h + half] += y[1] * r.weight;
    }
    if ((h1 - h0) & 1) {
      float y;
      Dot::dotn<1>(k, banks, 1, r.expert, h1 - 1, &r.act, &y);
      o[h1 - 1] += y * r.weight;
    }
    a = b;
  }
}
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(bf16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  (void)k;
  return false;  // no int8 variant: the tier below runs
#else
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
  k->act_bytes = &act_bytes_bf16;
  k->prep_act = &prep_act_bf16;
#else
  k->act_bytes = &act_bytes_f32;
  k->prep_act = &prep_act_f32;
#endif
  install_rowmajor<Dot>(k);
#if CPUMOE_TIER == CPUMOE_T_AVX2
  k->gate_up = &gate_up_avx2;
  k->down = &down_avx2;
#endif
  return true;
#endif
}
