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
//   scalar      256-entry fp32 LUT, x as fp32; per 128-K block sum * scale.
//   avx2        bias-free bf16 patterns: (b & 0x80) << 8 | (b & 0x7F) << 4 is the bf16 of
//               e4m3(b) * 2^-120 for every code; 9 integer ops per 32 codes, no conversion.
//   avx512f     fp16 bit trick: (b & 0x80) << 8 | (b & 0x7F) << 7 is the fp16 of
//               e4m3(b) * 2^-8 (subnormals included), widened by vcvtph2ps.
//               Both fold the block scales (and the 2^120 / 2^8) into a per-(row block,
//               token) pre-scaled activation, so a row is a plain FMA stream (see below).
//   amx         e4m3 -> bf16 A tiles, bf16 activations as B, per 128-K block C * scale (fp8_block_amx.h):
//               a shared expert's batch costs little more than one token.
//   avx512bf16  e4m3 -> exact bf16 by byte tables (vpermt2b), bf16 activations, vdpbf16ps: half the multiply-adds
//               of avx512f and no conversion; per 128-K block partial sums * scale (fp8_block_bf16.h). Auto
//               picks it on AMD only (registry.cpp: slower than avx512f at batch 1 on the Xeon measured). The byte
//               tables cost ~7 ops per 64 codes where a word-wise decode (masked vpermw for the exp == 0 codes)
//               costs ~20.
#include <vector>

#include "../rowmajor.h"
#include "fp8_block_decode.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the AVX-512 intrinsics' internal _mm512_undefined_* operands as (maybe-)uninitialized (a known
// false positive of the headers, not of this code).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

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
// ---------------------------------------------------------------- fp32 FMA tiers
// Block scales are folded into the activation, not into the dot: the rows of one
// 128-row block share one scale per K block, so per (row block, token) the kernel
// forms xs = x * scale[row block][k / 128] * 2^c once, in the layout the decoder
// wants (exact: bf16 x bf16 fits fp32's 24 bits and 2^c is a power of two), and every
// row of the block is then a plain stream of FMAs (4 chains per row and token, see dot_grid) and no
// per-block reduction. Each product is exact (4 significant bits x 16) and equals
// w * x * 2^(c - e) where the decoder yields e4m3 * 2^-e; only the fp32 sums round.
//
// Two decoders (fp8_block_decode.h, shared with fp8_block_x16; CPUMOE_FP8_FP16 picks; avx2 defaults to the
// first, avx512f to the second):
//
// bf16 patterns (e = 120): for a code b, (b & 0x80) << 8 | (b & 0x7F) << 4 is the bf16
//   encoding of e4m3(b) * 2^-120 for EVERY code: normals get exponent field E, E == 0 gives
//   the subnormal m * 2^-129 = (m * 2^-9) * 2^-120, 0x7F gives 480 * 2^-120. In a 16-bit lane
//   holding two codes (odd << 8 | even), srai(4) & 0x87F0 builds the odd code's pattern and
//   slli(8) first the even one's; in each 32-bit lane the low pattern becomes fp32 by << 16
//   and the high one by & 0xFFFF0000: 9 integer ops and no conversion for 4 fp32 vectors of
//   codes 4i, 4i+1, 4i+2, 4i+3, so x is prepared as four de-interleaved fp32 streams
//   xq[j][m] = x[4m + j]. c = 120 unless max|x| * max(scale) >= 2^7 (xs would overflow);
//   then c is lowered and the dot multiplied by 2^(120 - c). Subnormal codes are fp32
//   subnormal inputs to the FMA (exact, never FTZ/DAZ; free on AMD Zen, an FP assist on
//   some Intel cores, which is why avx512f defaults to the fp16 decoder).
// fp16 patterns (e = 8, the seed's trick): (b & 0x80) << 8 | (b & 0x7F) << 7 is the fp16
//   encoding of e4m3(b) * 2^-8 (subnormals included, 0x7F -> 1.875), so srai(1) & 0xBF80
//   builds the odd code's half and slli(8) first the even one's; vcvtph2ps widens them
//   (exact, hardware handles the fp16 subnormals). x is prepared as even/odd fp32 halves
//   xe[m] = x[2m], xo[m] = x[2m+1]; c = 8.
#ifndef CPUMOE_FP8_FP16
#if CPUMOE_TIER == CPUMOE_T_AVX512F
#define CPUMOE_FP8_FP16 1
#else
#define CPUMOE_FP8_FP16 0
#endif
#endif
// Software prefetch distance in the weight row (bytes; 0 = off) and __builtin_prefetch locality (0 = nta, 3 = t0).
// avx512f 1 KB t0: 97% of the single-thread read ceiling against 72% without (H200 host); avx2 4 KB nta: 74%
// against 51% (Zen 3). Build knobs (bench/device/kernel_sweep.sh).
#ifndef CPUMOE_FP8_PF
#define CPUMOE_FP8_PF (CPUMOE_TIER == CPUMOE_T_AVX2 ? 4096 : 1024)
#endif
#ifndef CPUMOE_FP8_PF_LOC
#define CPUMOE_FP8_PF_LOC (CPUMOE_TIER == CPUMOE_T_AVX2 ? 0 : 3)
#endif
// Rows in flight for one token (batch 1): a lone route's down rows run DROWS at a time (h, h + q, h + 2q, ...,
// q = rows of the block / DROWS: weight streams far apart), a lone token's gate_up GROWS rows (gate and up of
// row i, then also of i + half the segment). More streams, more memory-level parallelism for one core: 4 / 4 rows
// read 72% of the single-thread ceiling against 52% with 1 / 2 (H200 host, avx512f). AVX2 has 16 registers: 4 rows
// x 4 chains would spill, so it keeps pairs.
#ifndef CPUMOE_FP8_DROWS
#define CPUMOE_FP8_DROWS (CPUMOE_TIER == CPUMOE_T_AVX2 ? 2 : 4)
#endif
#ifndef CPUMOE_FP8_GROWS
#define CPUMOE_FP8_GROWS (CPUMOE_TIER == CPUMOE_T_AVX2 ? 2 : 4)
#endif

