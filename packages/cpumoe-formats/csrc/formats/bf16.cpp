// bf16 experts: gate_up [E, 2I, H], down [E, H, I], both bf16, row-major.
// Banks (slots): 0 gate_up, 1 down. Ragged H and I allowed (scalar tails).
// Tiers: scalar; avx2 and avx512f widen bf16 to fp32 (x prepared as fp32,
// 4 independent FMA chains); avx512bf16 feeds vdpbf16ps with bf16 x.
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

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F || CPUMOE_TIER == CPUMOE_T_AVX512BF16
  // Down rows when I is tiny (rowmajor.h, SmallK): a row is one or two vectors (masked or zero-padded), its product with
  // the activation reduced together with kRowBlock - 1 neighbours by a transposing add tree. Each row's sum
  // order is fixed by its lanes alone (the tree is the same for every slot, missing rows are zeros), so a row
  // gives the same bits wherever its block starts: work splits and batches never change it.
#if CPUMOE_TIER == CPUMOE_T_AVX2
  static constexpr int kSmallK = 16, kRowBlock = 8;  // two 8-lane fp32 halves: w0*x0 + w1*x1 (one fma)
#elif CPUMOE_TIER == CPUMOE_T_AVX512BF16
  static constexpr int kSmallK = 32, kRowBlock = 16;  // one vdpbf16ps of 32 bf16 pairs
#else
  static constexpr int kSmallK = 16, kRowBlock = 16;  // one 16-lane fp32 product
#endif
  static void rows_acc(const cpumoe_kernel* k, const cpumoe_bank* banks, int e, int row0, int nr, const void* act,
                       float weight, float* out) {
    const int K = k->params.inter;
    auto wrow = [&](int r) { return bank_row<uint16_t>(banks[1], e, row0 + r); };
#if CPUMOE_TIER == CPUMOE_T_AVX2
    alignas(32) float xp[16] = {};
    std::memcpy(xp, act, (size_t)K * 4);
    const __m256 x0 = _mm256_load_ps(xp), x1 = _mm256_load_ps(xp + 8);
    auto wide = [](const uint16_t* w) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)w)), 16));
    };
    // Row pointers: the bank's row when it holds whole 8-vectors, else a zero-padded copy; rows past nr read
    // zeros (their sums land in slots that are not stored).
    alignas(32) static const uint16_t kZero[16] = {};
    alignas(32) uint16_t pad[8][16];
    const uint16_t* p[8];
    for (int r = 0; r < 8; ++r) {
      if (r >= nr) {
        p[r] = kZero;
      } else if (K % 8 == 0) {
        p[r] = wrow(r);
      } else {
        std::memset(pad[r], 0, sizeof pad[r]);
        std::memcpy(pad[r], wrow(r), (size_t)K * 2);
        p[r] = pad[r];
      }
    }
    __m256 v[8];
    if (K > 8) {
      CPUMOE_UNROLL
      for (int r = 0; r < 8; ++r) v[r] = _mm256_fmadd_ps(wide(p[r] + 8), x1, _mm256_mul_ps(wide(p[r]), x0));
    } else {
      CPUMOE_UNROLL
      for (int r = 0; r < 8; ++r) v[r] = _mm256_mul_ps(wide(p[r]), x0);
    }
    // rows' lanes (l0..l7): ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) for every row
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);  // rows 0-3 | 4-7, per 128 half
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
    const __m256 term = _mm256_mul_ps(sum, _mm256_set1_ps(weight));  // y * weight, then += (never fused)
    if (nr == 8) {
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), term));
      return;
    }
    alignas(32) float o[8];
    _mm256_store_ps(o, term);
#else
    __m512 v[16];
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
    const __mmask32 m = K == 32 ? 0xFFFFFFFFu : (1u << K) - 1u;  // masked lanes read nothing, count 0
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, act);
    CPUMOE_UNROLL
    for (int r = 0; r < 16; ++r)
      v[r] = r < nr ? _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_maskz_loadu_epi16(m, wrow(r)), xv)
                    : _mm512_setzero_ps();
#else
    const __mmask16 m = (__mmask16)((1u << K) - 1u);
    const __m512 xv = _mm512_maskz_loadu_ps(m, act);
    CPUMOE_UNROLL
    for (int r = 0; r < 16; ++r)
      v[r] = r < nr ? _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(
                                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, wrow(r))), 16)),
                                    xv)
                    : _mm512_setzero_ps();
#endif
    // Per 128-bit quarter: ((l0 + l2) + (l1 + l3)); then quarters (Q0 + Q1) + (Q2 + Q3): the same for every row.
    __m512 s[8], q[4], t[2];
    CPUMOE_UNROLL
    for (int i = 0; i < 8; ++i)
      s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    CPUMOE_UNROLL
    for (int i = 0; i < 4; ++i) {  // rows 4i..4i+3 in each quarter
      const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
      q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    CPUMOE_UNROLL
    for (int i = 0; i < 2; ++i)  // [rows 8i..8i+3: Q0+Q1, Q2+Q3 | rows 8i+4..8i+7: Q0+Q1, Q2+Q3]
      t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0xDD));
    const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
    const __m512 term = _mm512_mul_ps(sum, _mm512_set1_ps(weight));
    if (nr == 16) {
      _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), term));
      return;
    }
    alignas(64) float o[16];
    _mm512_store_ps(o, term);
#endif
    for (int r = 0; r < nr; ++r) out[r] += o[r];
  }
#endif
};

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
  return true;
#endif
}
