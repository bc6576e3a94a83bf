// mxfp4 experts (gpt-oss / Triton "mxfp4_triton"): transposed split-K, N innermost.
//
// Banks (slots): 0 gate_up_blocks [E, H/2, 2I] u8, 1 gate_up_scales [E, H/32, 2I] e8m0,
// 2 gate_up_bias [E, 2I] bf16, 3 down_blocks [E, I/2, H] u8, 4 down_scales [E, I/32, H] e8m0,
// 5 down_bias [E, H] bf16. Blocks row kb holds K-pair kb of every column (low nibble K = 2kb,
// high nibble K = 2kb+1); scales row kb/16 covers 32 K. gate/up are interleaved by column
// (2j gate, 2j+1 up). w = E2M1[code] * 2^(min(s,254) - 127), s = 0 -> 2^-127 exactly.
//
// Kernel: a GEMV over a column tile (a work item's columns, up to pass_cols(nt) per pass). K-pair
// rows outer, column accumulators inner (fp32); each 16-row scale group is summed into group
// accumulators which are then multiplied by the column's scale and added to the tile's totals.
// Tiles are walked group by group across all their column chunks, so each K row of an item is
// read once, as one contiguous run.
//
// Several tokens per expert (batched decode): from 3 tokens on, each 16-row group of a chunk is
// decoded ONCE into an L1 buffer and every token accumulates from it (register-blocked token groups),
// so batch n reads and decodes the weights once instead of n/2 times; 1 or 2 tokens decode straight
// into their FMAs. Per token and column the fp32 operations and their order are the same on every
// path: each token's result is bit-identical whatever the batch (tested).
//
// SIMD decode (avx2: 32 columns per 256-bit load, avx512f: 64 per 512-bit load, the same
// template): nibbles -> two pshufb LUTs giving the high and low byte of the code's bf16 bits
// (e2m1 values are exact bf16) -> byte unpack to bf16 words -> even columns = word << 16, odd
// columns = word & 0xFFFF0000 (fp32). The unpacks leave columns in a per-128-bit-lane order
// (lane_col below); the scales are expanded the same way and the totals are un-permuted once
// per tile. Columns that do not fill a vector run through the scalar tile.
//
// Mode w4a8 (int8 activations per 32 K): mxfp4_w8.h.
//
// Format mxfp4_panel (id 6) is the same weights repacked for a CPU: the columns cut into panels of kPanel = 64,
// each panel's K-pair rows (and its scale rows) stored one after another, so a work item's 64 columns are ONE
// contiguous run of K/2 x 64 bytes instead of 64 bytes out of every N-byte row. The banks are [E, panels x rows,
// 64] (row stride >= 64; panel p's rows start at row p x rows); the last panel of an N that is not a multiple of
// 64 is padded and its padding never read. The kernels are the same: tile_cols hands them one panel at a time
// (row stride = the bank's), so per column every fp32 operation and its order are unchanged and the two formats
// give bit-identical results (tested). Why: on the Zen 3 dev VM the transposed walk reads 44-48% of the
// single-thread read ceiling in w4a8, the panels 79-83% (3 interleaved A/B rounds, docs/formats/mxfp4.md).
#include "fp4_common.h"

// Executor work-item width in columns (block_hint; a multiple of 64): each K row of an item is one run of this
// many bytes (gate_up: twice), the next row N bytes further on.
#ifndef CPUMOE_MXFP4_BLOCK
#define CPUMOE_MXFP4_BLOCK 64
#endif
static_assert(CPUMOE_MXFP4_BLOCK > 0 && CPUMOE_MXFP4_BLOCK % 64 == 0, "CPUMOE_MXFP4_BLOCK: a multiple of 64");

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int kGroupRows = 16;     // K-pair rows per e8m0 scale (32 K)
constexpr int kPanel = 64;         // mxfp4_panel: columns per panel (= the work-item width, CPUMOE_MXFP4_BLOCK)
constexpr int kMaxTok = 8;         // tokens per tile pass (each chunk decoded once for all of them)
constexpr int kPassFloats = 8192;  // fp32 results of one pass, nt x columns (32 KB of stack)
constexpr int kMaxCols = 2048;     // columns per pass (one token)
constexpr int kPrefetchRows = 32;  // K rows ahead (row stride = N bytes): ~100-200 ns of DRAM latency
constexpr int kPrefetchGroups = kPrefetchRows / kGroupRows;  // scale rows ahead

