// bf16 experts: gate_up [E, 2I, H], down [E, H, I], both bf16, row-major.
// Banks (slots): 0 gate_up, 1 down. Ragged H and I allowed (scalar tails).
// Tiers: scalar; avx2 and avx512f widen bf16 to fp32 (x prepared as fp32), avx512bf16 feeds vdpbf16ps with
// bf16 x: one rows x tokens template (dot_rt, 4 independent chains per pair) serves all three; a lone token
// runs 4 (gate_up) or 2 (down) rows per pass, several tokens share each decoded row vector. amx runs 16-row x
// 16-token tile products (bf16_amx.h).
#include "bf16_rows.h"  // Lanes, dot_rt, the prefetch knobs

// Rows in flight for one token (avx2): gate_up 2 (gate and up of row i) or 4 (also row i + half of the item);
// down 2 or 4 far-apart output rows. gate_up 4: 3459-4419 us per step against 3702-4740 with 2 (Zen 3, 2 threads);
// down 4 is not faster.
#ifndef CPUMOE_BF16_GROWS
#define CPUMOE_BF16_GROWS 4
#endif
#ifndef CPUMOE_BF16_DROWS
#define CPUMOE_BF16_DROWS 2
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

CPUMOE_INLINE const uint16_t* row_of(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row, int* K) {
  *K = pass == 0 ? k->params.hidden : k->params.inter;
  return bank_row<uint16_t>(banks[pass], e, row);
}

// The row dot of every tier: NT tokens against one row (dot_rt<1, NT>), or the scalar loop.
struct Dot {
  static constexpr bool kRoundGateUp = false, kRoundRouteTerm = false;
#if CPUMOE_TIER == CPUMOE_T_SCALAR
  static constexpr int kMaxNT = 1;
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  static constexpr int kMaxNT = 3;
#else
  static constexpr int kMaxNT = 4;
#endif
  template <int NT>
  static void dotn(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row,
                   const void* const* acts, float* out) {
    int K;
    const uint16_t* w = row_of(k, banks, pass, e, row, &K);
#if CPUMOE_TIER == CPUMOE_T_SCALAR
    float s = 0.f;
    const float* x = (const float*)acts[0];
    for (int i = 0; i < K; ++i) s += bf16_to_f32(w[i]) * x[i];
    out[0] = s;
#else
    dot_rt<1, NT>(&w, K, (const Lanes::XT* const*)acts, out);
#endif
  }

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F || CPUMOE_TIER == CPUMOE_T_AVX512BF16 || \
    CPUMOE_TIER == CPUMOE_T_AMX
  // Down rows when I is tiny (rowmajor.h, SmallK): a row is one or two vectors (masked or zero-padded), its product with
  // the activation reduced together with kRowBlock - 1 neighbours by a transposing add tree. Each row's sum
  // order is fixed by its lanes alone (the tree is the same for every slot, missing rows are zeros), so a row
  // gives the same bits wherever its block starts: work splits and batches never change it.
#if CPUMOE_TIER == CPUMOE_T_AVX2
  static constexpr int kSmallK = 16, kRowBlock = 8;  // two 8-lane fp32 halves: w0*x0 + w1*x1 (one fma)
#elif CPUMOE_TIER == CPUMOE_T_AVX512BF16 || CPUMOE_TIER == CPUMOE_T_AMX
  static constexpr int kSmallK = 32, kRowBlock = 16;  // one vdpbf16ps of 32 bf16 pairs
#else
  static constexpr int kSmallK = 16, kRowBlock = 16;  // one 16-lane fp32 product
#endif
  // out[h - h0] += dot(down row h, act) * weight for h in [h0, h1): full blocks of kRowBlock rows, then one
  // block with the missing rows zero (their sums land in slots that are not stored).
  static void rows_acc(const cpumoe_kernel* k, const cpumoe_bank* banks, int e, int h0, int h1, const void* act,
                       float weight, float* out) {
    const int K = k->params.inter;
    const cpumoe_bank& b = banks[1];
    const char* base = (const char*)b.ptr + (int64_t)e * b.expert_stride;
    auto wrow = [&](int h) { return (const uint16_t*)(base + (int64_t)h * b.row_stride); };
#if CPUMOE_TIER == CPUMOE_T_AVX2
    alignas(32) float xp[16] = {};
    for (int i = 0; i < K; ++i) xp[i] = ((const float*)act)[i];
    const __m256 x0 = _mm256_load_ps(xp), x1 = _mm256_load_ps(xp + 8), wt = _mm256_set1_ps(weight);
    const bool direct = K % 8 == 0, two = K > 8;  // direct: the bank's rows hold whole 8-vectors
    alignas(32) uint16_t pad[8][16] = {};         // zero-padded copies of ragged rows (and zero rows)
    auto block = [&](int h, int nr) CPUMOE_LAMBDA_INLINE {  // -> 8 sums * weight of rows h .. h + 7 (rows >= nr zero)
      const uint16_t* p[8];
      const int64_t rs = b.row_stride / 2;  // in bf16 elements (rows are 2-byte aligned)
      if (direct && nr == 8) {              // the common case: straight from the bank, no pointer table
        const uint16_t* w = wrow(h);
        CPUMOE_UNROLL
        for (int r = 0; r < 8; ++r) p[r] = w + r * rs;
      } else {
        for (int r = 0; r < 8; ++r) {
          if (direct && r < nr) {
            p[r] = wrow(h + r);
          } else {
            for (int i = 0; i < 16; ++i) pad[r][i] = r < nr && i < K ? wrow(h + r)[i] : 0;
            p[r] = pad[r];
          }
        }
      }
      __m256 v[8];
      if (two) {
        CPUMOE_UNROLL
        for (int r = 0; r < 8; ++r) v[r] = _mm256_fmadd_ps(Lanes::w(p[r] + 8), x1, _mm256_mul_ps(Lanes::w(p[r]), x0));
      } else {
        CPUMOE_UNROLL
        for (int r = 0; r < 8; ++r) v[r] = _mm256_mul_ps(Lanes::w(p[r]), x0);
      }
      // each row's lanes l0..l7: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
      const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
      const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
      const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);  // rows 0-3 | 4-7, per half
      const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
      return _mm256_mul_ps(sum, wt);  // y * weight, then += (never fused)
    };
    int h = h0;
    for (; h + 8 <= h1; h += 8) _mm256_storeu_ps(out + (h - h0), _mm256_add_ps(_mm256_loadu_ps(out + (h - h0)), block(h, 8)));
    if (h < h1) {
      alignas(32) float o[8];
      _mm256_store_ps(o, block(h, h1 - h));
      for (int r = 0; r < h1 - h; ++r) out[h - h0 + r] += o[r];
    }
#else
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16 || CPUMOE_TIER == CPUMOE_T_AMX
    const __mmask32 m = K == 32 ? 0xFFFFFFFFu : (1u << K) - 1u;  // masked lanes read nothing, count 0
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, act);
    auto prod = [&](int h) { return _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_maskz_loadu_epi16(m, wrow(h)), xv); };
