// mxfp4 experts (gpt-oss / Triton "mxfp4_triton"): transposed split-K, N innermost.
//
// Banks (slots): 0 gate_up_blocks [E, H/2, 2I] u8, 1 gate_up_scales [E, H/32, 2I] e8m0,
// 2 gate_up_bias [E, 2I] bf16, 3 down_blocks [E, I/2, H] u8, 4 down_scales [E, I/32, H] e8m0,
// 5 down_bias [E, H] bf16. Blocks row kb holds K-pair kb of every column (low nibble K = 2kb,
// high nibble K = 2kb+1); scales row kb/16 covers 32 K. gate/up are interleaved by column
// (2j gate, 2j+1 up). w = E2M1[code] * 2^(min(s,254) - 127), s = 0 -> 2^-127 exactly.
//
// Kernel: a GEMV over a column tile. K-pair rows outer, column accumulators inner (fp32);
// each 16-row scale group is summed into group accumulators which are then multiplied by
// the column's scale and added to the tile's totals. The tokens of a work item share each
// weight read (accumulators per token; tokens in groups for register room).
//
// SIMD decode (avx2: 32 columns per 256-bit load, avx512f: 64 per 512-bit load, the same
// template): nibbles -> two pshufb LUTs giving the high and low byte of the code's bf16 bits
// (e2m1 values are exact bf16) -> byte unpack to bf16 words -> even columns = word << 16, odd
// columns = word & 0xFFFF0000 (fp32). The unpacks leave columns in a per-128-bit-lane order
// (lane_col below); the scales are expanded the same way and the totals are un-permuted once
// per tile. Columns that do not fill a vector (work items not on 32-column boundaries) run
// through the scalar tile.
//
// Mode w4a8 (int8 activations per 32 K, see the w4a8 sections below): prep_act quantizes each
// 32-K block (s_b = amax/127, q = clamp(rint(x/s_b))), the avx2 tile decodes nibbles with one
// vpshufb per nibble into signed int8 2*E2M1 (the sign of q folded into the LUT per row) and
// multiplies with vpmaddubsw: about 12 simple ops per 32 columns x 2 K instead of ~27.
//
// Tiles span a whole work item (kMaxCols = 512 columns: a 256-row gate_up item), walked group by
// group; the blocks rows and the scale rows are software-prefetched 32 rows / 2 groups ahead.
#include "../rowmajor.h"

#if defined(__GNUC__) && !defined(__clang__) && CPUMOE_TIER >= CPUMOE_T_AVX512F
// GCC 12's avx512fintrin.h self-initialises _mm512_undefined_*(): false -Wuninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int kGroupRows = 16;  // K-pair rows per e8m0 scale (32 K)
constexpr int kMaxCols = 512;   // columns per tile pass (stack accumulators)
constexpr int kMaxTok = 4;      // tokens per tile pass
constexpr int kW8Ncv = 2;  // 32-column vectors per w4a8 chunk
constexpr int kPrefetchRows = 32;  // K rows ahead (row stride = N bytes): ~100-200 ns of DRAM latency
constexpr int kPrefetchGroups = kPrefetchRows / 16;  // scale rows ahead

// Fully unroll the compile-time loops over vectors and tokens so accumulators live in registers.
#define MX_UNROLL _Pragma("GCC unroll 16")
#define MX_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 3)

struct Tile {
  const uint8_t* blk;  // blocks row 0 at the tile's first column
  int64_t bs;          // bytes between K-pair rows
  const uint8_t* scl;  // scales row 0 at the tile's first column
  int64_t ss;          // bytes between scale rows
  int nkp;             // K / 2
};

// Output of one tile pass: out[t * kMaxCols + c], natural column order.

// Scalar tile (the scalar tier, and column tails of the SIMD tiers): columns [c0, c0+nc).
void tile_scalar(const Tile& T, int c0, int nc, int nt, const float* const* xs, float* out) {
  float gacc[kMaxCols];
  for (int t = 0; t < nt; ++t) {
    const float* x = xs[t];
    float* o = out + t * kMaxCols + c0;
    for (int c = 0; c < nc; ++c) o[c] = 0.f;
    for (int g = 0; g < T.nkp / kGroupRows; ++g) {
      for (int c = 0; c < nc; ++c) gacc[c] = 0.f;
      for (int r = 0; r < kGroupRows; ++r) {
        const int kb = g * kGroupRows + r;
        const uint8_t* row = T.blk + kb * T.bs + c0;
        const float x0 = x[2 * kb], x1 = x[2 * kb + 1];
        for (int c = 0; c < nc; ++c) {
          gacc[c] += kE2M1[row[c] & 15] * x0;
          gacc[c] += kE2M1[row[c] >> 4] * x1;
        }
      }
      const uint8_t* srow = T.scl + g * T.ss + c0;
      for (int c = 0; c < nc; ++c) o[c] += gacc[c] * e8m0_to_f32(srow[c]);
    }
  }
}