// Columns per tile pass for nt tokens: a multiple of 64 with nt * cols <= kPassFloats.
CPUMOE_INLINE int pass_cols(int nt) {
  const int c = kPassFloats / nt / 64 * 64;
  return c < kMaxCols ? c : kMaxCols;
}

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

// Output of one tile pass: out[t * os + c], natural column order (os = pass_cols(nt)).

// Scalar tile (the scalar tier, and column tails of the SIMD tiers): columns [c0, c0+nc).
void tile_scalar(const Tile& T, int c0, int nc, int nt, const float* const* xs, float* out, int os) {
  float gacc[kMaxCols];
  for (int t = 0; t < nt; ++t) {
    const float* x = xs[t];
    float* o = out + t * os + c0;
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
  static CPUMOE_INLINE I ulut() { return fp4::w2_offset(); }  // u = 2 * E2M1 + 12
  static CPUMOE_INLINE I set1_8(int v) { return _mm256_set1_epi8((char)v); }
  static CPUMOE_INLINE I set1_32(int v) { return _mm256_set1_epi32(v); }
  static CPUMOE_INLINE I zero() { return _mm256_setzero_si256(); }
  static CPUMOE_INLINE I band(I a, I b) { return _mm256_and_si256(a, b); }
  static CPUMOE_INLINE I srl4(I a) { return _mm256_srli_epi16(a, 4); }
  static CPUMOE_INLINE I shuf(I t, I i) { return _mm256_shuffle_epi8(t, i); }
  static CPUMOE_INLINE I ulo8(I a, I b) { return _mm256_unpacklo_epi8(a, b); }
  static CPUMOE_INLINE I uhi8(I a, I b) { return _mm256_unpackhi_epi8(a, b); }
  static CPUMOE_INLINE I ulo16(I a, I b) { return _mm256_unpacklo_epi16(a, b); }
  static CPUMOE_INLINE I uhi16(I a, I b) { return _mm256_unpackhi_epi16(a, b); }
  static CPUMOE_INLINE I sll16(I a) { return _mm256_slli_epi32(a, 16); }
  static CPUMOE_INLINE I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static CPUMOE_INLINE I minu8(I a, int v) { return _mm256_min_epu8(a, _mm256_set1_epi8((char)v)); }
  // VNNI: acc + the sum of the 4 products u * a per dword (u unsigned <= 24, a signed), exact.
  // Otherwise madd2 (vpmaddubsw: pairs u * a, <= 2 * 24 * 127 = 6096, never saturating) into int16
  // accumulators and widen (vpmaddwd with 1: the dword's two int16) every few row pairs.
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER >= CPUMOE_T_AVX512VNNI
  static constexpr bool kVnni = true;
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
  static CPUMOE_INLINE I dot4(I acc, I u, I a) { return _mm256_dpbusd_avx_epi32(acc, u, a); }
#else
  static CPUMOE_INLINE I dot4(I acc, I u, I a) { return _mm256_dpbusd_epi32(acc, u, a); }
#endif
#else
  static constexpr bool kVnni = false;
  static CPUMOE_INLINE I dot4(I acc, I, I) { return acc; }  // unused
#endif
  static CPUMOE_INLINE I madd2(I acc16, I u, I a) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(u, a)); }
  static CPUMOE_INLINE I widen(I acc32, I acc16) {
    return _mm256_add_epi32(acc32, _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)));
  }
  // acc32 + the int16 of acc16 selected per dword by m (0x00000001: the low word, 0x00010000: the high word).
  static CPUMOE_INLINE I widen_sel(I acc32, I acc16, I m) { return _mm256_add_epi32(acc32, _mm256_madd_epi16(acc16, m)); }
  static CPUMOE_INLINE F cast(I a) { return _mm256_castsi256_ps(a); }
  static CPUMOE_INLINE F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static CPUMOE_INLINE F fzero() { return _mm256_setzero_ps(); }
  static CPUMOE_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static CPUMOE_INLINE F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static CPUMOE_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static CPUMOE_INLINE void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // dwords holding s << 24 (s in [0, 254]) -> 2^(s-127); s = 0 -> 2^-127 (0x00400000): s << 23 is at
  // least 0x00800000 for s >= 1 and 0 for s = 0, so a max with 0x00400000 fixes exactly s = 0.
  static CPUMOE_INLINE F e8m0(I d) { return cast(_mm256_max_epi32(_mm256_srli_epi32(d, 1), _mm256_set1_epi32(0x00400000))); }
};
#endif