#else
    const __mmask16 m = (__mmask16)((1u << K) - 1u);
    const __m512 xv = _mm512_maskz_loadu_ps(m, act);
    auto prod = [&](int h) {
      return _mm512_mul_ps(
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, wrow(h))), 16)), xv);
    };
#endif
    const __m512 wt = _mm512_set1_ps(weight);
    auto block = [&](int h, int nr) CPUMOE_LAMBDA_INLINE {  // -> 16 sums * weight of rows h .. h + 15 (rows >= nr zero)
      __m512 v[16];
      if (nr == 16) {
        CPUMOE_UNROLL
        for (int r = 0; r < 16; ++r) v[r] = prod(h + r);
      } else {
        for (int r = 0; r < 16; ++r) v[r] = r < nr ? prod(h + r) : _mm512_setzero_ps();
      }
      // Per 128-bit quarter: ((l0 + l2) + (l1 + l3)); then quarters (Q0 + Q1) + (Q2 + Q3): the same for every row.
      __m512 s[8], q[4], t[2];
      CPUMOE_UNROLL
      for (int i = 0; i < 8; ++i)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
      CPUMOE_UNROLL
      for (int i = 0; i < 4; ++i) {  // rows 4i..4i+3 in each quarter
        const __m512d a = _mm512_castps_pd(s[2 * i]), c = _mm512_castps_pd(s[2 * i + 1]);
        q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, c)));
      }
      CPUMOE_UNROLL
      for (int i = 0; i < 2; ++i)  // [rows 8i..8i+3: Q0+Q1, Q2+Q3 | rows 8i+4..8i+7: Q0+Q1, Q2+Q3]
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0xDD));
      const __m512 sum =
          _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
      return _mm512_mul_ps(sum, wt);
    };
    int h = h0;
    for (; h + 16 <= h1; h += 16)
      _mm512_storeu_ps(out + (h - h0), _mm512_add_ps(_mm512_loadu_ps(out + (h - h0)), block(h, 16)));
    if (h < h1) {
      alignas(64) float o[16];
      _mm512_store_ps(o, block(h, h1 - h));
      for (int r = 0; r < h1 - h; ++r) out[h - h0 + r] += o[r];
    }