// ---- w4a8: activations quantized to int8 per 32-K block (the e8m0 scale block) -----------------
// Prepared vector of length K: K/2 entries of 16 bytes, entry kb = K-pair (2kb, 2kb+1):
//   bytes 0-3 |q0| |q1| |q0| |q1| (vpmaddubsw's unsigned operand, a dword broadcast),
//   bytes 4-7 q0 x4, bytes 8-11 q1 x4 (vpsignb of the weight LUT), 12-15 zero;
// then float sb[K/32]. Quantization (fp32, as q4_0's Q8_0): sb = amax / 127, id = 1 / sb (0 where
// not finite: amax == 0, or 1/sb overflows), q = clamp(rint(x * id), -127, 127), half to even.
// Per group (16 K-pair rows) and column: the exact integer S = sum(2*E2M1[code] * q) (weights as
// int8 in {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12}), then tot += (float)S * ((e8m0 * 0.5f) * sb),
// with mul then add in every tier (bit-identical scalar and avx2).
constexpr int kW8Entry = 16;
size_t act_bytes_w8(const cpumoe_kernel*, int32_t K) { return (size_t)K / 2 * kW8Entry + (size_t)K / 32 * 4; }

CPUMOE_INLINE float w8_inv(float d) {
  const float id = 1.0f / d;
  return id <= std::numeric_limits<float>::max() ? id : 0.0f;  // also NaN
}

