// Shared numerics and the per-tier variant mechanism for the format kernels.
//
// Every file in csrc/formats/ is compiled once per ISA tier with
//   -DCPUMOE_TIER=<cpumoe_tier> -DCPUMOE_TIER_TAG=<tag>
// and the matching -m flags (hatch_build.py). It defines
//   bool CPUMOE_INIT_FN(<fmt>)(cpumoe_kernel* k)
// which installs that tier's functions into k and returns true, or returns
// false when the format has nothing specific at this tier (or for this mode),
// so the registry falls back to the next lower usable tier.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpumoe_formats/abi.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#ifndef CPUMOE_TIER
#define CPUMOE_TIER 0
#define CPUMOE_TIER_TAG scalar
#endif
// Preprocessor-usable tier numbers (the enum in abi.h is invisible to #if).
#define CPUMOE_T_SCALAR 0
#define CPUMOE_T_AVX2 1
#define CPUMOE_T_AVXVNNI 2
#define CPUMOE_T_AVX512F 3
#define CPUMOE_T_AVX512VNNI 4
#define CPUMOE_T_AVX512BF16 5
#define CPUMOE_T_AMX 6
#define CPUMOE_CAT2(a, b) a##b
#define CPUMOE_CAT(a, b) CPUMOE_CAT2(a, b)
#define CPUMOE_INIT_FN(fmt) CPUMOE_CAT(CPUMOE_CAT(cpumoe_init_, fmt), CPUMOE_CAT(_, CPUMOE_TIER_TAG))

// Kernels live in a per-tier namespace so identical inline helpers compiled
// with different -m flags never merge across translation units (ODR).
#define CPUMOE_NS CPUMOE_CAT(tier_, CPUMOE_TIER_TAG)

#if defined(__GNUC__)
#define CPUMOE_INLINE inline __attribute__((always_inline))
#define CPUMOE_LAMBDA_INLINE __attribute__((always_inline))  // after a lambda's parameter list
#define CPUMOE_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 0)
#else
#define CPUMOE_INLINE inline
#define CPUMOE_LAMBDA_INLINE
#define CPUMOE_PREFETCH(p) ((void)0)
#endif

