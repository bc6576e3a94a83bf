// fp8_block experts (DeepSeek-V3-style 128x128 block FP8; Qwen3.5/3.6-FP8).
//
// Banks (slots): 0 gate_up [E, 2I, H] e4m3, 1 gate_up_scale [E, nb(2I), >= nb(H)] bf16,
//                2 down [E, H, I] e4m3,    3 down_scale [E, nb(H), >= nb(I)] bf16,
// nb(n) = ceil(n / 128). Row-major weights (K contiguous per output row).
//   w[r, k] = e4m3(code[r, k]) * scale[r / 128][k / 128]   (the scale MULTIPLIES)
// The scale banks' last dim may be padded (16-byte rule of the reference), so a
// scale row is found through the bank view's row stride only; the padding
// columns are never read. Ragged H and I: partial 128-blocks and K tails.
// e4m3 decode follows common.h e4m3_to_f32: 0x7F/0xFF -> +-480, subnormals m*2^-9.
//
// Mode "native" only (W8A16). Tiers:
//   scalar      256-entry fp32 LUT, x as fp32.
//   avx2        fp16 bit trick: for a byte b, (b & 0x80) << 8 | (b & 0x7F) << 7 is the
//               fp16 encoding of e4m3(b) * 2^-8 (subnormals included, 0x7F -> 1.875), so
//               a 16-bit lane holding two codes gives the odd code's half by
//               srai(1) & 0xBF80 and the even code's by slli(8) first; vcvtph2ps
//               widens to fp32. x is prepared as de-interleaved fp32 halves
//               (xe[m] = x[2m], xo[m] = x[2m+1]). The 2^8 is applied once per row.
//   avx512f     the same with 512-bit vectors.
//   avx512bf16  e4m3 -> bf16 in-register (exact): bits = sign << 15 | ((code & 0x7F) << 4)
//               + (120 << 7); the exp == 0 lanes (zero and subnormals m*2^-9) come from
//               an 8-entry table via a masked vpermw; reduced by vdpbf16ps against bf16 x.
// Every SIMD tier sums each 128-K block in its own 4 accumulator chains and then
// adds block_sum * scale to the row total with one FMA per block.
#include <vector>

#include "../rowmajor.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int kBlk = 128;
CPUMOE_INLINE int nblocks(int n) { return (n + kBlk - 1) / kBlk; }

// Row `row` of the weight bank of `pass` (0: gate_up, K = H; 1: down, K = I) and its scale row.
struct RowRef {
  const uint8_t* w;
  const uint16_t* s;  // bf16 block scales of this row's 128-row block, one per 128-K block
  int K;
};
CPUMOE_INLINE RowRef row_ref(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row) {
  const cpumoe_bank& wb = banks[pass == 0 ? 0 : 2];
  const cpumoe_bank& sb = banks[pass == 0 ? 1 : 3];
  RowRef r;
  r.w = bank_row<uint8_t>(wb, e, row);
  r.s = bank_row<uint16_t>(sb, e, row / kBlk);  // stride from the view: padded columns are skipped
  r.K = pass == 0 ? k->params.hidden : k->params.inter;
  return r;
}

#if CPUMOE_TIER == CPUMOE_T_SCALAR
// ---------------------------------------------------------------- scalar
struct Lut {
  float v[256];
  Lut() {
    for (int b = 0; b < 256; ++b) v[b] = e4m3_to_f32((uint8_t)b);
  }
};
const Lut& lut() {
  static const Lut t;
  return t;
}

struct Dot {
  static constexpr bool kRoundGateUp = false, kRoundRouteTerm = false;
  static float dot(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row, const void* act) {
    const RowRef r = row_ref(k, banks, pass, e, row);
    const float* x = (const float*)act;
    const float* L = lut().v;
    float tot = 0.f;
    for (int b = 0, k0 = 0; k0 < r.K; ++b, k0 += kBlk) {
      const int k1 = r.K - k0 < kBlk ? r.K : k0 + kBlk;
      float s = 0.f;
      for (int i = k0; i < k1; ++i) s += L[r.w[i]] * x[i];
      tot += s * bf16_to_f32(r.s[b]);
    }
    return tot;
  }
};