void prep_act_w8(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  uint8_t* e = (uint8_t*)dst;
  float* sb = (float*)(e + (size_t)K / 2 * kW8Entry);
  for (int32_t b = 0; b < K / 32; ++b) {
    float x[32], amax = 0.0f;
    for (int j = 0; j < 32; ++j) {
      x[j] = bf16_to_f32(src[32 * b + j]);
      const float a = std::fabs(x[j]);
      amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = w8_inv(d);
    sb[b] = d;
    for (int j = 0; j < 32; j += 2) {
      int8_t q[2];
      for (int i = 0; i < 2; ++i) {
        const float v = std::nearbyint(x[j + i] * id);  // round half to even (default rounding mode)
        q[i] = (int8_t)(!(v >= -127.0f) ? -127 : (v > 127.0f ? 127 : (int)v));
      }
      uint8_t* o = e + (size_t)(16 * b + j / 2) * kW8Entry;
      const uint8_t a0 = (uint8_t)(q[0] < 0 ? -q[0] : q[0]), a1 = (uint8_t)(q[1] < 0 ? -q[1] : q[1]);
      o[0] = a0, o[1] = a1, o[2] = a0, o[3] = a1;
      for (int i = 4; i < 8; ++i) o[i] = (uint8_t)q[0];
      for (int i = 8; i < 12; ++i) o[i] = (uint8_t)q[1];
      for (int i = 12; i < 16; ++i) o[i] = 0;
    }
  }
}

// 2 * E2M1[code] as int8.
alignas(16) constexpr int8_t kW2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

CPUMOE_INLINE float e8m0_half(uint8_t s) { return e8m0_to_f32(s) * 0.5f; }  // exact: >= 2^-128

void tile_scalar_w8(const Tile& T, int c0, int nc, int nt, const uint8_t* const* as, float* out) {
  const int ng = T.nkp / kGroupRows;
  for (int t = 0; t < nt; ++t) {
    const uint8_t* a = as[t];
    const float* sb = (const float*)(a + (size_t)T.nkp * kW8Entry);
    float* o = out + t * kMaxCols + c0;
    for (int c = 0; c < nc; ++c) o[c] = 0.f;
    for (int g = 0; g < ng; ++g) {
      int32_t S[kMaxCols];
      for (int c = 0; c < nc; ++c) S[c] = 0;
      for (int r = 0; r < kGroupRows; ++r) {
        const int kb = g * kGroupRows + r;
        const uint8_t* row = T.blk + kb * T.bs + c0;
        const int q0 = (int8_t)a[kb * kW8Entry + 4], q1 = (int8_t)a[kb * kW8Entry + 8];
        for (int c = 0; c < nc; ++c) S[c] += kW2[row[c] & 15] * q0 + kW2[row[c] >> 4] * q1;
      }
      const uint8_t* srow = T.scl + g * T.ss + c0;
      for (int c = 0; c < nc; ++c) o[c] += (float)S[c] * (e8m0_half(srow[c]) * sb[g]);
    }
  }
}

// bf16 bits of E2M1[code], split into the high and low byte (pshufb tables).
alignas(16) constexpr uint8_t kLutHi[16] = {0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                            0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0};
alignas(16) constexpr uint8_t kLutLo[16] = {0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0,
                                            0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0};

#if CPUMOE_TIER >= CPUMOE_T_AVX2
struct V256 {
  using F = __m256;
  using I = __m256i;
  static constexpr int W = 32;  // columns (bytes) per load
  static CPUMOE_INLINE I load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static CPUMOE_INLINE I lut(const uint8_t* t) { return _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)t)); }
  static CPUMOE_INLINE I set1_8(int v) { return _mm256_set1_epi8((char)v); }
  static CPUMOE_INLINE I set1_32(int v) { return _mm256_set1_epi32(v); }
  static CPUMOE_INLINE I zero() { return _mm256_setzero_si256(); }
  static CPUMOE_INLINE I band(I a, I b) { return _mm256_and_si256(a, b); }
  static CPUMOE_INLINE I srl4(I a) { return _mm256_srli_epi16(a, 4); }
  static CPUMOE_INLINE I shuf(I t, I i) { return _mm256_shuffle_epi8(t, i); }
  static CPUMOE_INLINE I ulo8(I a, I b) { return _mm256_unpacklo_epi8(a, b); }
  static CPUMOE_INLINE I uhi8(I a, I b) { return _mm256_unpackhi_epi8(a, b); }
  static CPUMOE_INLINE I sll16(I a) { return _mm256_slli_epi32(a, 16); }
  static CPUMOE_INLINE I minu8(I a, int v) { return _mm256_min_epu8(a, _mm256_set1_epi8((char)v)); }
  static CPUMOE_INLINE F cast(I a) { return _mm256_castsi256_ps(a); }
  static CPUMOE_INLINE F fzero() { return _mm256_setzero_ps(); }
  static CPUMOE_INLINE F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // dwords holding s << 24 (s in [0, 254]) -> 2^(s-127); s = 0 -> 2^-127 (0x00400000)
  static CPUMOE_INLINE F e8m0(I d) {
    const I z = _mm256_cmpeq_epi32(d, _mm256_setzero_si256());
    return cast(_mm256_or_si256(_mm256_srli_epi32(d, 1), _mm256_and_si256(z, _mm256_set1_epi32(0x00400000))));
  }
};
#endif


#if CPUMOE_TIER >= CPUMOE_T_AVX512F
struct V512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int W = 64;
  static CPUMOE_INLINE I load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
  static CPUMOE_INLINE I lut(const uint8_t* t) { return _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)t)); }
  static CPUMOE_INLINE I set1_8(int v) { return _mm512_set1_epi8((char)v); }
  static CPUMOE_INLINE I set1_32(int v) { return _mm512_set1_epi32(v); }
  static CPUMOE_INLINE I zero() { return _mm512_setzero_si512(); }
  static CPUMOE_INLINE I band(I a, I b) { return _mm512_and_si512(a, b); }
  static CPUMOE_INLINE I srl4(I a) { return _mm512_srli_epi16(a, 4); }
  static CPUMOE_INLINE I shuf(I t, I i) { return _mm512_shuffle_epi8(t, i); }
  static CPUMOE_INLINE I ulo8(I a, I b) { return _mm512_unpacklo_epi8(a, b); }
  static CPUMOE_INLINE I uhi8(I a, I b) { return _mm512_unpackhi_epi8(a, b); }
  static CPUMOE_INLINE I sll16(I a) { return _mm512_slli_epi32(a, 16); }
  static CPUMOE_INLINE I minu8(I a, int v) { return _mm512_min_epu8(a, _mm512_set1_epi8((char)v)); }
  static CPUMOE_INLINE F cast(I a) { return _mm512_castsi512_ps(a); }
  static CPUMOE_INLINE F fzero() { return _mm512_setzero_ps(); }
  static CPUMOE_INLINE F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static CPUMOE_INLINE F e8m0(I d) {
    const __mmask16 z = _mm512_cmpeq_epi32_mask(d, _mm512_setzero_si512());
    return cast(_mm512_mask_mov_epi32(_mm512_srli_epi32(d, 1), z, _mm512_set1_epi32(0x00400000)));
  }
};
#endif