#if CPUMOE_TIER >= CPUMOE_T_AVX512F
struct V512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int W = 64;
  static CPUMOE_INLINE I load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
  static CPUMOE_INLINE I lut(const uint8_t* t) { return _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)t)); }
  static CPUMOE_INLINE I ulut() { return fp4::tbl512(fp4::w2_offset()); }
  static CPUMOE_INLINE I set1_8(int v) { return _mm512_set1_epi8((char)v); }
  static CPUMOE_INLINE I set1_32(int v) { return _mm512_set1_epi32(v); }
  static CPUMOE_INLINE I zero() { return _mm512_setzero_si512(); }
  static CPUMOE_INLINE I band(I a, I b) { return _mm512_and_si512(a, b); }
  static CPUMOE_INLINE I srl4(I a) { return _mm512_srli_epi16(a, 4); }
  static CPUMOE_INLINE I shuf(I t, I i) { return _mm512_shuffle_epi8(t, i); }
  static CPUMOE_INLINE I ulo8(I a, I b) { return _mm512_unpacklo_epi8(a, b); }
  static CPUMOE_INLINE I uhi8(I a, I b) { return _mm512_unpackhi_epi8(a, b); }
  static CPUMOE_INLINE I ulo16(I a, I b) { return _mm512_unpacklo_epi16(a, b); }
  static CPUMOE_INLINE I uhi16(I a, I b) { return _mm512_unpackhi_epi16(a, b); }
  static CPUMOE_INLINE I sll16(I a) { return _mm512_slli_epi32(a, 16); }
  static CPUMOE_INLINE I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static CPUMOE_INLINE I minu8(I a, int v) { return _mm512_min_epu8(a, _mm512_set1_epi8((char)v)); }
#if CPUMOE_TIER >= CPUMOE_T_AVX512VNNI
  static constexpr bool kVnni = true;
  static CPUMOE_INLINE I dot4(I acc, I u, I a) { return _mm512_dpbusd_epi32(acc, u, a); }
#else
  static constexpr bool kVnni = false;
  static CPUMOE_INLINE I dot4(I acc, I, I) { return acc; }  // unused
#endif
  static CPUMOE_INLINE I madd2(I acc16, I u, I a) { return _mm512_add_epi16(acc16, _mm512_maddubs_epi16(u, a)); }
  static CPUMOE_INLINE I widen(I acc32, I acc16) {
    return _mm512_add_epi32(acc32, _mm512_madd_epi16(acc16, _mm512_set1_epi16(1)));
  }
  static CPUMOE_INLINE I widen_sel(I acc32, I acc16, I m) { return _mm512_add_epi32(acc32, _mm512_madd_epi16(acc16, m)); }
  static CPUMOE_INLINE F cast(I a) { return _mm512_castsi512_ps(a); }
  static CPUMOE_INLINE F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static CPUMOE_INLINE F fzero() { return _mm512_setzero_ps(); }
  static CPUMOE_INLINE F set1(float v) { return _mm512_set1_ps(v); }
  static CPUMOE_INLINE F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static CPUMOE_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static CPUMOE_INLINE void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static CPUMOE_INLINE F e8m0(I d) { return cast(_mm512_max_epi32(_mm512_srli_epi32(d, 1), _mm512_set1_epi32(0x00400000))); }
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