namespace cpumoe {
namespace CPUMOE_NS {

CPUMOE_INLINE float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
CPUMOE_INLINE uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

CPUMOE_INLINE float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

// fp32 -> bf16, round to nearest even; NaN stays a quiet NaN of the same sign.
CPUMOE_INLINE uint16_t f32_to_bf16(float f) { return cpumoe_f32_to_bf16(f); }
CPUMOE_INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// prefetcht0 of every 64-byte line of [p, p + n): the start of a weight stream before its first read, or the
// next expert group's rows while this one runs (rows are too short for an in-stream distance to cover them).
CPUMOE_INLINE void prefetch_span(const uint8_t* p, int64_t n) {
  for (uintptr_t q = (uintptr_t)p & ~(uintptr_t)63, e = (uintptr_t)p + n; q < e; q += 64)
    __builtin_prefetch((const void*)q, 0, 3);
}

// IEEE half -> float, exact for every code (subnormals, inf, NaN).
CPUMOE_INLINE float fp16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    float v = (float)man * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// e4m3fn -> float: bias 7, subnormal m*2^-9, no NaN case: 0x7F/0xFF -> +-480
// (the reference executor's LUT semantics; see docs/formats.md).
CPUMOE_INLINE float e4m3_to_f32(uint8_t b) {
  uint32_t exp = (b >> 3) & 0xFu, man = b & 7u;
  float v = exp == 0 ? (float)man * 0.001953125f : bits_f32(((exp + 120u) << 23) | (man << 20));
  return (b & 0x80u) ? -v : v;
}

// e8m0 -> float: 2^(s-127), s clamped to 254 (255 is NaN in OCP MX; the formats clamp it).
// s = 0 gives 2^-127, an fp32 subnormal, exactly.
CPUMOE_INLINE float e8m0_to_f32(uint8_t s) {
  if (s == 0) return bits_f32(0x00400000u);
  return bits_f32((uint32_t)(s > 254 ? 254 : s) << 23);
}

// The Q8_0 rule every w4a8 mode quantizes its activation blocks with (q4_0, mxfp4, ds_fp4; numerics.int8_blocks
// in Python): d = amax / 127 in fp32, 1/d (0 where it is not finite: amax == 0, or amax < ~127 * 2^-128 overflows
// it), q = clamp(rint(x / d), +-127), half to even (the default rounding mode). A block holding a NaN or an inf
// gets d = NaN and codes 0: its dot products are NaN, as the float64 reference's are (there amax / 127 is NaN or
// inf and 0 * inf is NaN), where the codes alone would have lost the value (NaN and inf * 0 coded -127).
CPUMOE_INLINE float q8_inv(float d) {
  const float id = 1.0f / d;
  return id <= std::numeric_limits<float>::max() ? id : 0.0f;
}
CPUMOE_INLINE int8_t q8_round(float x, float id) {
  const float v = std::nearbyint(x * id);
  return (int8_t)(!(v >= -127.0f) ? -127 : (v > 127.0f ? 127 : (int)v));
}
// The scale of a block whose amax (or an element) is not finite.
CPUMOE_INLINE float nonfinite_scale() { return std::numeric_limits<float>::quiet_NaN(); }
// x[0..n) -> q[0..n); returns d.
CPUMOE_INLINE float q8_block(const float* x, int n, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < n; ++j) {
    const float a = std::fabs(x[j]);
    finite &= a <= std::numeric_limits<float>::max();  // false for inf and NaN
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    std::memset(q, 0, (size_t)n);
    return nonfinite_scale();
  }
  const float d = amax / 127.0f, id = q8_inv(d);
  for (int j = 0; j < n; ++j) q[j] = q8_round(x[j], id);
  return d;
}

#if defined(__AVX2__)
// 8 bf16 at p -> fp32 (exact).
CPUMOE_INLINE __m256 bf16x8_f32(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// amax as bits: |x|'s bits are int32 >= 0 whose integer order is the float order, and every NaN's bits exceed
// +inf's (0x7F800000), so an integer max of them is the exact amax of a finite block and >= kInfBits otherwise
// (a float max would drop NaN lanes).
constexpr uint32_t kInfBits = 0x7F800000u;
CPUMOE_INLINE __m256i absmax8(__m256 x, __m256i amax) {
  return _mm256_max_epi32(_mm256_castps_si256(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)), amax);
}
CPUMOE_INLINE uint32_t hmax8(__m256i m) {  // the largest lane (all lanes >= 0)
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return (uint32_t)_mm_cvtsi128_si32(_mm_max_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}
// q8_block(x, 32, .) on four vectors: the same d (returned in *d) and the same 32 codes, in element order in the
// result's bytes. Bit for bit: exact abs / max, one fp32 division each for d and 1/d, one multiply, round half to
// even (the default mode, as nearbyint), clamp to +-127; a non-finite block d = NaN, codes 0. Used by every SIMD
// tier's w4a8 prep (q4_0, mxfp4, ds_fp4); scalar prep ~1 ns per element was 5-9% of ds_fp4's 16-thread batch-1
// step.
CPUMOE_INLINE __m256i q8_block32(const __m256 (&x)[4], float* d) {
  __m256i m = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) m = absmax8(x[i], m);
  const uint32_t amax = hmax8(m);
  if (amax >= kInfBits) {
    *d = nonfinite_scale();
    return _mm256_setzero_si256();
  }
  *d = bits_f32(amax) / 127.0f;
  const __m256 vid = _mm256_set1_ps(q8_inv(*d));
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(x[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(r), lim), nlim);
  }
  const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]), p23 = _mm256_packs_epi32(qi[2], qi[3]);
  // the packs work per 128-bit lane: dwords come out as elements [0-3 8-11 16-19 24-27 | 4-7 12-15 20-23 28-31]
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
// Sums of the int8 codes of v per 32-bit lane group: lane l = bytes 4l..4l+3 (vpmaddubsw by 1, then vpmaddwd).
CPUMOE_INLINE __m256i sum4_i8(__m256i v) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
}
CPUMOE_INLINE int32_t hsum8_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
// fp32 bits b plus bf16 round-to-nearest-even's bias (0x7FFF + the kept part's lowest bit): its high 16 bits are
// b rounded to bf16 for finite b (ActSink's bf16 store shifts them down, x16.h round_bf16x8 masks them).
CPUMOE_INLINE __m256i bf16_rne_biased(__m256i b) {
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}
#endif