void install(cpumoe_kernel* k) {
  (void)lut();  // build the table outside the hot loop
  k->act_bytes = &act_bytes_f32;
  k->prep_act = &prep_act_f32;
  install_rowmajor<Dot>(k);
}

#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
// ---------------------------------------------------------------- fp16 bit trick (fp32 FMA)
// Prepared activation: xe[0..P) then xo[0..P), P = 64 * nb(K) floats, zero padded,
// so a chunk that starts inside the row never reads x past the prepared vector.
//
// Block scales are folded into the activation, not into the dot: the rows of one
// 128-row block share one scale per K block, so for each (row block, token) the
// kernel forms xs = x * (256 * scale[row block][k / 128]) once (exact: bf16 x bf16
// fits fp32's 24 bits, and 256 is a power of two) and then every row of the block
// is a plain stream of FMAs with no per-block reduction. Products e4m3 * 2^-8 * xs
// are exact too (4 + 16 significant bits); only the fp32 sums round.
CPUMOE_INLINE size_t half_len(int32_t K) { return (size_t)64 * nblocks(K); }
size_t act_bytes_eo(const cpumoe_kernel*, int32_t K) { return 2 * half_len(K) * sizeof(float); }
void prep_act_eo(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  const size_t P = half_len(K);
  float* xe = (float*)dst;
  float* xo = xe + P;
  for (size_t m = 0; m < P; ++m) {
    const size_t i = 2 * m;
    xe[m] = i < (size_t)K ? bf16_to_f32(src[i]) : 0.f;
    xo[m] = i + 1 < (size_t)K ? bf16_to_f32(src[i + 1]) : 0.f;
  }
}
#ifndef CPUMOE_FP8_PF
#define CPUMOE_FP8_PF 1024  // software prefetch distance in the weight row (bytes; 0 = off)
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2
constexpr int kChunk = 32;  // codes per chunk: 16 even + 16 odd
using Vec = __m256;
CPUMOE_INLINE Vec vzero() { return _mm256_setzero_ps(); }
CPUMOE_INLINE Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
CPUMOE_INLINE float vhsum(Vec v) { return hsum256(v); }
// Scales P floats: dst[i] = src[i] * f[i / 64] (a block's 64 even or odd entries).
CPUMOE_INLINE void scale_half(const float* src, const float* f, int nb, float* dst) {
  for (int b = 0; b < nb; ++b) {
    const __m256 s = _mm256_set1_ps(f[b]);
    for (int i = 0; i < 64; i += 8) _mm256_storeu_ps(dst + 64 * b + i, _mm256_mul_ps(_mm256_loadu_ps(src + 64 * b + i), s));
  }
}
struct Acc {
  Vec a0, a1, a2, a3;
  CPUMOE_INLINE void zero() { a0 = a1 = a2 = a3 = vzero(); }
  CPUMOE_INLINE Vec sum() const { return vadd(vadd(a0, a1), vadd(a2, a3)); }
};
CPUMOE_INLINE void chunk_w(__m256i w, const float* xe, const float* xo, Acc& A) {
  const __m256i m = _mm256_set1_epi16((short)0xBF80);
  const __m256i od = _mm256_and_si256(_mm256_srai_epi16(w, 1), m);
  const __m256i ev = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), m);
  A.a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(ev)), _mm256_loadu_ps(xe), A.a0);
  A.a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(ev, 1)), _mm256_loadu_ps(xe + 8), A.a1);
  A.a2 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(od)), _mm256_loadu_ps(xo), A.a2);
  A.a3 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(od, 1)), _mm256_loadu_ps(xo + 8), A.a3);
}
CPUMOE_INLINE void chunk(const uint8_t* p, const float* xe, const float* xo, Acc& A) {
  chunk_w(_mm256_loadu_si256((const __m256i*)p), xe, xo, A);
}
// The last n < kChunk codes of a row: copied into a zeroed chunk (never reads past the row).
CPUMOE_INLINE void chunk_tail(const uint8_t* p, int n, const float* xe, const float* xo, Acc& A) {
  alignas(32) uint8_t t[kChunk] = {0};
  std::memcpy(t, p, (size_t)n);
  chunk_w(_mm256_load_si256((const __m256i*)t), xe, xo, A);
}
#else  // AVX512F
constexpr int kChunk = 64;  // codes per chunk: 32 even + 32 odd
using Vec = __m512;
CPUMOE_INLINE Vec vzero() { return _mm512_setzero_ps(); }
CPUMOE_INLINE Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
CPUMOE_INLINE float vhsum(Vec v) { return hsum512(v); }
CPUMOE_INLINE void scale_half(const float* src, const float* f, int nb, float* dst) {
  for (int b = 0; b < nb; ++b) {
    const __m512 s = _mm512_set1_ps(f[b]);
    for (int i = 0; i < 64; i += 16) _mm512_storeu_ps(dst + 64 * b + i, _mm512_mul_ps(_mm512_loadu_ps(src + 64 * b + i), s));
  }
}
struct Acc {
  Vec a0, a1, a2, a3;
  CPUMOE_INLINE void zero() { a0 = a1 = a2 = a3 = vzero(); }
  CPUMOE_INLINE Vec sum() const { return vadd(vadd(a0, a1), vadd(a2, a3)); }
};
CPUMOE_INLINE void chunk_w(__m512i w, const float* xe, const float* xo, Acc& A) {
  const __m512i m = _mm512_set1_epi16((short)0xBF80);
  const __m512i od = _mm512_and_si512(_mm512_srai_epi16(w, 1), m);
  const __m512i ev = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 1), m);
  A.a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(ev)), _mm512_loadu_ps(xe), A.a0);
  A.a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(ev, 1)), _mm512_loadu_ps(xe + 16), A.a1);
  A.a2 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(od)), _mm512_loadu_ps(xo), A.a2);
  A.a3 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(od, 1)), _mm512_loadu_ps(xo + 16), A.a3);
}
CPUMOE_INLINE void chunk(const uint8_t* p, const float* xe, const float* xo, Acc& A) {
  chunk_w(_mm512_loadu_si512(p), xe, xo, A);
}
CPUMOE_INLINE void chunk_tail(const uint8_t* p, int n, const float* xe, const float* xo, Acc& A) {
  const __mmask64 msk = (n >= 64) ? ~0ull : ((1ull << n) - 1ull);
  chunk_w(_mm512_maskz_loadu_epi8(msk, p), xe, xo, A);  // masked-off bytes are not read
}
#endif