// The scales of W columns in lane_col order: byte s -> word s << 8 -> dword s << 24 -> e8m0.
template <class V>
CPUMOE_INLINE void scales4(const uint8_t* sp, typename V::F* sc) {
  using I = typename V::I;
  const I s = V::minu8(V::load(sp), 254), z = V::zero(), mhi = V::set1_32((int)0xFFFF0000u);
  const I s0 = V::ulo8(z, s), s1 = V::uhi8(z, s);
  sc[0] = V::e8m0(V::sll16(s0));
  sc[1] = V::e8m0(V::band(s0, mhi));
  sc[2] = V::e8m0(V::sll16(s1));
  sc[3] = V::e8m0(V::band(s1, mhi));
}

// The start of a tile kernel's walk down the K rows of columns [c0, c0 + bytes): the tile's first block and
// scale bytes, the row prefetch distance, whether rows / scale rows may straddle cache lines (then a row's last
// byte is prefetched too), the number of scale groups; and the warm-up prefetch of the first kPrefetchRows rows
// and kPrefetchGroups scale rows (the loops then stay kPrefetchRows rows ahead).
struct TileWalk {
  const uint8_t *blk, *scl;
  int64_t pfd;
  bool unaligned, unaligned_s;
  int ng;
  TileWalk(const Tile& T, int c0, int bytes)
      : blk(T.blk + c0), scl(T.scl + c0), pfd(kPrefetchRows * T.bs),
        unaligned((((uintptr_t)blk | (uintptr_t)T.bs) & 63) != 0),
        unaligned_s((((uintptr_t)scl | (uintptr_t)T.ss) & 63) != 0), ng(T.nkp / kGroupRows) {
    for (int r = 0; r < kPrefetchRows && r < T.nkp; ++r)
      for (int o = 0; o < bytes; o += 64) MX_PREFETCH(blk + r * T.bs + o);
    for (int g = 0; g < kPrefetchGroups && g < ng; ++g)
      for (int o = 0; o < bytes + 63; o += 64) MX_PREFETCH(scl + g * T.ss + o);
  }
};
// The scale row kPrefetchGroups groups ahead of sp (its own strided stream).
CPUMOE_INLINE void prefetch_scales(const Tile& T, const uint8_t* sp, int g, int bytes, bool unaligned) {
  if (g + kPrefetchGroups < T.nkp / kGroupRows) {
    MX_PREFETCH(sp + kPrefetchGroups * T.ss);
    if (bytes > 64 || unaligned) MX_PREFETCH(sp + kPrefetchGroups * T.ss + bytes - 1);
  }
}

// Un-permute totals (vector v of chunk ch, lane order col(q, l)) into out[t * os + c0 + column].
template <class V, int (*Col)(int, int)>
CPUMOE_INLINE void store_totals(const typename V::F* tot, int ts, int nt, int nch, float* out, int os, int c0) {
  constexpr int L = V::W / 4;
  alignas(64) float tmp[L];
  for (int t = 0; t < nt; ++t)
    for (int ch = 0; ch < nch; ++ch)
      MX_UNROLL
      for (int q = 0; q < 4; ++q) {
        V::store(tmp, tot[t * ts + ch * 4 + q]);
        float* o = out + t * os + c0 + ch * V::W;
        MX_UNROLL
        for (int l = 0; l < L; ++l) o[Col(q, l)] = tmp[l];
      }
}