// ---- ISA primitives
#if CPUMOE_TIER == CPUMOE_T_AVX2
constexpr int kChunk = 32;  // codes per chunk (one 256-bit load)
constexpr int VL = 8;       // floats per vector
using Vec = __m256;
using WVec = __m256i;
CPUMOE_INLINE Vec vzero() { return _mm256_setzero_ps(); }
CPUMOE_INLINE Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
CPUMOE_INLINE Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
CPUMOE_INLINE Vec vset1(float f) { return _mm256_set1_ps(f); }
CPUMOE_INLINE Vec vload(const float* p) { return _mm256_loadu_ps(p); }
CPUMOE_INLINE void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
CPUMOE_INLINE Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
CPUMOE_INLINE float vhsum(Vec v) { return hsum256(v); }
CPUMOE_INLINE WVec wload(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
// the last n < kChunk codes of a row, zero extended (never reads past the row)
CPUMOE_INLINE WVec wload_tail(const uint8_t* p, int n) {
  alignas(32) uint8_t t[kChunk] = {0};
  std::memcpy(t, p, (size_t)n);
  return _mm256_load_si256((const __m256i*)t);
}
#else  // AVX512F (+BW)
constexpr int kChunk = 64;
constexpr int VL = 16;
using Vec = __m512;
using WVec = __m512i;
CPUMOE_INLINE Vec vzero() { return _mm512_setzero_ps(); }
CPUMOE_INLINE Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
CPUMOE_INLINE Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
CPUMOE_INLINE Vec vset1(float f) { return _mm512_set1_ps(f); }
CPUMOE_INLINE Vec vload(const float* p) { return _mm512_loadu_ps(p); }
CPUMOE_INLINE void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
CPUMOE_INLINE Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
CPUMOE_INLINE float vhsum(Vec v) { return hsum512(v); }
CPUMOE_INLINE WVec wload(const uint8_t* p) { return _mm512_loadu_si512(p); }
CPUMOE_INLINE WVec wload_tail(const uint8_t* p, int n) {  // masked-off bytes are not read
  return _mm512_maskz_loadu_epi8(n >= 64 ? ~0ull : ((1ull << n) - 1ull), p);
}
#endif

struct Acc {
  Vec a0, a1, a2, a3;
  CPUMOE_INLINE void zero() { a0 = a1 = a2 = a3 = vzero(); }
  CPUMOE_INLINE Vec sum() const { return vadd(vadd(a0, a1), vadd(a2, a3)); }
};

// ---- decoder families: act layout, activation prep, scaling, one chunk of the dot
#if CPUMOE_FP8_FP16
// Layout: xe[0..P) then xo[0..P), P = 64 nb(K), zero padded.
constexpr int kStreams = 2, kPerBlock = 64;
CPUMOE_INLINE size_t slen(int32_t K) { return (size_t)kPerBlock * nblocks(K); }
CPUMOE_INLINE size_t act_len(int32_t K) { return kStreams * slen(K); }
size_t act_bytes_v(const cpumoe_kernel*, int32_t K) { return act_len(K) * sizeof(float); }
void prep_act_v(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  const size_t P = slen(K);
  float* x = (float*)dst;
  for (size_t m = 0; m < P; ++m)
    for (size_t j = 0; j < 2; ++j) {
      const size_t i = 2 * m + j;
      x[j * P + m] = i < (size_t)K ? bf16_to_f32(src[i]) : 0.f;
    }
}
CPUMOE_INLINE float scale_factor(const float*, const uint16_t*, int, float* two_c) {
  *two_c = 256.f;  // undoes the decoder's 2^-8
  return 1.f;
}
constexpr int kXStep = kChunk / 2;  // stream entries per chunk
// kChunk codes -> 4 weight vectors (fp8_block_decode.h); vector c multiplies x + xoff(c, S) (stream stride S).
CPUMOE_INLINE void decode4(WVec w, Vec* v) { fp8dec::fp16_decode4(w, v); }
CPUMOE_INLINE size_t xoff(int c, size_t S) { return (c >> 1) * S + (c & 1) * VL; }
#else
// Layout: 4 streams of Q = 32 nb(K) floats, zero padded, then max|x| (for the guard).
constexpr int kStreams = 4, kPerBlock = 32;
CPUMOE_INLINE size_t slen(int32_t K) { return (size_t)kPerBlock * nblocks(K); }
CPUMOE_INLINE size_t act_len(int32_t K) { return kStreams * slen(K) + 16; }
size_t act_bytes_v(const cpumoe_kernel*, int32_t K) { return act_len(K) * sizeof(float); }
void prep_act_v(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  const size_t Q = slen(K);
  float* x = (float*)dst;
  float amax = 0.f;
  for (size_t m = 0; m < Q; ++m)
    for (size_t j = 0; j < 4; ++j) {
      const size_t i = 4 * m + j;
      const float v = i < (size_t)K ? bf16_to_f32(src[i]) : 0.f;
      x[j * Q + m] = v;
      amax = std::fabs(v) > amax ? std::fabs(v) : amax;
    }
  x[4 * Q] = amax;
}
// Picks c: 2^c goes into xs, the returned 2^(120 - c) multiplies the dot.
CPUMOE_INLINE float scale_factor(const float* x, const uint16_t* srow, int K, float* two_c) {
  const int nb = nblocks(K);
  float smax = 0.f;
  for (int b = 0; b < nb; ++b) {
    const float s = std::fabs(bf16_to_f32(srow[b]));
    smax = s > smax ? s : smax;
  }
  const float amax = x[4 * slen(K)] > 1.f ? x[4 * slen(K)] : 1.f;
  const float m = amax * smax;  // >= max |x * s| and >= max |s|
  int shift = 0;                // c = 120 - shift
  if (m >= 128.f) shift = std::ilogb(m) - 6;  // then m * 2^c < 2^127
  *two_c = std::ldexp(1.f, 120 - shift);
  return std::ldexp(1.f, shift);
}
constexpr int kXStep = kChunk / 4;  // stream entries per chunk
// kChunk codes -> 4 weight vectors; vector c multiplies x + xoff(c, S) (stream stride S).
CPUMOE_INLINE void decode4(WVec w, Vec* v) { fp8dec::bf16p_decode4(w, v); }  // fp8_block_decode.h
CPUMOE_INLINE size_t xoff(int c, size_t S) { return (size_t)c * S; }
#endif

// The micro-kernel: out[r][t] = dot(row w[r] of K codes, pre-scaled activation x[r][t]) for an R x NT grid of
// (row, token) pairs. Each chunk of a row is decoded ONCE and FMA'd into the NT tokens' accumulators. Every
// (row, token) pair has its own 4 chains (chunk vector c -> chain c, the tail chunk included), reduced as
// (a0 + a1) + (a2 + a3): the arithmetic of a pair does not depend on R, NT or its neighbours, so gate_up /
// down may group rows and tokens freely and a token's result never depends on its batch. Grid size:
// R * NT <= kGrid (AVX2: 8 of 16 ymm accumulate; AVX-512: 16 of 32 zmm).
#if CPUMOE_TIER == CPUMOE_T_AVX2
constexpr int kGrid = 2;
#else
constexpr int kGrid = 4;
#endif
template <int R, int NT>
CPUMOE_INLINE void dot_grid(const uint8_t* const* w, int K, const float* const (*x)[NT], float (*out)[NT]) {
  const size_t S = slen(K);
  Vec A[R][NT][4];
  CPUMOE_UNROLL
  for (int r = 0; r < R; ++r)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) A[r][t][0] = A[r][t][1] = A[r][t][2] = A[r][t][3] = vzero();
  auto step = [&](int o, size_t xo, auto load) {
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      Vec v[4];
      decode4(load(w[r] + o), v);
      CPUMOE_UNROLL
      for (int c = 0; c < 4; ++c)
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) A[r][t][c] = vfma(v[c], vload(x[r][t] + xo + xoff(c, S)), A[r][t][c]);
    }
  };
  int o = 0;
  size_t xo = 0;
  for (; o + kChunk <= K; o += kChunk, xo += kXStep) {
#if CPUMOE_FP8_PF
#if CPUMOE_TIER == CPUMOE_T_AVX2
    if (!((K - o) & 63))  // one prefetch per cache line and row
#endif
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) __builtin_prefetch(w[r] + o + CPUMOE_FP8_PF, 0, CPUMOE_FP8_PF_LOC);
#endif
    step(o, xo, [](const uint8_t* p) { return wload(p); });
  }
  if (o < K) step(o, xo, [&](const uint8_t* p) { return wload_tail(p, K - o); });
  CPUMOE_UNROLL
  for (int r = 0; r < R; ++r)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) out[r][t] = vhsum(vadd(vadd(A[r][t][0], A[r][t][1]), vadd(A[r][t][2], A[r][t][3])));
}