// dot(row w of K codes, pre-scaled xs = [xe | xo] halves of length P).
CPUMOE_INLINE float dot_scaled(const uint8_t* w, int K, const float* xe, const float* xo) {
  Acc A, B;
  A.zero();
  B.zero();
  int c = 0;
  for (; c + 2 * kChunk <= K; c += 2 * kChunk) {  // two chunks, 8 independent chains
#if CPUMOE_FP8_PF
    CPUMOE_PREFETCH(w + c + CPUMOE_FP8_PF);
#if CPUMOE_TIER == CPUMOE_T_AVX512F
    CPUMOE_PREFETCH(w + c + CPUMOE_FP8_PF + 64);
#endif
#endif
    chunk(w + c, xe + c / 2, xo + c / 2, A);
    chunk(w + c + kChunk, xe + c / 2 + kChunk / 2, xo + c / 2 + kChunk / 2, B);
  }
  if (c + kChunk <= K) {
    chunk(w + c, xe + c / 2, xo + c / 2, A);
    c += kChunk;
  }
  if (c < K) chunk_tail(w + c, K - c, xe + c / 2, xo + c / 2, B);
  return vhsum(vadd(A.sum(), B.sum()));
}

// Per-thread scratch for the pre-scaled activations (grown on demand, reused).
float* scratch(size_t floats) {
  static thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// xs = x * 256 * scale row `srow` (nb(K) bf16 entries), both halves.
CPUMOE_INLINE void scale_act(const float* x, const uint16_t* srow, int K, float* xs) {
  const int nb = nblocks(K);
  const size_t P = half_len(K);
  float f[64];
  for (int b0 = 0; b0 < nb; b0 += 64) {
    const int m = nb - b0 < 64 ? nb - b0 : 64;
    for (int b = 0; b < m; ++b) f[b] = bf16_to_f32(srow[b0 + b]) * 256.f;  // 2^8 undoes the fp16 trick's 2^-8
    scale_half(x + 64 * b0, f, m, xs + 64 * b0);
    scale_half(x + P + 64 * b0, f, m, xs + P + 64 * b0);
  }
}

void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  const cpumoe_params& p = k->params;
  const int H = p.hidden, I = p.inter;
  const size_t P = half_len(H);
  float* sx = scratch((size_t)n * 4 * P);  // token j: gate xs at 4Pj, up xs at 4Pj + 2P
  for (int i = i0; i < i1;) {
    // a segment of rows whose gate rows share a row block and whose up rows share one
    const int rg = i / kBlk, ru = (I + i) / kBlk;
    int iend = (rg + 1) * kBlk;
    if ((ru + 1) * kBlk - I < iend) iend = (ru + 1) * kBlk - I;
    if (i1 < iend) iend = i1;
    const uint16_t* sg = bank_row<uint16_t>(banks[1], e, rg);
    const uint16_t* su = bank_row<uint16_t>(banks[1], e, ru);
    for (int j = 0; j < n; ++j) {
      scale_act((const float*)xs[j], sg, H, sx + 4 * P * j);
      scale_act((const float*)xs[j], su, H, sx + 4 * P * j + 2 * P);
    }
    for (; i < iend; ++i) {
      const uint8_t* wg = bank_row<uint8_t>(banks[0], e, i);
      const uint8_t* wu = bank_row<uint8_t>(banks[0], e, I + i);
      for (int j = 0; j < n; ++j) {
        const float* xg = sx + 4 * P * j;
        const float* xu = xg + 2 * P;
        const float gate = dot_scaled(wg, H, xg, xg + P) * w_in[j];
        const float up = dot_scaled(wu, H, xu, xu + P) * w_in[j];
        g[j][i] = f32_to_bf16(activate(p, gate, up));
      }
    }
  }
}