// One or two tokens: nch chunks of NCV*W columns starting at column c0, decoded straight into the
// FMAs (no buffer: cheapest while the accumulators of all tokens fit in registers).
template <class V, int NCV, int NT>
void tile_few(const Tile& T, int c0, int nch, const float* const* xs, float* out, int os) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int W = V::W, NV = 4 * NCV, L = W / 4, CW = NCV * W;  // L = fp32 lanes per vector
  const I m0f = V::set1_8(0x0F), lh = V::lut(kLutHi), ll = V::lut(kLutLo), mhi = V::set1_32((int)0xFFFF0000u);
  const int ts = os / L;  // vectors per token in tot
  F tot[kPassFloats / L];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < nch * NV; ++v) tot[t * ts + v] = V::fzero();
  const auto [blk, scl, pfd, unaligned, unaligned_s, ng] = TileWalk(T, c0, nch * CW);
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
        F x0[NT], x1[NT];
        MX_UNROLL
        for (int t = 0; t < NT; ++t) x0[t] = V::bcast(xs[t] + 2 * (kb0 + r)), x1[t] = V::bcast(xs[t] + 2 * (kb0 + r) + 1);
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
      const uint8_t* sp = scl + (int64_t)g * T.ss + ch * CW;
      prefetch_scales(T, sp, g, CW, unaligned_s);
      MX_UNROLL
      for (int c = 0; c < NCV; ++c) {
        F sc[4];
        scales4<V>(sp + c * W, sc);
        MX_UNROLL
        for (int t = 0; t < NT; ++t)
          MX_UNROLL
          for (int q = 0; q < 4; ++q) {
            F& d = tot[t * ts + ch * NV + 4 * c + q];
            d = V::fma(acc[t][4 * c + q], sc[q], d);
          }
      }
    }
  }
  store_totals<V, lane_col>(tot, ts, NT, nch * NCV, out, os, c0);
}

// NT tokens against one decoded group: buf[8 r + q] = weights of row r (q < 4: low nibbles, K = 2kb;
// q >= 4: high nibbles, K = 2kb+1). The same fp32 operations in the same order as tile_few, per token.
template <class V, int NT>
CPUMOE_INLINE void fma_tokens(const typename V::F* buf, const float* const* xs, int kb0, const typename V::F* sc,
                              typename V::F* tot, int ts) {
  using F = typename V::F;
  F acc[NT][4];
  MX_UNROLL
  for (int t = 0; t < NT; ++t)
    MX_UNROLL
    for (int q = 0; q < 4; ++q) acc[t][q] = V::fzero();
  for (int r = 0; r < kGroupRows; ++r) {
    const F* w = buf + 8 * r;
    MX_UNROLL
    for (int t = 0; t < NT; ++t) {
      const float* x = xs[t] + 2 * (kb0 + r);
      const F x0 = V::bcast(x);
      MX_UNROLL
      for (int q = 0; q < 4; ++q) acc[t][q] = V::fma(w[q], x0, acc[t][q]);
      const F x1 = V::bcast(x + 1);
      MX_UNROLL
      for (int q = 0; q < 4; ++q) acc[t][q] = V::fma(w[4 + q], x1, acc[t][q]);
    }
  }
  MX_UNROLL
  for (int t = 0; t < NT; ++t)
    MX_UNROLL
    for (int q = 0; q < 4; ++q) tot[t * ts + q] = V::fma(acc[t][q], sc[q], tot[t * ts + q]);
}

// nt >= 3 tokens: nch chunks of W columns; each (group, chunk) decoded once into buf, then the
// tokens in register-blocked groups of NTG.
template <class V, int NTG>
void tile_multi(const Tile& T, int c0, int nch, int nt, const float* const* xs, float* out, int os) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int W = V::W, L = W / 4;
  static_assert(NTG >= 2 && NTG <= 4, "token group");
  const I m0f = V::set1_8(0x0F), lh = V::lut(kLutHi), ll = V::lut(kLutLo), mhi = V::set1_32((int)0xFFFF0000u);
  const int ts = os / L;  // vectors per token in tot
  F tot[kPassFloats / L];
  for (int t = 0; t < nt; ++t)
    for (int v = 0; v < nch * 4; ++v) tot[t * ts + v] = V::fzero();
  const auto [blk, scl, pfd, unaligned, unaligned_s, ng] = TileWalk(T, c0, nch * W);
  for (int g = 0; g < ng; ++g) {
    const int kb0 = g * kGroupRows;
    for (int ch = 0; ch < nch; ++ch) {
      F buf[8 * kGroupRows];
      const uint8_t* p = blk + (int64_t)kb0 * T.bs + ch * W;
      for (int r = 0; r < kGroupRows; ++r, p += T.bs) {
        MX_PREFETCH(p + pfd);
        if (unaligned) MX_PREFETCH(p + pfd + W - 1);
        const I b = V::load(p);
        decode4<V>(V::band(b, m0f), lh, ll, mhi, buf + 8 * r);
        decode4<V>(V::band(V::srl4(b), m0f), lh, ll, mhi, buf + 8 * r + 4);
      }
      const uint8_t* sp = scl + (int64_t)g * T.ss + ch * W;
      prefetch_scales(T, sp, g, W, unaligned_s);
      F sc[4];
      scales4<V>(sp, sc);
      F* tt = tot + ch * 4;
      int t = 0;
      for (; t + NTG <= nt; t += NTG) fma_tokens<V, NTG>(buf, xs + t, kb0, sc, tt + t * ts, ts);
      switch (nt - t) {
        case 1: fma_tokens<V, 1>(buf, xs + t, kb0, sc, tt + t * ts, ts); break;
        case 2: fma_tokens<V, (NTG > 2 ? 2 : 1)>(buf, xs + t, kb0, sc, tt + t * ts, ts); break;
        case 3: fma_tokens<V, (NTG > 3 ? 3 : 1)>(buf, xs + t, kb0, sc, tt + t * ts, ts); break;
        default: break;
      }
    }
  }
  store_totals<V, lane_col>(tot, ts, nt, nch, out, os, c0);
}

