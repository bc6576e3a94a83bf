// fp8_block_x16: fp8_block experts with 16 rows interleaved per K pair, for CPUs (docs/formats/fp8_block.md
// "fp8_block_x16"). Banks (slots): 0 gate_up [E, 2I/16, H*16] e4m3, 1 gate_up_scale [E, nb(2I), >= nb(H)] bf16,
// 2 down [E, H/16, I*16] e4m3, 3 down_scale [E, nb(H), >= nb(I)] bf16. A code bank row is a group of 16 weight
// rows: per K pair p, 32 bytes, row r's codes 2p and 2p+1 at bytes 2r and 2r+1 (cpumoe_formats.repack_fp8_block_x16).
//
// Mode native (W8A16; x as its exact bf16, the prepared record is the bf16 row itself). Per (row, token), from
// acc = 0, per 128-K block (the last one partial): two chains, c0 over the block's even K pairs and c1 over its
// odd ones, each pair as c = fma(w_odd, x_odd, c) then c = fma(w_even, x_even, c) (vdpbf16ps: the products are
// exact, each step rounds once, subnormal x and results read as zero), then acc = fma(c0 + c1, scale, acc).
// The scalar tier does the same fp32 operations in the same order, so the tiers are bit-identical and a token's
// result does not depend on its batch. The avx2 and avx512f tiers do them with fp32 FMAs on the exact e4m3
// values (x16_fma.h: the flush to zero by MXCSR, checked, and redone explicitly where it was needed).
//
// Why: a decoded 64-byte line is 2 vectors of 16 rows' bf16 pairs, and one vdpbf16ps with the token's pair
// broadcast (folded into the instruction) takes 32 products, so each extra token sharing an expert costs one
// instruction per 32 weights; the row-major kernels stream a token's activation vectors through every row.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "../x16.h"
#include "fp8_block_decode.h"
#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
#define FP8X16_FMA 1
#include "x16_fma.h"
#else
#define FP8X16_FMA 0
#endif

// Software prefetch distance in each group stream (bytes, one line per 64-byte step).
#ifndef CPUMOE_FP8X16_PF
#define CPUMOE_FP8X16_PF 2048
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int GR = x16::GR, kBlk = 128;

struct G16 {
#if FP8X16_FMA
  static constexpr int kMaxNT = x16fma::kMaxNT;
#else
  static constexpr int kMaxNT = 8;
#endif
  static constexpr int64_t kPf = CPUMOE_FP8X16_PF;
  static constexpr int kSlot[2] = {0, 2};
  struct Ref {
    const uint8_t* w;   // the group's codes
    const uint16_t* s;  // its 128-row block's scale row
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    return {bank_row<uint8_t>(banks[2 * mat], e, g), bank_row<uint16_t>(banks[2 * mat + 1], e, g * GR / kBlk)};
  }
  template <int G, int NT>
  static void groups(const Ref* gp, int K, const void* const* act, float* out);
#if FP8X16_FMA  // x16_fma.h's part: 128-K blocks, 2 K pairs a line
  static constexpr int kBlk = cpumoe::CPUMOE_NS::kBlk, kStep = 64;
  static CPUMOE_INLINE float scale(const Ref& r, int b) { return bf16_to_f32(r.s[b]); }
  // 2 K pairs at p (A: bytes 0-31, B: 32-63, each row r's even and odd codes at 2r, 2r + 1): slot h's even and
  // odd weights, exact. avx2: bf16 patterns (fp8_block_decode.h), e4m3 / 2^120; a 32-bit lane holds rows 2j and
  // 2j + 1, so slot h is the rows of parity h (kParity). avx512f: fp16 patterns (no fp32 subnormals, which
  // cost an FP assist on Intel cores), e4m3 / 2^8. Times kXs, or the tokens' x times kXs where none overflows
  // (x16_fma.h prep_act_xs: 2^120 x overflows from |x| = 2^8, 2^8 x from 2^120).
#if CPUMOE_TIER == CPUMOE_T_AVX2
  static constexpr bool kParity = true;
  static constexpr float kXs = 0x1p120f;
  template <bool kXsOn>
  static CPUMOE_INLINE void quad(const uint8_t* p, int h, x16fma::V* w) {
    for (int i = 0; i < 2; ++i) {
      x16fma::V v[4];  // rows 2j even, 2j odd, 2j + 1 even, 2j + 1 odd
      fp8dec::bf16p_decode4(_mm256_loadu_si256((const __m256i*)(p + 32 * i)), v);
      w[2 * i] = v[2 * h], w[2 * i + 1] = v[2 * h + 1];
    }
    if constexpr (!kXsOn)
      for (int i = 0; i < 4; ++i) w[i] = x16fma::vmul(w[i], x16fma::vset1(kXs));
  }
#else
  static constexpr bool kParity = false;
  static constexpr float kXs = 256.f;
  template <bool kXsOn>
  static CPUMOE_INLINE void quad(const uint8_t* p, int, x16fma::V* w) {
    x16fma::V v[4];  // A even, B even, A odd, B odd
    fp8dec::fp16_decode4(_mm512_loadu_si512((const void*)p), v);
    w[0] = v[0], w[1] = v[2], w[2] = v[1], w[3] = v[3];
    if constexpr (!kXsOn)
      for (int i = 0; i < 4; ++i) w[i] = x16fma::vmul(w[i], x16fma::vset1(kXs));
  }
#endif
#endif
#if CPUMOE_TIER == CPUMOE_T_AMX
  struct Scope {  // the tiles are configured by the first group call of a work item, released at its end
    ~Scope();
  };
#endif
};