void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  const int I = k->params.inter;
  const size_t P = half_len(I);
  for (int a = 0; a < n;) {
    int b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int e = routes[a].expert;
    float* sx = scratch((size_t)(b - a) * 2 * P);
    for (int h = h0; h < h1;) {
      const int rb = h / kBlk;
      const int hend = (rb + 1) * kBlk < h1 ? (rb + 1) * kBlk : h1;
      const uint16_t* srow = bank_row<uint16_t>(banks[3], e, rb);
      for (int r = a; r < b; ++r) scale_act((const float*)routes[r].act, srow, I, sx + 2 * P * (r - a));
      for (; h < hend; ++h) {
        const uint8_t* w = bank_row<uint8_t>(banks[2], e, h);
        for (int r = a; r < b; ++r) {
          const float* x = sx + 2 * P * (r - a);
          acc[routes[r].token * acc_stride + (h - h0)] += dot_scaled(w, I, x, x + P) * routes[r].weight;
        }
      }
    }
    a = b;
  }
}

void install(cpumoe_kernel* k) {
  k->act_bytes = &act_bytes_eo;
  k->prep_act = &prep_act_eo;
  k->gate_up = &gate_up;
  k->down = &down;
}

#elif CPUMOE_TIER == CPUMOE_T_AVX512BF16
// ---------------------------------------------------------------- e4m3 -> bf16, vdpbf16ps
// Prepared activation: bf16 x zero padded to 128 * nb(K) elements.
CPUMOE_INLINE size_t pad_len(int32_t K) { return (size_t)kBlk * nblocks(K); }
size_t act_bytes_bf16p(const cpumoe_kernel*, int32_t K) { return pad_len(K) * sizeof(uint16_t); }
void prep_act_bf16p(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  std::memcpy(dst, src, (size_t)K * sizeof(uint16_t));
  std::memset((uint16_t*)dst + K, 0, (pad_len(K) - (size_t)K) * sizeof(uint16_t));
}
constexpr int kPfBytes = 768;

