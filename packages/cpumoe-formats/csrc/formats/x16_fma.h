// fp32-FMA group dots of the pair-interleaved x16 layouts (bf16_x16, fp8_block_x16) for the tiers without
// vdpbf16ps: avx2 (__m256: a group's 16 rows as two halves of 8 lanes) and avx512f (__m512: a group a vector).
// docs/formats/bf16.md and fp8_block.md "avx2 and avx512f" have the measurements.
//
// The math is the scalar tier's, bit for bit (x16.h dp_step): per (row, token) two chains, c0 over the even K
// pairs and c1 over the odd ones, each pair as c = dp_step(w_odd, x_odd, c) then c = dp_step(w_even, x_even, c),
// dp_step(w, x, c) = daz(fma(w, daz(x), daz(c))), daz flushing |v| < FLT_MIN to a signed zero; then c0 + c1
// (fp8_block_x16: per 128-K block, then acc = fma(c0 + c1, scale, acc)). daz(x) is done once, in the activation
// record (fp32, subnormals flushed: prep_act_daz); daz(c) is the identity (c is 0 or a dp_step result). What is
// left is the flush of each fma result, and how it is done decides the cost:
//
// Fast pass: MXCSR = FTZ, every exception masked, round to nearest, DAZ off. An operation whose result is not
// tiny returns the IEEE result, normal or zero, which daz keeps: so where no operation of the call has a tiny
// result, the fast pass gives scalar's bits. FTZ sets the underflow flag (UE) on every result it flushes (Intel
// SDM vol. 1 "Flush-To-Zero"; AMD likewise, both seen in the tests), and only a flushed result can differ:
//   - x86 decides tininess after rounding (to 24 bits, exponent unbounded), so an exact result in
//     [FLT_MIN - 2^-150, FLT_MIN - 2^-151) (magnitude) is tiny and flushed to 0 while IEEE gradual underflow
//     rounds it up to FLT_MIN (the subnormal grid's spacing is 2^-149), which daz keeps: dp_step gives +-FLT_MIN
//     (tininess before rounding would flush all of [FLT_MIN - 2^-150, FLT_MIN) alike). bf16 products reach that
//     interval; e4m3 ones cannot (x >= 2^-126, |w| >= 2^-9: their bits stop at 2^-142), but c0 + c1 and the fp8
//     scale fma are plain operations whose subnormal results scalar keeps and FTZ flushes.
//   - DAZ would also read subnormal weights as zero, which dp_step does not (bf16 weights can be fp32
//     subnormals; e4m3 values cannot), so DAZ stays off and a subnormal weight enters the fma exactly.
// So a call runs the fast pass, and when UE is set after it, runs again in the exact pass over the same output.
//
// Exact pass: MXCSR = the IEEE default (no FTZ / DAZ), each fma result flushed explicitly (4 vector operations
// more per fma). Rare: it takes a result under FLT_MIN = 1.2e-38 somewhere in the call (a chain's first product
// that small, a cancellation to that, or a plain sum or scale product that small).
//
// MXCSR is per thread, so the executor's workers do not see each other's. A call saves the caller's, sets its
// own and restores the caller's before it returns (a scope object: every return path restores it); the caller's
// modes (its FTZ / DAZ, a rounding mode, unmasked exceptions) neither change the result nor trap here, and its
// sticky flags come back as they were.
#pragma once
#include "../x16.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
namespace x16fma {

constexpr unsigned kIeee = 0x1F80;         // MXCSR: all exceptions masked, round to nearest, no FTZ / DAZ, no flags
constexpr unsigned kFtz = kIeee | 0x8000;  // ... with flush-to-zero
constexpr unsigned kUnderflow = 0x10;      // the sticky underflow flag (UE)

struct Mxcsr {  // "memory" clobbers: the passes' loads come after a set, their stores before a get
  static CPUMOE_INLINE unsigned get() {
    unsigned v;
    __asm__ __volatile__("vstmxcsr %0" : "=m"(v) : : "memory");
    return v;
  }
  static CPUMOE_INLINE void set(unsigned v) { __asm__ __volatile__("vldmxcsr %0" : : "m"(v) : "memory"); }
  const unsigned saved = get();
  explicit Mxcsr(unsigned v) { set(v); }
  ~Mxcsr() { set(saved); }
};

// The activation record: x as fp32 with dp_step's daz(x) done (K floats).
inline void prep_act_daz(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  float* d = (float*)dst;
  for (int32_t i = 0; i < K; ++i) d[i] = x16::daz(bf16_to_f32(src[i]));
}
// ... for a layout whose weights decode to w / s (s = L::kXs, a power of two: fp8_block_x16), then x * s (K floats)
// and a flag: 1 when every |x| < 2^128 / s (a bf16 x under it times s is finite, and exact). Then w / s times x * s
// is w x exactly (the same real number, so every fma rounds and flushes alike) and the decode's multiply by s goes.
// (x * s only where the flag is set: no overflow to trap under a caller's unmasked exceptions.)
inline size_t act_bytes_xs(const cpumoe_kernel*, int32_t K) { return (size_t)K * 8 + 64; }
template <class L>
void prep_act_xs(const cpumoe_kernel* k, const uint16_t* src, int32_t K, void* dst) {
  prep_act_daz(k, src, K, dst);
  float* d = (float*)dst;
  const float lim = 0x1p127f / L::kXs * 2.f;
  bool ok = true;
  for (int32_t i = 0; i < K; ++i) ok &= !(std::fabs(d[i]) >= lim);  // NaN stays NaN, in range
  for (int32_t i = 0; i < K && ok; ++i) d[K + i] = d[i] * L::kXs;
  d[2 * K] = ok ? 1.f : 0.f;
}

#if CPUMOE_TIER == CPUMOE_T_AVX512F
using V = __m512;
constexpr int VL = 16, kMaxNT = 8, kAcc = 16;  // 32 zmm: up to 16 chain accumulators
CPUMOE_INLINE V vzero() { return _mm512_setzero_ps(); }
CPUMOE_INLINE V vset1(float f) { return _mm512_set1_ps(f); }
CPUMOE_INLINE V vload(const float* p) { return _mm512_loadu_ps(p); }
CPUMOE_INLINE void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
CPUMOE_INLINE V vadd(V a, V b) { return _mm512_add_ps(a, b); }
CPUMOE_INLINE V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
CPUMOE_INLINE V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }  // GCC folds a set1 b ({1to16})
CPUMOE_INLINE V flush(V c) {  // dp_step's daz: |c| < FLT_MIN -> c's sign bit alone (+-0)
  const __mmask16 m = _mm512_cmp_ps_mask(_mm512_abs_ps(c), vset1(FLT_MIN), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(c, m, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(c),
                                                                       _mm512_set1_epi32((int)0x80000000u))));
}
// The bf16 pairs of 16 rows at p (64 bytes: row r's even element in dword r's low half, its odd one in the high)
CPUMOE_INLINE void bf16_pairs(const uint8_t* p, V& even, V& odd) {
  const __m512i v = _mm512_loadu_si512((const void*)p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
#else
using V = __m256;
// 16 ymm: 8 chain accumulators, the rest weights and broadcasts (measured on Zen 3, docs/formats/bf16.md: 4
// tokens a pass over one half of 8 rows beat 3 over both halves (12 accumulators) and 5 or 6 over one (spills))
constexpr int VL = 8, kMaxNT = 4, kAcc = 8;
CPUMOE_INLINE V vzero() { return _mm256_setzero_ps(); }
CPUMOE_INLINE V vset1(float f) { return _mm256_set1_ps(f); }
CPUMOE_INLINE V vload(const float* p) { return _mm256_loadu_ps(p); }
CPUMOE_INLINE void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
CPUMOE_INLINE V vadd(V a, V b) { return _mm256_add_ps(a, b); }
CPUMOE_INLINE V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
CPUMOE_INLINE V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
CPUMOE_INLINE V flush(V c) {  // c ^ |c| is c's sign bit alone
  const V a = _mm256_and_ps(c, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  return _mm256_blendv_ps(c, _mm256_xor_ps(c, a), _mm256_cmp_ps(a, vset1(FLT_MIN), _CMP_LT_OQ));
}
CPUMOE_INLINE void bf16_pairs(const uint8_t* p, V& even, V& odd) {  // 8 rows (32 bytes)
  const __m256i v = _mm256_loadu_si256((const __m256i*)p);
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
#endif
constexpr int kHalves = x16::GR / VL;  // vectors per group

// c = dp_step(w, *x, c), x already daz'd and c a dp_step result
template <bool kExact>
CPUMOE_INLINE V step(V w, const float* x, V c) {
  c = vfma(w, vset1(*x), c);
  if constexpr (kExact) c = flush(c);
  return c;
}

// The most vector slots (a divisor of S) whose 2 NT chains each fit in kAcc registers, at least 1.
constexpr int slots_per_pass(int S, int NT) {
  int c = 1;
  for (int d = 2; d <= S; ++d)
    if (S % d == 0 && 2 * d * NT <= kAcc) c = d;
  return c;
}

// One pass of G groups x NT tokens into out (x16.h's order). L (the layout) gives:
//   kBlk        K per scaled block (fp8_block_x16: 128), or 0: one unscaled sum (bf16_x16)
//   kStep       bytes of a group per 4 K (2 K pairs)
//   kPf         the prefetch distance in a group stream
//   quad<kXs>(p, h, w)  the 4 K at p, slot h's rows: w[0], w[1] pair A's even and odd weights, w[2], w[3] pair
//                  B's, exact in fp32 (kXs: divided by kXs, x is times kXs); slot h's rows are VL h .. VL h + VL -
//                  1, or with kParity (avx2) the rows of parity h (2j + h in lane j), put in order at the end
//   kXs         0, or the power of two of prep_act_xs
//   scale(ref, b)  block b's scale (kBlk only)
// The 16 rows are kHalves vector slots per group; a pass over K takes C slots at once, 2 C NT accumulators
// (AVX2: a lone token's gate and up groups, both halves each, in one pass: 8 independent chains for the fma
// latency; 4 tokens: one half at a time, the second half's pass reading the lines again from L1/L2).
template <class L, int G, int NT, bool kExact, bool kXs>
CPUMOE_INLINE void pass(const typename L::Ref* gp, int K, const float* const* x, float* out) {
  constexpr int S = G * kHalves, C = slots_per_pass(S, NT);
  static_assert(NT <= kMaxNT, "tokens per pass");
  const int blk = L::kBlk ? L::kBlk : K;
  CPUMOE_UNROLL  // (a copy per slot chunk: g and h constants in the K loop)
  for (int s0 = 0; s0 < S; s0 += C)
    for (int o = 0; o < K; o += blk) {
      const int n = std::min(blk, K - o);  // a multiple of 16
      V c0[C][NT], c1[C][NT];
      CPUMOE_UNROLL
      for (int j = 0; j < C; ++j)
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) c0[j][t] = c1[j][t] = vzero();
      for (int k = o; k < o + n; k += 4) {
        CPUMOE_UNROLL
        for (int j = 0; j < C; ++j) {
          const int g = (s0 + j) / kHalves, h = (s0 + j) % kHalves;
          const uint8_t* p = gp[g].w + (size_t)k * (L::kStep / 4);
          if (h == 0) {  // the first half's pass brings the lines in
            CPUMOE_UNROLL
            for (int l = 0; l < L::kStep; l += 64) __builtin_prefetch(p + L::kPf + l, 0, 3);
          }
          V w[4];
          L::template quad<kXs>(p, h, w);
          CPUMOE_UNROLL
          for (int t = 0; t < NT; ++t) {
            const float* xk = x[t] + k;
            c0[j][t] = step<kExact>(w[1], xk + 1, c0[j][t]);
            c0[j][t] = step<kExact>(w[0], xk, c0[j][t]);
            c1[j][t] = step<kExact>(w[3], xk + 3, c1[j][t]);
            c1[j][t] = step<kExact>(w[2], xk + 2, c1[j][t]);
          }
        }
      }
      CPUMOE_UNROLL
      for (int j = 0; j < C; ++j) {
        const int g = (s0 + j) / kHalves, h = (s0 + j) % kHalves;
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          float* dst = out + (g * NT + t) * x16::GR + VL * h;
          const V v = vadd(c0[j][t], c1[j][t]);
          if constexpr (L::kBlk > 0)
            vstore(dst, vfma(v, vset1(L::scale(gp[g], o / L::kBlk)), o ? vload(dst) : vzero()));
          else
            vstore(dst, v);
        }
      }
    }
}

#if CPUMOE_TIER == CPUMOE_T_AVX2
// 16 results as the even rows then the odd ones -> in row order
CPUMOE_INLINE void unparity(float* o) {
  const V a = vload(o), b = vload(o + 8);
  const V lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);  // rows 0-3 | 8-11, 4-7 | 12-15
  vstore(o, _mm256_permute2f128_ps(lo, hi, 0x20));
  vstore(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}
#endif

// x16.h's groups: the fast pass, and the exact one where the fast one flushed a result.
template <class L, int G, int NT>
CPUMOE_INLINE void groups(const typename L::Ref* gp, int K, const void* const* act, float* out) {
  const float* x[NT];
  bool xs = L::kXs > 0;  // every token's x * kXs in range: those, and the weights' decode without its multiply
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) xs &= L::kXs > 0 && ((const float*)act[t])[2 * K] != 0.f;
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) x[t] = (const float*)act[t] + (xs ? K : 0);
  {
    const Mxcsr scope(kFtz);
    if (xs) pass<L, G, NT, false, true>(gp, K, x, out);
    else pass<L, G, NT, false, false>(gp, K, x, out);
    if (Mxcsr::get() & kUnderflow) {
      Mxcsr::set(kIeee);
      if (xs) pass<L, G, NT, true, true>(gp, K, x, out);
      else pass<L, G, NT, true, false>(gp, K, x, out);
    }
  }
#if CPUMOE_TIER == CPUMOE_T_AVX2
  if constexpr (L::kParity)
    for (int i = 0; i < G * NT; ++i) unparity(out + i * x16::GR);
#endif
}

}  // namespace x16fma
}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