#if CPUMOE_TIER >= CPUMOE_T_AVX2
// Column of lane l of vector q (0..3) within one load of W columns: the byte unpacks
// interleave per 128-bit lane (16 columns), the word split takes even then odd columns.
CPUMOE_INLINE int lane_col(int q, int l) { return 16 * (l / 4) + 8 * (q / 2) + 2 * (l % 4) + (q % 2); }

// Four fp32 vectors from 4-bit codes (one per byte, 0..15), vector q lane l = lane_col(q, l).
// Bytes hi/lo of the code's bf16 bits -> words (column order within the 128-bit lane) ->
// even columns = word << 16, odd columns = word & 0xFFFF0000.
template <class V>
CPUMOE_INLINE void decode4(typename V::I codes, typename V::I lh, typename V::I ll, typename V::I mhi,
                           typename V::F* w) {
  using I = typename V::I;
  const I hi = V::shuf(lh, codes), lo = V::shuf(ll, codes);
  const I w0 = V::ulo8(lo, hi), w1 = V::uhi8(lo, hi);  // bf16 words
  w[0] = V::cast(V::sll16(w0));
  w[1] = V::cast(V::band(w0, mhi));
  w[2] = V::cast(V::sll16(w1));
  w[3] = V::cast(V::band(w1, mhi));
}

// nch chunks of NCV*W columns starting at column c0, for NT tokens. The chunks are walked
// group by group (16 K-pair rows of every chunk, then the next group), so a work item wider
// than one chunk still reads its rows once, as whole contiguous runs.
template <class V, int NCV, int NT>
void tile_simd(const Tile& T, int c0, int nch, const float* const* xs, float* out) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int W = V::W, NV = 4 * NCV, L = W / 4, CW = NCV * W;  // L = fp32 lanes per vector
  const I m0f = V::set1_8(0x0F), lh = V::lut(kLutHi), ll = V::lut(kLutLo), mhi = V::set1_32((int)0xFFFF0000u);
  F tot[NT][kMaxCols / L];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < nch * NV; ++v) tot[t][v] = V::fzero();
  const uint8_t* blk = T.blk + c0;
  const uint8_t* scl = T.scl + c0;
  const int64_t pfd = kPrefetchRows * T.bs;
  const bool unaligned = (((uintptr_t)blk | (uintptr_t)T.bs) & 63) != 0;  // chunks straddle lines
  const bool unaligned_s = (((uintptr_t)scl | (uintptr_t)T.ss) & 63) != 0;
  for (int r = 0; r < kPrefetchRows && r < T.nkp; ++r)  // prologue: the first rows of every chunk
    for (int o = 0; o < nch * CW; o += 64) MX_PREFETCH(blk + r * T.bs + o);
  for (int g = 0; g < kPrefetchGroups && g < T.nkp / kGroupRows; ++g)  // and the first scale rows
    for (int o = 0; o < nch * CW + 63; o += 64) MX_PREFETCH(scl + g * T.ss + o);
  const int ng = T.nkp / kGroupRows;
  for (int g = 0; g < ng; ++g) {
    const int kb0 = g * kGroupRows;
    for (int ch = 0; ch < nch; ++ch) {
      F acc[NT][NV];
      MX_UNROLL
      for (int t = 0; t < NT; ++t)
        MX_UNROLL
        for (int v = 0; v < NV; ++v) acc[t][v] = V::fzero();
      const uint8_t* p = blk + (int64_t)kb0 * T.bs + ch * CW;
      for (int r = 0; r < kGroupRows; ++r, p += T.bs) {
        MX_UNROLL
        for (int o = 0; o < CW; o += 64) MX_PREFETCH(p + pfd + o);
        if (CW % 64 == 0 && unaligned) MX_PREFETCH(p + pfd + CW - 1);  // the tile may not start on a line
        const int kb = kb0 + r;
        F x0[NT], x1[NT];
        MX_UNROLL
        for (int t = 0; t < NT; ++t) x0[t] = V::bcast(xs[t] + 2 * kb), x1[t] = V::bcast(xs[t] + 2 * kb + 1);
        MX_UNROLL
        for (int c = 0; c < NCV; ++c) {
          const I b = V::load(p + c * W);
          F w[4];
          decode4<V>(V::band(b, m0f), lh, ll, mhi, w);
          MX_UNROLL
          for (int t = 0; t < NT; ++t)
            MX_UNROLL
            for (int q = 0; q < 4; ++q) acc[t][4 * c + q] = V::fma(w[q], x0[t], acc[t][4 * c + q]);
          decode4<V>(V::band(V::srl4(b), m0f), lh, ll, mhi, w);
          MX_UNROLL
          for (int t = 0; t < NT; ++t)
            MX_UNROLL
            for (int q = 0; q < 4; ++q) acc[t][4 * c + q] = V::fma(w[q], x1[t], acc[t][4 * c + q]);
        }
      }
      // Scales in the same lane order: byte s -> word s << 8 -> dword s << 24 -> e8m0.
      const uint8_t* sp = scl + (int64_t)g * T.ss + ch * CW;
      if (g + kPrefetchGroups < ng) {  // the scale row kPrefetchGroups groups ahead (its own strided stream)
        MX_PREFETCH(sp + kPrefetchGroups * T.ss);
        if (CW > 64 || unaligned_s) MX_PREFETCH(sp + kPrefetchGroups * T.ss + CW - 1);
      }
      MX_UNROLL
      for (int c = 0; c < NCV; ++c) {
        const I s = V::minu8(V::load(sp + c * W), 254), z = V::zero();
        const I s0 = V::ulo8(z, s), s1 = V::uhi8(z, s);
        const F sc[4] = {V::e8m0(V::sll16(s0)), V::e8m0(V::band(s0, mhi)), V::e8m0(V::sll16(s1)),
                         V::e8m0(V::band(s1, mhi))};
        MX_UNROLL
        for (int t = 0; t < NT; ++t)
          MX_UNROLL
          for (int q = 0; q < 4; ++q) {
            F& d = tot[t][ch * NV + 4 * c + q];
            d = V::fma(acc[t][4 * c + q], sc[q], d);
          }
      }
    }
  }
  alignas(64) float tmp[L];
  for (int t = 0; t < NT; ++t)
    for (int ch = 0; ch < nch; ++ch)
      MX_UNROLL
      for (int c = 0; c < NCV; ++c)
        MX_UNROLL
        for (int q = 0; q < 4; ++q) {
          V::store(tmp, tot[t][ch * NV + 4 * c + q]);
          float* o = out + t * kMaxCols + c0 + ch * CW + c * W;
          MX_UNROLL
          for (int l = 0; l < L; ++l) o[lane_col(q, l)] = tmp[l];
        }
}