// e2m1 magnitudes; bit 3 is the sign.
static constexpr float kE2M1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                    -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// The fp32 epilogue's constants, shared by activate() and ActSink's lanes (one algorithm in two widths).
namespace act32 {
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = hi + lo
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,  // Cephes' e^r - 1 - r,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};  // over r^2, highest first
constexpr float kExpFloor = -87.33654f;  // below it e^x < FLT_MIN: 0 (1 + e^x is 1 either way)
constexpr float kMinArg = -16.0f;        // the fast path needs sigmoid(a) >= e^-16
constexpr float kLo = 0x1p-100f, kHi = 0x1p100f;  // |g sigmoid(a)| and |result| must lie in [kLo, kHi]
constexpr int32_t kMargin = 32;          // ulp the result must keep from the bf16 rounding midpoint
// gelu_tanh's a = 2 sqrt(2/pi) (g + 0.044715 g^3), in double, rounded once (0.5 (1 + tanh(v)) = sigmoid(2v))
CPUMOE_INLINE float gelu_tanh_arg(float g) {
  const double gd = g;
  return (float)(1.5957691216057307117 * (gd + 0.044715 * (gd * gd * gd)));
}
}  // namespace act32

// e^x in fp32 for x <= 16 (the epilogue's e^-a, a >= -16), max relative error 1.35 ulp (Cody-Waite reduction by
// ln 2, Cephes' degree-6 polynomial), no libm; x < kExpFloor -> 0, NaN -> NaN.
CPUMOE_INLINE float exp_f32(float x) {
  using namespace act32;
  if (x < kExpFloor) return 0.0f;
  const float n = std::nearbyint(x * kLog2e);  // -126 <= n <= 24
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;  // r in [-0.35, 0.35]
  float q = kExpPoly[0];
  for (int i = 1; i < 6; ++i) q = q * r + kExpPoly[i];
  return (q * (r * r) + r + 1.0f) * bits_f32((uint32_t)((int)n + 127) << 23);
}

// The activation epilogue in double with libm, the reference's formulas (activations.py): activate()'s path for
// the rare arguments its fp32 path leaves (below).
inline float activate_f64(const cpumoe_params& p, float gate_f, float up_f) {
  double gate = gate_f, up = up_f;
  switch (p.act) {
    case CPUMOE_ACT_SILU: return (float)(gate / (1.0 + std::exp(-gate)) * up);
    case CPUMOE_ACT_GELU: return (float)(0.5 * gate * (1.0 + std::erf(gate * 0.70710678118654752440)) * up);
    case CPUMOE_ACT_GELU_TANH: {
      const double c = 0.79788456080286535588;  // sqrt(2/pi)
      return (float)(0.5 * gate * (1.0 + std::tanh(c * (gate + 0.044715 * gate * gate * gate))) * up);
    }
    default: {  // swigluoai / swiglu_clamp
      double lim = p.limit;
      if (gate > lim) gate = lim;
      if (up > lim) up = lim;
      if (up < -lim) up = -lim;
      double s = gate / (1.0 + std::exp(-(double)p.alpha * gate));
      return (float)(p.act == CPUMOE_ACT_SWIGLUOAI ? s * (up + 1.0) : s * up);
    }
  }
}

// Activation epilogue act(gate) * up, whose result every caller rounds to bf16 at once. silu, gelu_tanh and the
// swiglus are one form, g * sigmoid(a) * u = g / (1 + e^-a) * u (gelu_tanh: 0.5 (1 + tanh(v)) = sigmoid(2v)),
// computed in fp32 with exp_f32 (a exact, or its double value rounded once). Error of that fp32 result against the
// double path: a's rounding, <= 0.5 ulp of |a| <= 16, moves sigmoid(a) by <= 8 ulp; exp_f32 1.35 ulp; 1 + e, the
// division, the product and swigluoai's u + 1 0.5 ulp each: < 12 fp32 ulp. Where the result's 16 bits below bf16 precision lie within 32 ulp
// of the bf16 rounding midpoint (0.1% of results), the double path runs: so the bf16 of activate() is always that
// of activate_f64() (tests/test_activation.py checks it over a million arguments per activation). The double path
// also takes sigmoid(a) < e^-16, results or g sigmoid(a) outside [2^-100, 2^100] (subnormal double roundings,
// 1 + tanh cancelling to 0 as in the reference), non-finite values and gelu (erf). Why the fp32 path:
// libm exp / tanh per element (the double path alone) took 6-10% of a single-thread step.
CPUMOE_INLINE float activate(const cpumoe_params& p, float gate_f, float up_f) {
  using namespace act32;
  float g = gate_f, u = up_f, a;
  switch (p.act) {
    case CPUMOE_ACT_SILU: a = g; break;
    case CPUMOE_ACT_GELU: return activate_f64(p, gate_f, up_f);
    case CPUMOE_ACT_GELU_TANH: a = gelu_tanh_arg(g); break;
    default:  // swigluoai / swiglu_clamp
      if (g > p.limit) g = p.limit;
      if (u > p.limit) u = p.limit;
      if (u < -p.limit) u = -p.limit;
      a = p.alpha * g;  // the exact product rounded once, as (float)(alpha * (double)g)
      if (p.act == CPUMOE_ACT_SWIGLUOAI) u = u + 1.0f;
  }
  if (a >= kMinArg) {
    const float s = g / (1.0f + exp_f32(-a)), r = s * u, as = std::fabs(s), ar = std::fabs(r);
    const int32_t below = (int32_t)(f32_bits(r) & 0xFFFFu) - 0x8000;  // the bits bf16 rounds away, - midpoint
    if (as >= kLo && ar >= kLo && ar <= kHi && (below > kMargin || below < -kMargin)) return r;
  }
  return activate_f64(p, gate_f, up_f);
}