#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
template <int G, int NT>
void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  const fp8dec::Decoder d;
  const uint16_t* x[NT];
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) x[t] = (const uint16_t*)act[t];
  for (int i = 0; i < G * NT; ++i) _mm512_storeu_ps(out + i * GR, _mm512_setzero_ps());
  for (int o = 0; o < K; o += kBlk) {
    const int n = K - o < kBlk ? K - o : kBlk;  // a multiple of 16
    __m512 c0[G][NT], c1[G][NT];
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) c0[g][t] = c1[g][t] = _mm512_setzero_ps();
    for (int k = o; k < o + n; k += 4) {  // one 64-byte line per group: pairs k/2 (-> c0) and k/2 + 1 (-> c1)
      CPUMOE_UNROLL
      for (int g = 0; g < G; ++g) {
        const uint8_t* p = gp[g].w + (size_t)k * GR;
        __builtin_prefetch(p + kPf, 0, 3);
        __m512i w0, w1;
        d.decode(p, 64, w0, w1);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int32_t* xa = (const int32_t*)(x[t] + k);
          c0[g][t] = x16::dpbf16_bcast(c0[g][t], w0, xa);
          c1[g][t] = x16::dpbf16_bcast(c1[g][t], w1, xa + 1);
        }
      }
    }
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const __m512 s = _mm512_set1_ps(bf16_to_f32(gp[g].s[o / kBlk]));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        float* a = out + (g * NT + t) * GR;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_add_ps(c0[g][t], c1[g][t]), s, _mm512_loadu_ps(a)));
      }
    }
  }
}
#elif CPUMOE_TIER == CPUMOE_T_AMX
// Tiles (palette 1): 0 A, the tokens' bf16 activations (NT rows x 32 K); 2, 3 C, per group (NT rows x 16 fp32);
// 4, 5 B, per group, a decoded 32-K chunk of its 16 rows: 16 pair rows x 16 rows' bf16 pairs, which is the
// layout's own order, so a 64-byte line decodes straight into two B rows. The per-thread tile state is loaded
// when the token count changes and released when the work item ends (another library may use the tiles).
thread_local int tl_tile_nt = 0;  // the NT the loaded configuration is for; 0 = none

CPUMOE_INLINE void configure(int nt) {
  if (tl_tile_nt == nt) return;
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } c;
  for (int t : {0, 2, 3}) c.rows[t] = (uint8_t)nt, c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
  tl_tile_nt = nt;
}

G16::Scope::~Scope() {
  if (tl_tile_nt) _tile_release();
  tl_tile_nt = 0;
}
static_assert(std::is_same_v<x16::ScopeOf<G16>::type, G16::Scope>, "x16's loops must hold the tile scope");

// The 32-K chunk at k (m = 32 or, in a K tail, 16 codes per row) of a group into B rows (zero past m / 2).
CPUMOE_INLINE void decode_b(const fp8dec::Decoder& d, const uint8_t* w, int k, int m, uint16_t* b) {
  for (int l = 0; l < m / 4; ++l) {
    const uint8_t* p = w + (size_t)(k + 4 * l) * GR;
    __builtin_prefetch(p + G16::kPf, 0, 3);
    __m512i w0, w1;
    d.decode(p, 64, w0, w1);
    _mm512_store_si512((void*)(b + 64 * l), w0);
    _mm512_store_si512((void*)(b + 64 * l + 32), w1);
  }
  for (int l = m / 4; l < 8; ++l) {
    _mm512_store_si512((void*)(b + 64 * l), _mm512_setzero_si512());
    _mm512_store_si512((void*)(b + 64 * l + 32), _mm512_setzero_si512());
  }
}