// Columns [c, nc) that fill whole vectors of V; returns the first column not done.
template <class V, int NTG>
int tile_run(const Tile& T, int c, int nc, int nt, const float* const* xs, float* out) {
  constexpr int W = V::W;
  static_assert(NTG >= 2 && NTG <= 4, "token group");
  if (nt == 1 && nc - c >= 2 * W) {  // one token: two vectors' worth of columns per chunk
    const int nch = (nc - c) / (2 * W);
    tile_simd<V, 2, 1>(T, c, nch, xs, out);
    c += nch * 2 * W;
  }
  if (nc - c >= W) {
    const int nch = (nc - c) / W;
    int t = 0;
    for (; t + NTG <= nt; t += NTG) tile_simd<V, 1, NTG>(T, c, nch, xs + t, out + t * kMaxCols);
    float* o = out + t * kMaxCols;
    switch (nt - t) {
      case 1: tile_simd<V, 1, 1>(T, c, nch, xs + t, o); break;
      case 2: tile_simd<V, 1, NTG >= 3 ? 2 : 1>(T, c, nch, xs + t, o); break;
      case 3: tile_simd<V, 1, NTG >= 4 ? 3 : 1>(T, c, nch, xs + t, o); break;
      default: break;
    }
    c += nch * W;
  }
  return c;
}

// ---- w4a8 avx2 tile -------------------------------------------------------------------------------
// Per K-pair row and 32 columns: nibbles -> vpshufb of the signed int8 LUT 2*E2M1 with the sign of
// the token's q0 (low nibbles) / q1 (high nibbles) folded in (vpsignb, once per row) -> vpunpck{l,h}bw
// to (w_lo, w_hi) byte pairs per column -> vpmaddubsw against the broadcast pair (|q0|, |q1|): one
// int16 per column, |.| <= 2*12*127 = 3048. Rows 0-7 and 8-15 of a group are summed in int16
// (<= 24384) and combined into int32 by vpunpck{l,h}wd + vpmaddwd(1). Lane order of the 4 int32
// vectors of a 32-column load: vector q, lane l = column 16*(l/4) + 4q + l%4 (w8_col).
CPUMOE_INLINE int w8_col(int q, int l) { return 16 * (l / 4) + 4 * q + (l % 4); }