// The epilogue of a gate_up work item in SIMD lanes: put(dst, gate, up) collects, every kLanes pairs (and at
// flush() / the end of the scope) *dst = bf16(activate(gate, up)) is computed for all of them at once. Each lane
// runs activate()'s fp32 path (the same algorithm and error bound: < 12 fp32 ulp against activate_f64) and its
// checks; lanes that fail them go through activate_f64 one by one. So every *dst holds bf16(activate_f64), as
// with activate(), whatever the tier (tests/test_activation.py runs it through the kernels' lanes too). Scalar
// tiers call activate() per pair. Why: activate() per element was still ~10% of a nvfp4 w4a8 step on the Zen 4 VM
// (scalar exp polynomial, division and checks per element).
class ActSink {
 public:
#if defined(__AVX512F__)
  static constexpr int kLanes = 16;
#elif defined(__AVX2__)
  static constexpr int kLanes = 8;
#else
  static constexpr int kLanes = 1;
#endif
  explicit ActSink(const cpumoe_params& p) : p_(p) {}
  ActSink(const ActSink&) = delete;
  ActSink& operator=(const ActSink&) = delete;
  ~ActSink() { flush(); }
  CPUMOE_INLINE void put(uint16_t* dst, float gate, float up) {
    if constexpr (kLanes == 1) {
      *dst = f32_to_bf16(activate(p_, gate, up));
    } else {
      g_[n_] = gate, u_[n_] = up, dst_[n_] = dst;
      if (++n_ == kLanes) flush();
    }
  }
  void flush() {
    if constexpr (kLanes > 1) {
      if (n_ == 0) return;
      for (int i = n_; i < kLanes; ++i) g_[i] = u_[i] = 0.0f;
      alignas(64) uint32_t out[kLanes];
      const unsigned ok = lanes(out);
      for (int i = 0; i < n_; ++i)
        *dst_[i] = (ok >> i & 1) ? (uint16_t)out[i] : f32_to_bf16(activate_f64(p_, g_[i], u_[i]));
      n_ = 0;
    }
  }