// Columns [c, nc) that fill whole vectors of V; returns the first column not done.
template <class V, int NTG>
int tile_run(const Tile& T, int c, int nc, int nt, const float* const* xs, float* out, int os) {
  constexpr int W = V::W;
  if (nt == 1) {
    if (nc - c >= 2 * W) {  // two vectors' worth of columns per chunk
      const int nch = (nc - c) / (2 * W);
      tile_few<V, 2, 1>(T, c, nch, xs, out, os);
      c += nch * 2 * W;
    }
    if (nc - c >= W) {
      tile_few<V, 1, 1>(T, c, 1, xs, out, os);
      c += W;
    }
  } else if (nt == 2 && nc - c >= W) {
    const int nch = (nc - c) / W;
    tile_few<V, 1, 2>(T, c, nch, xs, out, os);
    c += nch * W;
  } else if (nc - c >= W) {
    const int nch = (nc - c) / W;
    tile_multi<V, NTG>(T, c, nch, nt, xs, out, os);
    c += nch * W;
  }
  return c;
}
#endif

// out[t * os + c] for c < nc: tile columns dotted with xs[t], t < nt <= kMaxTok, nt * nc <= kPassFloats.
void tile(const Tile& T, int nc, int nt, const float* const* xs, float* out, int os) {
  int c = 0;
#if CPUMOE_TIER >= CPUMOE_T_AVX512F
  c = tile_run<V512, 4>(T, c, nc, nt, xs, out, os);
  c = tile_run<V256, 3>(T, c, nc, nt, xs, out, os);
#elif CPUMOE_TIER >= CPUMOE_T_AVX2
  c = tile_run<V256, 3>(T, c, nc, nt, xs, out, os);
#endif
  if (c < nc) tile_scalar(T, c, nc - c, nt, xs, out, os);
}

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

#include "mxfp4_w8.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

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
CPUMOE_INLINE void tile_mode(const Tile& T, int nc, int nt, const void* const* xs, float* out, int os) {
  if (W8)
    w8::tile_any(T, nc, nt, (const uint8_t* const*)xs, out, os);
  else
    tile(T, nc, nt, (const float* const*)xs, out, os);
}

// Columns [c0, c0 + nc) of the expert whose bank views T holds (T.blk / T.scl: its first row) into out[t * os +
// c - c0]. Transposed (mxfp4): one tile, rows T.bs apart. Panels (mxfp4_panel): one tile per panel touched, rows
// T.bs apart inside it, panel p's rows starting at row p * rows (rows = K/2 blocks, K/32 scales).
template <bool W8>
CPUMOE_INLINE void tile_cols(const Tile& T, bool panel, int c0, int nc, int nt, const void* const* xs, float* out,
                             int os) {
  if (!panel) {
    Tile Tc = T;
    Tc.blk += c0, Tc.scl += c0;
    tile_mode<W8>(Tc, nc, nt, xs, out, os);
    return;
  }
  const int64_t pb = (int64_t)T.nkp * T.bs, ps = (int64_t)(T.nkp / kGroupRows) * T.ss;  // bytes per panel
  for (int c = c0; c < c0 + nc;) {
    const int pn = c / kPanel, in = c - pn * kPanel, ce = (pn + 1) * kPanel < c0 + nc ? (pn + 1) * kPanel : c0 + nc;
    const Tile Tc{T.blk + pn * pb + in, T.bs, T.scl + pn * ps + in, T.ss, T.nkp};
    tile_mode<W8>(Tc, ce - c, nt, xs, out + (c - c0), os);
    c = ce;
  }
}