template <int NCV, int NT>
void tile_w8(const Tile& T, int c0, int nch, const uint8_t* const* as, float* out) {
  constexpr int CW = 32 * NCV, NV = 4 * NCV;
  const __m256i m0f = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kW2));
  const float* sb[NT];
  for (int t = 0; t < NT; ++t) sb[t] = (const float*)(as[t] + (size_t)T.nkp * kW8Entry);
  __m256 tot[NT][kMaxCols / 8];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < nch * NV; ++v) tot[t][v] = _mm256_setzero_ps();
  const uint8_t* blk = T.blk + c0;
  const uint8_t* scl = T.scl + c0;
  const int64_t pfd = kPrefetchRows * T.bs;
  const bool unaligned = (((uintptr_t)blk | (uintptr_t)T.bs) & 63) != 0;  // chunks straddle lines
  const bool unaligned_s = (((uintptr_t)scl | (uintptr_t)T.ss) & 63) != 0;
  for (int r = 0; r < kPrefetchRows && r < T.nkp; ++r)  // prologue: the first rows of every chunk
    for (int o = 0; o < nch * CW; o += 64) MX_PREFETCH(blk + r * T.bs + o);
  for (int g = 0; g < kPrefetchGroups && g < T.nkp / kGroupRows; ++g)  // and the first scale rows
    for (int o = 0; o < nch * CW + 63; o += 64) MX_PREFETCH(scl + g * T.ss + o);
  const int ng = T.nkp / kGroupRows;
  for (int g = 0; g < ng; ++g) {
    const int kb0 = g * kGroupRows;
    for (int ch = 0; ch < nch; ++ch) {
      __m256i half[2][NT][2 * NCV];
      const uint8_t* p = blk + (int64_t)kb0 * T.bs + ch * CW;
      MX_UNROLL
      for (int h = 0; h < 2; ++h) {
        __m256i acc[NT][2 * NCV];
        MX_UNROLL
        for (int t = 0; t < NT; ++t)
          MX_UNROLL
          for (int v = 0; v < 2 * NCV; ++v) acc[t][v] = _mm256_setzero_si256();
        for (int r = 0; r < kGroupRows / 2; ++r, p += T.bs) {
          MX_UNROLL
          for (int o = 0; o < CW; o += 64) MX_PREFETCH(p + pfd + o);
          if (CW % 64 == 0 && unaligned) MX_PREFETCH(p + pfd + CW - 1);
          const int kb = kb0 + 8 * h + r;
          __m256i lo[NCV], hi[NCV];
          MX_UNROLL
          for (int c = 0; c < NCV; ++c) {
            const __m256i b = _mm256_loadu_si256((const __m256i*)(p + c * 32));
            lo[c] = _mm256_and_si256(b, m0f);
            hi[c] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m0f);
          }
          MX_UNROLL
          for (int t = 0; t < NT; ++t) {
            const int32_t* e = (const int32_t*)(as[t] + (size_t)kb * kW8Entry);
            const __m256i ap = _mm256_set1_epi32(e[0]);
            const __m256i l0 = _mm256_sign_epi8(lut, _mm256_set1_epi32(e[1]));
            const __m256i l1 = _mm256_sign_epi8(lut, _mm256_set1_epi32(e[2]));
            MX_UNROLL
            for (int c = 0; c < NCV; ++c) {
              const __m256i wl = _mm256_shuffle_epi8(l0, lo[c]), wh = _mm256_shuffle_epi8(l1, hi[c]);
              acc[t][2 * c] = _mm256_add_epi16(acc[t][2 * c], _mm256_maddubs_epi16(ap, _mm256_unpacklo_epi8(wl, wh)));
              acc[t][2 * c + 1] =
                  _mm256_add_epi16(acc[t][2 * c + 1], _mm256_maddubs_epi16(ap, _mm256_unpackhi_epi8(wl, wh)));
            }
          }
        }
        MX_UNROLL
        for (int t = 0; t < NT; ++t)
          MX_UNROLL
          for (int v = 0; v < 2 * NCV; ++v) half[h][t][v] = acc[t][v];
      }
      const uint8_t* sp = scl + (int64_t)g * T.ss + ch * CW;
      if (g + kPrefetchGroups < ng) {  // the scale row kPrefetchGroups groups ahead (its own strided stream)
        MX_PREFETCH(sp + kPrefetchGroups * T.ss);
        if (CW > 64 || unaligned_s) MX_PREFETCH(sp + kPrefetchGroups * T.ss + CW - 1);
      }
      MX_UNROLL
      for (int c = 0; c < NCV; ++c) {
        const __m256i s = _mm256_min_epu8(_mm256_loadu_si256((const __m256i*)(sp + c * 32)), _mm256_set1_epi8((char)254));
        const __m256i z = _mm256_setzero_si256();
        const __m256i w0 = _mm256_unpacklo_epi8(z, s), w1 = _mm256_unpackhi_epi8(z, s);
        const __m256 half_ = _mm256_set1_ps(0.5f);
        const __m256 sc[4] = {_mm256_mul_ps(V256::e8m0(_mm256_unpacklo_epi16(z, w0)), half_),
                              _mm256_mul_ps(V256::e8m0(_mm256_unpackhi_epi16(z, w0)), half_),
                              _mm256_mul_ps(V256::e8m0(_mm256_unpacklo_epi16(z, w1)), half_),
                              _mm256_mul_ps(V256::e8m0(_mm256_unpackhi_epi16(z, w1)), half_)};
        MX_UNROLL
        for (int t = 0; t < NT; ++t) {
          const __m256 bt = _mm256_broadcast_ss(sb[t] + g);
          const __m256i a0 = half[0][t][2 * c], b0 = half[1][t][2 * c];
          const __m256i a1 = half[0][t][2 * c + 1], b1 = half[1][t][2 * c + 1];
          const __m256i i32[4] = {_mm256_madd_epi16(_mm256_unpacklo_epi16(a0, b0), ones),
                                  _mm256_madd_epi16(_mm256_unpackhi_epi16(a0, b0), ones),
                                  _mm256_madd_epi16(_mm256_unpacklo_epi16(a1, b1), ones),
                                  _mm256_madd_epi16(_mm256_unpackhi_epi16(a1, b1), ones)};
          MX_UNROLL
          for (int q = 0; q < 4; ++q) {
            __m256& d = tot[t][ch * NV + 4 * c + q];
            d = _mm256_add_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(i32[q]), _mm256_mul_ps(sc[q], bt)));
          }
        }
      }
    }
  }
  alignas(32) float tmp[8];
  for (int t = 0; t < NT; ++t)
    for (int ch = 0; ch < nch; ++ch)
      for (int c = 0; c < NCV; ++c)
        MX_UNROLL
        for (int q = 0; q < 4; ++q) {
          _mm256_store_ps(tmp, tot[t][ch * NV + 4 * c + q]);
          float* o = out + t * kMaxCols + c0 + ch * CW + c * 32;
          MX_UNROLL
          for (int l = 0; l < 8; ++l) o[w8_col(q, l)] = tmp[l];
        }
}