#endif
  }
#endif
};

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F || CPUMOE_TIER == CPUMOE_T_AVX512BF16
// gate_up: a lone token runs gate and up rows together: rows i and i + half of the item (CPUMOE_BF16_GROWS = 4:
// four streams) or row i alone (2: two streams); several tokens keep rowmajor.h's multi-token loop (each row
// decoded once per block of tokens).
void gate_up_lone(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
                  const void* const* xs, const float* w_in, uint16_t* const* g) {
  if (n != 1) return rowmajor_gate_up<Dot>(k, banks, e, i0, i1, n, xs, w_in, g);
  const cpumoe_params& p = k->params;
  ActSink sink(p);  // g in SIMD lanes (common.h)
  const Lanes::XT* x = (const Lanes::XT*)xs[0];
  auto emit = [&](int32_t i, float gate, float up) { sink.put(&g[0][i], gate * w_in[0], up * w_in[0]); };
  int32_t i = i0;
#if CPUMOE_BF16_GROWS == 4
  const int32_t half = (i1 - i0) / 2;
  for (; i < i0 + half; ++i) {
    const uint16_t* w[4] = {bank_row<uint16_t>(banks[0], e, i), bank_row<uint16_t>(banks[0], e, p.inter + i),
                            bank_row<uint16_t>(banks[0], e, i + half),
                            bank_row<uint16_t>(banks[0], e, p.inter + i + half)};
    float y[4];
    dot_rt<4, 1>(w, p.hidden, &x, y);
    emit(i, y[0], y[1]);
    emit(i + half, y[2], y[3]);
  }
  i = i0 + 2 * half;
#endif
  for (; i < i1; ++i) {
    const uint16_t* w[2] = {bank_row<uint16_t>(banks[0], e, i), bank_row<uint16_t>(banks[0], e, p.inter + i)};
    float y[2];
    dot_rt<2, 1>(w, p.hidden, &x, y);
    emit(i, y[0], y[1]);
  }
}

// down: an expert with one route runs R = CPUMOE_BF16_DROWS output rows far apart together, h + j (h1 - h0) / R:
// R weight streams. Measured on the Zen 3 dev VM (A/B in one process): adjacent row pairs were slower than one
// row at a time, far-apart pairs faster (the hardware prefetchers run independent streams). Rows left over run
// one at a time. An expert with several routes keeps rowmajor.h's multi-token loop.
void down_lone(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
               int32_t n, float* acc, int64_t acc_stride) {
  constexpr int R = CPUMOE_BF16_DROWS;
  const int K = k->params.inter;
  if (SmallK<Dot>::applies(k)) return rowmajor_down<Dot>(k, banks, h0, h1, routes, n, acc, acc_stride);  // tiny I
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
    const int32_t q = (h1 - h0) / R;
    for (int32_t h = h0; h < h0 + q; ++h) {
      const uint16_t* w[R];
      float y[R];
      CPUMOE_UNROLL
      for (int j = 0; j < R; ++j) w[j] = bank_row<uint16_t>(banks[1], r.expert, h + j * q);
      dot_rt<R, 1>(w, K, (const Lanes::XT* const*)&r.act, y);
      CPUMOE_UNROLL
      for (int j = 0; j < R; ++j) o[h + j * q] += y[j] * r.weight;
    }
    for (int32_t h = h0 + R * q; h < h1; ++h) {
      const uint16_t* w = bank_row<uint16_t>(banks[1], r.expert, h);
      float y;
      dot_rt<1, 1>(&w, K, (const Lanes::XT* const*)&r.act, &y);
      o[h] += y * r.weight;
    }
    a = b;
  }
}
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

#if CPUMOE_TIER == CPUMOE_T_AMX
#include "bf16_amx.h"
#endif

bool CPUMOE_INIT_FN(bf16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  (void)k;
  return false;  // no int8 variant: the tier below runs
#elif CPUMOE_TIER == CPUMOE_T_AMX
  k->act_bytes = &act_bytes_bf16;
  k->prep_act = &prep_act_bf16;
  k->gate_up = &amx::gate_up;
  k->down = &amx::down;
  k->block_hint = 32;  // work items in whole 16-row tiles
  return true;
#else
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
  k->act_bytes = &act_bytes_bf16;
  k->prep_act = &prep_act_bf16;
#else
  k->act_bytes = &act_bytes_f32;
  k->prep_act = &prep_act_f32;
#endif
  install_rowmajor<Dot>(k);
#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F || CPUMOE_TIER == CPUMOE_T_AVX512BF16
  k->gate_up = &gate_up_lone;
  k->down = &down_lone;
#endif
  return true;
#endif
}