// bf16 bits of m * 2^-9 for m = 0..7 (the exp == 0 codes), indexed by the code's low 5 bits.
struct SubTable {
  uint16_t v[32];
  SubTable() {
    for (int i = 0; i < 32; ++i) v[i] = f32_to_bf16((float)(i & 7) * 0.001953125f);
  }
};
const SubTable& sub_table() {
  static const SubTable t;
  return t;
}

// 32 codes -> 32 bf16 (exact), natural order.
CPUMOE_INLINE __m512i widen(__m256i codes, __m512i tbl) {
  const __m512i w = _mm512_cvtepu8_epi16(codes);
  const __m512i mag = _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x07F0));
  __m512i v = _mm512_add_epi16(mag, _mm512_set1_epi16(120 << 7));
  const __mmask32 sub = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));  // exp field == 0
  v = _mm512_mask_permutexvar_epi16(v, sub, w, tbl);                            // idx = low 5 bits = m
  // v | (sign bit): (w << 8) & 0x8000
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(w, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}
CPUMOE_INLINE __m512 dp(__m512 a, __m512i wv, const uint16_t* x) {
  return _mm512_dpbf16_ps(a, (__m512bh)wv, (__m512bh)_mm512_loadu_si512(x));
}

struct Dot {
  static constexpr bool kRoundGateUp = false, kRoundRouteTerm = false;
  static float dot(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row, const void* act) {
    const RowRef r = row_ref(k, banks, pass, e, row);
    const uint16_t* x = (const uint16_t*)act;
    const __m512i tbl = _mm512_loadu_si512(sub_table().v);
    const int nfull = r.K / kBlk;
    __m512 tot = _mm512_setzero_ps();
    for (int b = 0; b < nfull; ++b) {
      const uint8_t* w = r.w + b * kBlk;
      const uint16_t* xb = x + b * kBlk;
      CPUMOE_PREFETCH(w + kPfBytes);
      CPUMOE_PREFETCH(w + kPfBytes + 64);
      const __m512 zero = _mm512_setzero_ps();
      __m512 a0 = dp(zero, widen(_mm256_loadu_si256((const __m256i*)w), tbl), xb);
      __m512 a1 = dp(zero, widen(_mm256_loadu_si256((const __m256i*)(w + 32)), tbl), xb + 32);
      __m512 a2 = dp(zero, widen(_mm256_loadu_si256((const __m256i*)(w + 64)), tbl), xb + 64);
      __m512 a3 = dp(zero, widen(_mm256_loadu_si256((const __m256i*)(w + 96)), tbl), xb + 96);
      const __m512 s = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
      tot = _mm512_fmadd_ps(s, _mm512_set1_ps(bf16_to_f32(r.s[b])), tot);
    }
    const int rem = r.K - nfull * kBlk;
    if (rem) {  // partial last block, 32 codes at a time, masked (x is zero padded)
      const uint8_t* w = r.w + nfull * kBlk;
      const uint16_t* xb = x + nfull * kBlk;
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < rem; c += 32) {
        const __mmask32 m = rem - c >= 32 ? 0xFFFFFFFFu : ((1u << (rem - c)) - 1u);
        a = dp(a, widen(_mm256_maskz_loadu_epi8(m, w + c), tbl), xb + c);
      }
      tot = _mm512_fmadd_ps(a, _mm512_set1_ps(bf16_to_f32(r.s[nfull])), tot);
    }
    return hsum512(tot);
  }
};

void install(cpumoe_kernel* k) {
  (void)sub_table();
  k->act_bytes = &act_bytes_bf16p;
  k->prep_act = &prep_act_bf16p;
  install_rowmajor<Dot>(k);
}
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(fp8_block)(cpumoe_kernel* k) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  (void)k;
  return false;  // no int8 variant: the tier below runs
#else
  if (k->params.mode != CPUMOE_MODE_NATIVE) return false;
  cpumoe::CPUMOE_NS::install(k);
  return true;
#endif
}