template <bool W8>
void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  const cpumoe_params& p = k->params;
  ActSink sink(p);  // g in SIMD lanes (common.h)
  const bool panel = p.format == CPUMOE_FMT_MXFP4_PANEL;
  const Tile T = tile_of(banks, 0, e, p.hidden / 2);
  const uint16_t* bias = bias_of(banks[2], e);
  alignas(64) float out[kPassFloats];
  for (int32_t t0 = 0; t0 < n; t0 += kMaxTok) {
    const int nt = n - t0 < kMaxTok ? n - t0 : kMaxTok, os = pass_cols(nt);
    for (int32_t ib = i0; ib < i1; ib += os / 2) {
      const int32_t ie = ib + os / 2 < i1 ? ib + os / 2 : i1;
      tile_cols<W8>(T, panel, 2 * ib, 2 * (ie - ib), nt, xs + t0, out, os);
      for (int t = 0; t < nt; ++t) {
        const float* o = out + t * os;
        for (int32_t i = ib; i < ie; ++i) {
          const int c = 2 * (i - ib);
          const float gate = (o[c] + bf16_to_f32(bias[2 * i])) * w_in[t0 + t];
          const float up = (o[c + 1] + bf16_to_f32(bias[2 * i + 1])) * w_in[t0 + t];
          sink.put(&g[t0 + t][i], gate, up);
        }
      }
    }
  }
}

template <bool W8>
void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  const cpumoe_params& p = k->params;
  const bool panel = p.format == CPUMOE_FMT_MXFP4_PANEL;
  alignas(64) float out[kPassFloats];
  const void* xs[kMaxTok];
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int e = routes[a].expert;
    const Tile T = tile_of(banks, 3, e, p.inter / 2);
    const uint16_t* bias = bias_of(banks[5], e);
    for (int32_t r0 = a; r0 < b; r0 += kMaxTok) {
      const int nt = b - r0 < kMaxTok ? b - r0 : kMaxTok, os = pass_cols(nt);
      for (int t = 0; t < nt; ++t) xs[t] = routes[r0 + t].act;
      for (int32_t hb = h0; hb < h1; hb += os) {
        const int32_t he = hb + os < h1 ? hb + os : h1;
        tile_cols<W8>(T, panel, hb, he - hb, nt, xs, out, os);
        // routes in order: each acc element gets its routes' terms in route order, as before
        for (int t = 0; t < nt; ++t) {
          const cpumoe_route& r = routes[r0 + t];
          float* o = acc + r.token * acc_stride + (hb - h0);
          const float* part = out + t * os;
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
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
  (void)k;
  return false;  // nothing bf16-specific: avx512vnni (w4a8) / avx512f (native) run
#else
  if (k->params.mode == CPUMOE_MODE_W4A8) {
    k->act_bytes = &w8::act_bytes;
    k->prep_act = &w8::prep_act;
    k->gate_up = &gate_up<true>;
    k->down = &down<true>;
  } else {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
    return false;  // native has no int8 dot: avx2 / avx512f run
#endif
    if (k->params.mode != CPUMOE_MODE_NATIVE) return false;
    k->act_bytes = &act_bytes_f32;
    k->prep_act = &prep_act_f32;
    k->gate_up = &gate_up<false>;
    k->down = &down<false>;
  }
  k->block_hint = CPUMOE_MXFP4_BLOCK;  // a down work item reads whole 64-byte lines per K row (64: swept best)
  return true;
#endif
}

// The same kernels for both layouts (they read p.format: tile_cols).
bool CPUMOE_INIT_FN(mxfp4_panel)(cpumoe_kernel* k) { return CPUMOE_INIT_FN(mxfp4)(k); }