template <int NCV>
int tile_run_w8(const Tile& T, int c, int nc, int nt, const uint8_t* const* as, float* out) {
  constexpr int CW = 32 * NCV;
  if (nc - c < CW) return c;
  const int nch = (nc - c) / CW;
  int t = 0;
  for (; t + 2 <= nt; t += 2) tile_w8<NCV, 2>(T, c, nch, as + t, out + t * kMaxCols);
  if (t < nt) tile_w8<NCV, 1>(T, c, nch, as + t, out + t * kMaxCols);
  return c + nch * CW;
}
#endif

void tile_w8_any(const Tile& T, int nc, int nt, const uint8_t* const* as, float* out) {
  int c = 0;
#if CPUMOE_TIER >= CPUMOE_T_AVX2
  c = tile_run_w8<kW8Ncv>(T, c, nc, nt, as, out);
  c = tile_run_w8<1>(T, c, nc, nt, as, out);
#endif
  if (c < nc) tile_scalar_w8(T, c, nc - c, nt, as, out);
}

// out[t][0..nc) = tile columns dotted with xs[t], t < nt <= kMaxTok, nc <= kMaxCols.
void tile(const Tile& T, int nc, int nt, const float* const* xs, float* out) {
  int c = 0;
#if CPUMOE_TIER >= CPUMOE_T_AVX512F
  c = tile_run<V512, 4>(T, c, nc, nt, xs, out);
  c = tile_run<V256, 2>(T, c, nc, nt, xs, out);
#elif CPUMOE_TIER >= CPUMOE_T_AVX2
  c = tile_run<V256, 2>(T, c, nc, nt, xs, out);
#endif
  if (c < nc) tile_scalar(T, c, nc - c, nt, xs, out);
}