// One row against nt <= kGrid tokens (x[t]), through the grid kernel of that size.
template <int NT = kGrid>
CPUMOE_INLINE void dot_row_tokens(const uint8_t* w, int K, int nt, const float* const* x, float* out) {
  if constexpr (NT > 1) {
    if (nt < NT) return dot_row_tokens<NT - 1>(w, K, nt, x, out);
  }
  const float* xg[1][NT];
  float o[1][NT];
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) xg[0][t] = x[t];
  dot_grid<1, NT>(&w, K, xg, o);
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) out[t] = o[0][t];
}
// Two rows against one token (x0 for w0, x1 for w1): the batch-1 shape, two streams in flight.
CPUMOE_INLINE void dot_rows2(const uint8_t* w0, const uint8_t* w1, int K, const float* x0, const float* x1, float* r0,
                             float* r1) {
  const uint8_t* w[2] = {w0, w1};
  const float* x[2][1] = {{x0}, {x1}};
  float o[2][1];
  dot_grid<2, 1>(w, K, x, o);
  *r0 = o[0][0], *r1 = o[1][0];
}

// xs = x * scale row `srow` (nb(K) bf16 entries) * 2^c in every stream; returns the
// factor the dot must be multiplied by.
CPUMOE_INLINE float scale_act(const float* x, const uint16_t* srow, int K, float* xs) {
  float two_c;
  const float post = scale_factor(x, srow, K, &two_c);
  const int nb = nblocks(K);
  const size_t S = slen(K);
  for (int b = 0; b < nb; ++b) {
    const Vec f = vset1(bf16_to_f32(srow[b]) * two_c);
    for (int j = 0; j < kStreams; ++j) {
      const float* a = x + j * S + (size_t)kPerBlock * b;
      float* d = xs + j * S + (size_t)kPerBlock * b;
      for (int i = 0; i < kPerBlock; i += VL) vstore(d + i, vmul(vload(a + i), f));
    }
  }
  return post;
}