// The tile unit sums each 32-K chunk in its own order (not vdpbf16ps' chains), so this tier is not bit-identical
// to the others; each (row, token) element still depends only on its row, its token and K.
template <int G, int NT>
void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  static_assert(G <= 2 && NT <= 16, "two C / B tile pairs, 16 tile rows");
  configure(NT);
  const fp8dec::Decoder d;
  // A: the tokens' rows read in place when they lie at one stride (a batch's prepared rows do), else copied
  const uint16_t* a0 = (const uint16_t*)act[0];
  int64_t as = 64;
  if constexpr (NT > 1) as = (const char*)act[1] - (const char*)act[0];
  bool direct = as > 0;
  for (int t = 2; t < NT && direct; ++t) direct = (const char*)act[t] == (const char*)act[0] + t * as;
  thread_local std::vector<uint16_t> copy;
  if (!direct) {
    copy.resize((size_t)NT * K);
    for (int t = 0; t < NT; ++t) std::memcpy(copy.data() + (size_t)t * K, act[t], (size_t)K * 2);
    a0 = copy.data(), as = (int64_t)K * 2;
  }
  alignas(64) uint16_t b[G][16 * 32];
  alignas(64) uint16_t tail[NT * 32];
  alignas(64) float c[NT * GR];
  __m512 acc[G][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int o = 0; o < K; o += kBlk) {
    const int n = K - o < kBlk ? K - o : kBlk;  // a multiple of 16
    _tile_zero(2);
    if constexpr (G > 1) _tile_zero(3);
    for (int k = o; k < o + n; k += 32) {
      const int m = o + n - k < 32 ? 16 : 32;
      decode_b(d, gp[0].w, k, m, b[0]);
      _tile_loadd(4, b[0], 64);
      if constexpr (G > 1) {
        decode_b(d, gp[1].w, k, m, b[G - 1]);
        _tile_loadd(5, b[G - 1], 64);
      }
      if (m == 32) {
        _tile_loadd(0, a0 + k, as);
      } else {  // a 16-K tail: the tokens' last 16 values, zero after them (garbage past K could be NaN)
        std::memset(tail, 0, sizeof tail);
        for (int t = 0; t < NT; ++t) std::memcpy(tail + 32 * t, (const uint16_t*)act[t] + k, 32);
        _tile_loadd(0, tail, 64);
      }
      _tile_dpbf16ps(2, 0, 4);
      if constexpr (G > 1) _tile_dpbf16ps(3, 0, 5);
    }
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      if (g == 0) _tile_stored(2, c, 64);
      else _tile_stored(3, c, 64);
      const __m512 s = _mm512_set1_ps(bf16_to_f32(gp[g].s[o / kBlk]));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[g][t] = _mm512_fmadd_ps(_mm512_load_ps(c + t * GR), s, acc[g][t]);
    }
  }
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + (g * NT + t) * GR, acc[g][t]);
}
#elif FP8X16_FMA
template <int G, int NT>
void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  x16fma::groups<G16, G, NT>(gp, K, act, out);
}
#else
template <int G, int NT>
void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NT; ++t) {
      const uint16_t* x = (const uint16_t*)act[t];
      for (int r = 0; r < GR; ++r) {
        float acc = 0.f;
        for (int o = 0; o < K; o += kBlk) {
          const int n = K - o < kBlk ? K - o : kBlk;
          float c[2] = {0.f, 0.f};
          for (int k = o; k < o + n; k += 2) {
            const uint8_t* p = gp[g].w + (size_t)k * GR + 2 * r;
            float& ch = c[((k - o) >> 1) & 1];
            ch = x16::dp_step(e4m3_to_f32(p[1]), x[k + 1], ch);
            ch = x16::dp_step(e4m3_to_f32(p[0]), x[k], ch);
          }
          acc = std::fma(c[0] + c[1], bf16_to_f32(gp[g].s[o / kBlk]), acc);
        }
        out[(g * NT + t) * GR + r] = acc;
      }
    }
}
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(fp8_block_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX512BF16 || CPUMOE_TIER == CPUMOE_T_AMX
  return x16::install<G16>(k, CPUMOE_MODE_NATIVE, &act_bytes_bf16, &prep_act_bf16);
#elif FP8X16_FMA
  // fp32 x, daz'd, and x times 2^120 (avx2) / 2^8 (avx512f) for the weights' decode without its multiply
  return x16::install<G16>(k, CPUMOE_MODE_NATIVE, &x16fma::act_bytes_xs, &x16fma::prep_act_xs<G16>);
#else
  (void)k;
  return false;  // avxvnni / avx512vnni: avx2 / avx512f runs
#endif
}