 private:
#if defined(__AVX512F__)
  using V = __m512;
  static V ld(const float* x) { return _mm512_loadu_ps(x); }
  static V set(float v) { return _mm512_set1_ps(v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V vmin(V a, V b) { return _mm512_min_ps(a, b); }
  static V vmax(V a, V b) { return _mm512_max_ps(a, b); }
  static V rint(V a) { return _mm512_roundscale_ps(a, 0); }  // to nearest even
  static unsigned ge(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static V vabs(V a) { return _mm512_abs_ps(a); }
  // 2^n, n integral in [-126, 127]: n + 2^23 + 127 holds n + 127 in its low mantissa bits, which the shift moves
  // into the exponent field (no float -> int conversion: SIMDe 0.7 has none for 512 bits)
  static V pow2(V n) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(add(n, set(8388735.0f))), 23)); }
  static unsigned margin_ok(V r) {  // the 16 bits bf16 drops are > kMargin ulp from the midpoint 0x8000
    const __m512i low = _mm512_and_si512(_mm512_castps_si512(r), _mm512_set1_epi32(0xFFFF));
    const __m512i d = _mm512_abs_epi32(_mm512_sub_epi32(low, _mm512_set1_epi32(0x8000)));
    return _mm512_cmpgt_epi32_mask(d, _mm512_set1_epi32(act32::kMargin));
  }
  static void bf16_store(V r, uint32_t* out) {  // round to nearest even (finite lanes; the others are replaced)
    const __m512i b = _mm512_castps_si512(r);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    _mm512_store_si512(out, _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
  }
#elif defined(__AVX2__)
  using V = __m256;
  static V ld(const float* x) { return _mm256_loadu_ps(x); }
  static V set(float v) { return _mm256_set1_ps(v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V vmin(V a, V b) { return _mm256_min_ps(a, b); }
  static V vmax(V a, V b) { return _mm256_max_ps(a, b); }
  static V rint(V a) { return _mm256_round_ps(a, 0); }  // to nearest even
  static unsigned ge(V a, V b) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
  static V vabs(V a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  static V pow2(V n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(add(n, set(8388735.0f))), 23)); }
  static unsigned margin_ok(V r) {
    const __m256i low = _mm256_and_si256(_mm256_castps_si256(r), _mm256_set1_epi32(0xFFFF));
    const __m256i d = _mm256_abs_epi32(_mm256_sub_epi32(low, _mm256_set1_epi32(0x8000)));
    return (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(d, _mm256_set1_epi32(act32::kMargin))));
  }
  static void bf16_store(V r, uint32_t* out) {
    _mm256_store_si256((__m256i*)out, _mm256_srli_epi32(bf16_rne_biased(_mm256_castps_si256(r)), 16));
  }
#endif
#if defined(__AVX2__)
  // activate()'s fp32 path in kLanes lanes; returns the lanes whose result passed its checks (their bf16 in out).
  unsigned lanes(uint32_t* out) const {
    using namespace act32;
    V g = ld(g_), u = ld(u_), a;
    switch (p_.act) {
      case CPUMOE_ACT_SILU: a = g; break;
      case CPUMOE_ACT_GELU_TANH: {  // per lane in double (SIMDe 0.7 lacks the 512-bit float <-> double converts)
        alignas(64) float av[kLanes];
        for (int i = 0; i < kLanes; ++i) av[i] = gelu_tanh_arg(g_[i]);
        a = ld(av);
        break;
      }
      case CPUMOE_ACT_GELU: return 0;  // the double path
      default:  // swigluoai / swiglu_clamp: clamps as activate() (NaN lanes fail the checks below either way)
        // min/max return their second operand when one is NaN: a NaN g or u stays NaN (as activate()'s ifs)
        g = vmin(set(p_.limit), g), u = vmax(set(-p_.limit), vmin(set(p_.limit), u));
        a = mul(set(p_.alpha), g);
        if (p_.act == CPUMOE_ACT_SWIGLUOAI) u = add(u, set(1.0f));
    }
    // exp_f32(-a), floored at kExpFloor as a clamp (e^-a -> ~1e-38: 1 + e^-a is 1 as with exp_f32's 0)
    const V x = vmax(sub(set(0.0f), a), set(kExpFloor));
    const V n = rint(mul(x, set(kLog2e)));
    const V r = sub(sub(x, mul(n, set(kLn2Hi))), mul(n, set(kLn2Lo)));
    V q = set(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) q = add(mul(q, r), set(kExpPoly[i]));
    // lanes with a < kMinArg (n > 24, even inf / NaN) are rejected below; n <= 127 keeps their 2^n a float
    const V e = mul(add(add(mul(q, mul(r, r)), r), set(1.0f)), pow2(vmin(n, set(127.0f))));
    const V s = vdiv(g, add(set(1.0f), e)), res = mul(s, u);
    const V as = vabs(s), ar = vabs(res);
    const unsigned ok = ge(a, set(kMinArg)) & ge(as, set(kLo)) & ge(ar, set(kLo)) & ge(set(kHi), ar) & margin_ok(res);
    bf16_store(res, out);
    return ok;
  }
#if defined(__AVX512F__)
  static V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
#else
  static V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
#endif
#else
  unsigned lanes(uint32_t*) const { return 0; }  // never called (kLanes == 1)
#endif
  const cpumoe_params& p_;
  alignas(64) float g_[kLanes > 1 ? kLanes : 1], u_[kLanes > 1 ? kLanes : 1];
  uint16_t* dst_[kLanes > 1 ? kLanes : 1];
  int n_ = 0;
};

}  // namespace CPUMOE_NS
}  // namespace cpumoe

// Bank helpers (byte strides from the Python side).
template <class T>
CPUMOE_INLINE const T* bank_row(const cpumoe_bank& b, int64_t e, int64_t row) {
  return (const T*)((const char*)b.ptr + e * b.expert_stride + row * b.row_stride);
}