// Per-thread scratch for the pre-scaled activations (grown on demand, reused).
float* scratch(size_t floats) {
  static thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  const cpumoe_params& p = k->params;
  ActSink sink(p);  // g in SIMD lanes (common.h)
  const int H = p.hidden, I = p.inter;
  const size_t L = act_len(H);
  float* sx = scratch((size_t)n * 2 * (L + 1));  // token j: gate xs at 2Lj, up xs at 2Lj + L
  float* post = sx + (size_t)n * 2 * L;          // then 2n factors (post * w_in)
  for (int i = i0; i < i1;) {
    // a segment of rows whose gate rows share a row block and whose up rows share one
    const int rg = i / kBlk, ru = (I + i) / kBlk;
    int iend = (rg + 1) * kBlk;
    if ((ru + 1) * kBlk - I < iend) iend = (ru + 1) * kBlk - I;
    if (i1 < iend) iend = i1;
    const uint16_t* sg = bank_row<uint16_t>(banks[1], e, rg);
    const uint16_t* su = bank_row<uint16_t>(banks[1], e, ru);
    for (int j = 0; j < n; ++j) {
      post[2 * j] = scale_act((const float*)xs[j], sg, H, sx + 2 * L * j) * w_in[j];
      post[2 * j + 1] = scale_act((const float*)xs[j], su, H, sx + 2 * L * j + L) * w_in[j];
    }
#if CPUMOE_FP8_GROWS == 4
    if (n == 1) {  // a lone token: gate and up of rows i and i + q together, four weight streams
      const int q = (iend - i) / 2;
      for (const int is = i; i < is + q; ++i) {
        const uint8_t* w[4] = {bank_row<uint8_t>(banks[0], e, i), bank_row<uint8_t>(banks[0], e, I + i),
                               bank_row<uint8_t>(banks[0], e, i + q), bank_row<uint8_t>(banks[0], e, I + i + q)};
        const float* x[4][1] = {{sx}, {sx + L}, {sx}, {sx + L}};
        float o[4][1];
        dot_grid<4, 1>(w, H, x, o);
        sink.put(&g[0][i], o[0][0] * post[0], o[1][0] * post[1]);
        sink.put(&g[0][i + q], o[2][0] * post[0], o[3][0] * post[1]);
      }
      i += q;  // at most one row left
    }
#endif
    if (n > kGrid) {  // several token blocks: row chunks (rowmajor.h), so a block's activations stay in L1
      gate_up_row_chunks<kGrid>(
          i, iend, I, n,
          [&](int32_t row, int32_t j0, int nt, float* out) {
            const float* x[kGrid];
            for (int t = 0; t < nt; ++t) x[t] = sx + 2 * L * (j0 + t) + (row >= I ? L : 0);
            dot_row_tokens(bank_row<uint8_t>(banks[0], e, row), H, nt, x, out);
          },
          [&](int32_t r, int32_t j, float gt, float ut) { sink.put(&g[j][r], gt * post[2 * j], ut * post[2 * j + 1]); });
      i = iend;
      continue;
    }
    for (; i < iend; ++i) {
      const uint8_t* wg = bank_row<uint8_t>(banks[0], e, i);
      const uint8_t* wu = bank_row<uint8_t>(banks[0], e, I + i);
      for (int j0 = 0; j0 < n;) {
        float gate[kGrid], up[kGrid];
        int nt = n - j0 < kGrid ? n - j0 : kGrid;
        if (nt == 1) {  // a lone token: its gate and up rows together
          dot_rows2(wg, wu, H, sx + 2 * L * j0, sx + 2 * L * j0 + L, gate, up);
        } else {  // a token block: each row chunk decoded once for nt tokens
          const float* xg[kGrid];
          const float* xu[kGrid];
          for (int t = 0; t < nt; ++t) xg[t] = sx + 2 * L * (j0 + t), xu[t] = xg[t] + L;
          dot_row_tokens(wg, H, nt, xg, gate);
          dot_row_tokens(wu, H, nt, xu, up);
        }
        for (int t = 0; t < nt; ++t, ++j0)
          sink.put(&g[j0][i], gate[t] * post[2 * j0], up[t] * post[2 * j0 + 1]);
      }
    }
  }
}