CPUMOE_INLINE Tile tile_of(const cpumoe_bank* banks, int slot, int e, int nkp) {
  const cpumoe_bank& B = banks[slot];
  const cpumoe_bank& S = banks[slot + 1];
  return Tile{(const uint8_t*)B.ptr + (int64_t)e * B.expert_stride, B.row_stride,
              (const uint8_t*)S.ptr + (int64_t)e * S.expert_stride, S.row_stride, nkp};
}
CPUMOE_INLINE const uint16_t* bias_of(const cpumoe_bank& b, int e) {
  return (const uint16_t*)((const char*)b.ptr + (int64_t)e * b.expert_stride);
}

template <bool W8>
CPUMOE_INLINE void tile_mode(const Tile& T, int nc, int nt, const void* const* xs, float* out) {
  if (W8)
    tile_w8_any(T, nc, nt, (const uint8_t* const*)xs, out);
  else
    tile(T, nc, nt, (const float* const*)xs, out);
}

template <bool W8>
void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  const cpumoe_params& p = k->params;
  Tile T = tile_of(banks, 0, e, p.hidden / 2);
  const uint16_t* bias = bias_of(banks[2], e);
  alignas(64) float out[kMaxTok * kMaxCols];
  for (int32_t ib = i0; ib < i1; ib += kMaxCols / 2) {
    const int32_t ie = ib + kMaxCols / 2 < i1 ? ib + kMaxCols / 2 : i1;
    Tile Tc = T;
    Tc.blk += 2 * ib, Tc.scl += 2 * ib;
    for (int32_t t0 = 0; t0 < n; t0 += kMaxTok) {
      const int nt = n - t0 < kMaxTok ? n - t0 : kMaxTok;
      tile_mode<W8>(Tc, 2 * (ie - ib), nt, xs + t0, out);
      for (int t = 0; t < nt; ++t)
        for (int32_t i = ib; i < ie; ++i) {
          const int c = 2 * (i - ib);
          const float* o = out + t * kMaxCols;
          const float gate = (o[c] + bf16_to_f32(bias[2 * i])) * w_in[t0 + t];
          const float up = (o[c + 1] + bf16_to_f32(bias[2 * i + 1])) * w_in[t0 + t];
          g[t0 + t][i] = f32_to_bf16(activate(p, gate, up));
        }
    }
  }
}

template <bool W8>
void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  const cpumoe_params& p = k->params;
  alignas(64) float out[kMaxTok * kMaxCols];
  const void* xs[kMaxTok];
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int e = routes[a].expert;
    Tile T = tile_of(banks, 3, e, p.inter / 2);
    const uint16_t* bias = bias_of(banks[5], e);
    for (int32_t hb = h0; hb < h1; hb += kMaxCols) {
      const int32_t he = hb + kMaxCols < h1 ? hb + kMaxCols : h1;
      Tile Tc = T;
      Tc.blk += hb, Tc.scl += hb;
      for (int32_t r0 = a; r0 < b; r0 += kMaxTok) {
        const int nt = b - r0 < kMaxTok ? b - r0 : kMaxTok;
        for (int t = 0; t < nt; ++t) xs[t] = routes[r0 + t].act;
        tile_mode<W8>(Tc, he - hb, nt, xs, out);
        for (int t = 0; t < nt; ++t) {
          const cpumoe_route& r = routes[r0 + t];
          float* o = acc + r.token * acc_stride + (hb - h0);
          const float* part = out + t * kMaxCols;
          for (int32_t h = hb; h < he; ++h) o[h - hb] += (part[h - hb] + bf16_to_f32(bias[h])) * r.weight;
        }
      }
    }
    a = b;
  }
}

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(mxfp4)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI || CPUMOE_TIER == CPUMOE_T_AVX512BF16
  (void)k;
  return false;  // nothing tier-specific: avx2 / avx512f run
#else
  if (k->params.mode == CPUMOE_MODE_W4A8) {
#if CPUMOE_TIER == CPUMOE_T_AVX512F
    return false;  // the avx2 w4a8 kernel runs
#else
    k->act_bytes = &act_bytes_w8;
    k->prep_act = &prep_act_w8;
    k->gate_up = &gate_up<true>;
    k->down = &down<true>;
#endif
  } else {
    if (k->params.mode != CPUMOE_MODE_NATIVE) return false;
    k->act_bytes = &act_bytes_f32;
    k->prep_act = &prep_act_f32;
    k->gate_up = &gate_up<false>;
    k->down = &down<false>;
  }
  k->block_hint = 64;  // a down work item reads whole 64-byte lines per K row
  return true;
#endif
}