void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  const int I = k->params.inter;
  const size_t L = act_len(I);
  for (int a = 0; a < n;) {
    int b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int e = routes[a].expert;
    float* sx = scratch((size_t)(b - a) * (L + 1));  // route r: xs at L(r - a)
    float* post = sx + (size_t)(b - a) * L;           // then the factors (post * weight)
    for (int h = h0; h < h1;) {
      const int rb = h / kBlk;
      const int hend = (rb + 1) * kBlk < h1 ? (rb + 1) * kBlk : h1;
      const uint16_t* srow = bank_row<uint16_t>(banks[3], e, rb);
      for (int r = a; r < b; ++r)
        post[r - a] = scale_act((const float*)routes[r].act, srow, I, sx + L * (r - a)) * routes[r].weight;
      const int nr = b - a;
#if CPUMOE_FP8_DROWS > 1
      if (nr == 1) {  // a lone route: rows h + j q (j < DROWS) in one pass, weight streams far apart
        // (AVX2 pairs: on the Zen 3 dev VM ~+5 points of the read ceiling over one row at a time; adjacent
        // pairs were not)
        constexpr int D = CPUMOE_FP8_DROWS;
        const int q = (hend - h) / D;
        const float* x[D][1];
        CPUMOE_UNROLL
        for (int j = 0; j < D; ++j) x[j][0] = sx;
        for (const int hs = h; h < hs + q; ++h) {
          const uint8_t* w[D];
          float y[D][1];
          CPUMOE_UNROLL
          for (int j = 0; j < D; ++j) w[j] = bank_row<uint8_t>(banks[2], e, h + j * q);
          dot_grid<D, 1>(w, I, x, y);
          float* o = acc + routes[a].token * acc_stride + (h - h0);
          CPUMOE_UNROLL
          for (int j = 0; j < D; ++j) o[j * q] += y[j][0] * post[0];
        }
        h += (D - 1) * q;  // at most D - 1 rows left
      }
#endif
      for (; h < hend; ++h) {  // each row chunk decoded once per block of routes
        const uint8_t* w = bank_row<uint8_t>(banks[2], e, h);
        for (int r0 = 0; r0 < nr; r0 += kGrid) {
          const int nt = nr - r0 < kGrid ? nr - r0 : kGrid;
          const float* xr[kGrid];
          float y[kGrid];
          for (int t = 0; t < nt; ++t) xr[t] = sx + L * (r0 + t);
          dot_row_tokens(w, I, nt, xr, y);
          for (int t = 0; t < nt; ++t) acc[routes[a + r0 + t].token * acc_stride + (h - h0)] += y[t] * post[r0 + t];
        }
      }
      h = hend;
    }
    a = b;
  }
}

void install(cpumoe_kernel* k) {
  k->act_bytes = &act_bytes_v;
  k->prep_act = &prep_act_v;
  k->gate_up = &gate_up;
  k->down = &down;
}

#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

#if CPUMOE_TIER == CPUMOE_T_AMX
#include "fp8_block_amx.h"
#elif CPUMOE_TIER == CPUMOE_T_AVX512BF16
#include "fp8_block_bf16.h"
#endif

bool CPUMOE_INIT_FN(fp8_block)(cpumoe_kernel* k) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  (void)k;
  return false;  // no int8 variant: avx2 / avx512f runs
#elif CPUMOE_TIER == CPUMOE_T_AVX512BF16 || CPUMOE_TIER == CPUMOE_T_AMX  // bf16 activations, byte-table decode
  if (k->params.mode != CPUMOE_MODE_NATIVE) return false;
  k->act_bytes = &cpumoe::CPUMOE_NS::act_bytes_bf16;
  k->prep_act = &cpumoe::CPUMOE_NS::prep_act_bf16;
#if CPUMOE_TIER == CPUMOE_T_AMX
  k->gate_up = &cpumoe::CPUMOE_NS::amx8::gate_up;
  k->down = &cpumoe::CPUMOE_NS::amx8::down;
  k->block_hint = 32;  // work items in whole 16-row tiles
#else
  k->gate_up = &cpumoe::CPUMOE_NS::bf8::gate_up;
  k->down = &cpumoe::CPUMOE_NS::bf8::down;
#endif
  return true;
#else
  if (k->params.mode != CPUMOE_MODE_NATIVE) return false;
  cpumoe::CPUMOE_NS::install(k);
  return true;
#endif
}
