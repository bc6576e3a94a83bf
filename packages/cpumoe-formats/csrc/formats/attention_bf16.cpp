// Decode attention (abi.h cpumoe_attention, ABI 1.11): softmax(scale * q k^T, masked) v for a few query tokens over
// a bf16 key/value cache, kv heads [g0, g1), each kv head's `group` query heads together (grouped-query attention:
// a cache row is read once for all of them). Only the positions the mask lets through are read, so a static cache
// costs what its filled part holds, not its length.
//
// Numerics: q, k, v widened from bf16; scores as fp32 dots (16 partial sums over D, a fixed reduction tree, so
// every tier gives the same bits under -ffp-contract=off); softmax with the row's max subtracted (expv, ~1 ulp),
// its weights normalized once, the output accumulated in fp32 over the positions in order, rounded once to bf16. NaN and inf
// follow the float64 reference (reference.attention): a NaN score or inf - inf makes the head's row NaN, a query
// token with no position let through gets NaN (softmax over nothing).
// Tiers: scalar, avx2, avx512f: the same code over GCC vectors of the tier's width (below), for the 16
// partial sums and the D-long rows); the other tiers run the highest of these below them.
#include "../rowmajor.h"  // common.h and CPUMOE_UNROLL

#if defined(__GNUC__)
// vectors pass between inline functions of this file only: the vector ABI note of tiers without AVX-512 is moot
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

// 16 fp32 lanes as GCC vectors of the tier's width W (one V16 at avx512f, two V8 at avx2 and at scalar, where the
// compiler maps a V8 to SSE pairs): lane-wise ops in the same order, so the bits do not depend on the tier.
constexpr int kLanes = 16;
#if CPUMOE_TIER >= CPUMOE_T_AVX512F
typedef float VF __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t VI __attribute__((vector_size(64)));
typedef uint32_t VU __attribute__((vector_size(64)));
typedef uint16_t VH __attribute__((vector_size(32), aligned(2), may_alias));
#else
typedef float VF __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t VI __attribute__((vector_size(32)));
typedef uint32_t VU __attribute__((vector_size(32)));
typedef uint16_t VH __attribute__((vector_size(16), aligned(2), may_alias));
#endif
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));
constexpr int W = sizeof(VF) / sizeof(float);  // lanes a vector
constexpr int R = kLanes / W;                  // vectors a group of 16

CPUMOE_INLINE VF widen(const uint16_t* p) {
  const VU u = __builtin_convertvector(*(const VH*)p, VU) << 16;
  VF f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

CPUMOE_INLINE VF load(const float* p) { return *(const VF*)p; }
CPUMOE_INLINE void store(float* p, VF v) { *(VF*)p = v; }

// The 16 lanes' sum, folded in halves: lane i + lane i + 8, then + 4, + 2, + 1.
CPUMOE_INLINE float fold(const VF (&a)[R]) {
#if CPUMOE_TIER >= CPUMOE_T_AVX512F
  const V8 h8 = __builtin_shufflevector(a[0], a[0], 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(a[0], a[0], 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const V8 h8 = a[0] + a[1];
#endif
  const V4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// out[h * os] = scale * dot(q[h, 0:D], row[0:D]) for NH heads of fp32 rows (q's rows D apart): per head 16 partial
// sums, folded, then the tail of D % 16 in order; the heads' sums interleaved, so NH independent chains hide the
// FMA latency one head's chain waits on (the bits are one head's alone: the same order for each).
template <int NH>
CPUMOE_INLINE void dots(const float* q, const float* row, int32_t D, float scale, float* out, size_t os) {
  VF acc[NH][R] = {};
  int32_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    VF rv[R];
    for (int r = 0; r < R; ++r) rv[r] = load(row + d + r * W);
    CPUMOE_UNROLL
    for (int h = 0; h < NH; ++h)
      for (int r = 0; r < R; ++r) acc[h][r] += load(q + (size_t)h * D + d + r * W) * rv[r];
  }
  CPUMOE_UNROLL
  for (int h = 0; h < NH; ++h) {
    float s = fold(acc[h]);
    for (int32_t e = d; e < D; ++e) s += q[(size_t)h * D + e] * row[e];
    out[h * os] = s * scale;
  }
}

// row[0:D] = the bf16 row widened
CPUMOE_INLINE void widen_row(const uint16_t* src, int32_t D, float* row) {
  int32_t d = 0;
  for (; d + W <= D; d += W) store(row + d, widen(src + d));
  for (; d < D; ++d) row[d] = bf16_to_f32(src[d]);
}

// e^x for x <= 0 (a score minus its row's max), W at a time: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial of r (Cephes' expf coefficients, ~1 ulp), times 2^n. -inf and x < -87.3 (below fp32's normal range)
// give 0, NaN gives NaN.
CPUMOE_INLINE VF expv(VF x) {
  const VF t = x * 1.44269504088896341f;
  const VF n = (t + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23): |t| < 2^22
  const VF r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  VF p = VF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.f;
  const VI ni = __builtin_convertvector(n < -126.f ? VF{} - 126.f : n, VI);
  const VI bits = (ni + 127) << 23;
  VF scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const VF e = p * scale;
  return x < -87.33654475f ? VF{} : e;
}

// query heads whose scores a cache row's dots compute together, their chains in flight at once: 8 of one zmm at
// avx512f (9 of 32 registers), 4 of two ymm at avx2 (10 of 16)
constexpr int kHeads = R == 1 ? 8 : 4;
constexpr int kBlock = 16;  // positions whose v rows are widened together (16 x D floats: 8 KB at D = 128, in L1)
constexpr int kRegs = 8;    // accumulator vectors a head keeps in registers over a block (of 32 zmm / 16 ymm)

// ai[0 : NC W] += sum over the block's positions jj of pi[jj] * vb[jj, 0 : NC W], in position order, with the NC
// accumulator vectors in registers (NC a compile-time constant: an array indexed at run time is kept on the stack)
template <int NC>
CPUMOE_INLINE void pv_block(float* ai, const float* pi, const float* vb, int32_t D, int32_t nb) {
  VF r[NC];
  CPUMOE_UNROLL
  for (int c = 0; c < NC; ++c) r[c] = load(ai + c * W);
  for (int32_t jj = 0; jj < nb; ++jj) {
    const VF p = VF{} + pi[jj];
    const float* vj = vb + (size_t)jj * D;
    CPUMOE_UNROLL
    for (int c = 0; c < NC; ++c) r[c] += p * load(vj + c * W);
  }
  CPUMOE_UNROLL
  for (int c = 0; c < NC; ++c) store(ai + c * W, r[c]);
}

size_t scratch_bytes(const cpumoe_attention*, int32_t group, int32_t D, int32_t L) {
  // q and the accumulators (group x D each), a widened cache row (D), the scores (group x L, padded to 16), the
  // positions (L + 16)
  const size_t Lp = ((size_t)L + kLanes - 1) / kLanes * kLanes;
  return sizeof(float) * ((size_t)group * (2 * (size_t)D + Lp) + (size_t)D + kLanes + (size_t)kBlock * D) +
         sizeof(int32_t) * (Lp + kLanes) + 192;
}

void heads(const cpumoe_attention*, const cpumoe_attention_args* a, int32_t g0, int32_t g1, void* scratch) {
  const int32_t G = a->group, D = a->D, L = a->L;
  const int32_t Lp = (L + kLanes - 1) / kLanes * kLanes;
  float* qf = (float*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);  // [G, D]
  float* acc = qf + (size_t)G * D;                                     // [G, D]
  float* row = acc + (size_t)G * D;                                    // [D + 16]: a widened cache row
  float* s = row + (D + kLanes) / kLanes * kLanes;                     // [G, Lp]: the let-through positions' scores
  float* vb = s + (size_t)G * Lp;                                      // [kBlock, D]: a block's widened v rows
  int32_t* pos = (int32_t*)(vb + (size_t)kBlock * D);                  // [Lp]: those positions
  const float ninf = -std::numeric_limits<float>::infinity();
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  for (int32_t t = 0; t < a->n; ++t) {
    const uint8_t* m = a->mask ? a->mask + t * a->mask_tok : nullptr;
    int32_t nv = 0;
    for (int32_t j = 0; j < L; ++j)
      if (!m || m[j]) pos[nv++] = j;
    const int32_t nvp = (nv + kLanes - 1) / kLanes * kLanes;
    for (int32_t g = g0; g < g1; ++g) {
      for (int32_t i = 0; i < G; ++i) widen_row(a->q + t * a->q_tok + (int64_t)(g * G + i) * a->q_head, D, qf + i * D);
      const uint16_t* kh = a->k + g * a->k_head;
      const uint16_t* vh = a->v + g * a->v_head;
      for (int32_t jj = 0; jj < nv; ++jj) {
        widen_row(kh + pos[jj] * a->k_pos, D, row);  // once for the group's heads
        int32_t i = 0;
        for (; i + kHeads <= G; i += kHeads) dots<kHeads>(qf + i * D, row, D, a->scale, s + (size_t)i * Lp + jj, Lp);
        for (; i < G; ++i) dots<1>(qf + i * D, row, D, a->scale, s + (size_t)i * Lp + jj, Lp);  // the heads left
      }
      for (int32_t i = 0; i < G; ++i) {
        float* si = s + (size_t)i * Lp;
        for (int32_t jj = nv; jj < nvp; ++jj) si[jj] = ninf;  // padding lanes: e^-inf = 0
        float mx = ninf;
        bool nan = false;
        for (int32_t jj = 0; jj < nv; ++jj) {
          nan |= si[jj] != si[jj];
          mx = si[jj] > mx ? si[jj] : mx;
        }
        if (nan) mx = qnan;  // a NaN score makes the whole row NaN, as the reference's max does
        VF z[R] = {};
        for (int32_t jj = 0; jj < nvp; jj += kLanes)
          for (int r = 0; r < R; ++r) {
            const VF e = expv(load(si + jj + r * W) - mx);
            store(si + jj + r * W, e);
            z[r] += e;
          }
        const float inv = nv ? 1.f / fold(z) : qnan;
        for (int32_t jj = 0; jj < nvp; ++jj) si[jj] *= inv;  // p, normalized once per score
        std::memset(acc + (size_t)i * D, 0, sizeof(float) * D);
      }
      // o += p v, a block of kBlock positions at a time: their v rows widened once into vb, then each head's
      // accumulators held in registers over the block (kRegs vectors of D at a time); per element the sum still
      // runs over the positions in order
      for (int32_t jb = 0; jb < nv; jb += kBlock) {
        const int32_t nb = nv - jb < kBlock ? nv - jb : kBlock;
        for (int32_t jj = 0; jj < nb; ++jj) widen_row(vh + pos[jb + jj] * a->v_pos, D, vb + (size_t)jj * D);
        for (int32_t i = 0; i < G; ++i) {
          const float* pi = s + (size_t)i * Lp + jb;
          float* ai = acc + (size_t)i * D;
          int32_t d0 = 0;
          for (; d0 + kRegs * W <= D; d0 += kRegs * W) pv_block<kRegs>(ai + d0, pi, vb + d0, D, nb);
          switch ((D - d0) / W) {  // the vectors left (fewer than kRegs)
            case 7: pv_block<7>(ai + d0, pi, vb + d0, D, nb); break;
            case 6: pv_block<6>(ai + d0, pi, vb + d0, D, nb); break;
            case 5: pv_block<5>(ai + d0, pi, vb + d0, D, nb); break;
            case 4: pv_block<4>(ai + d0, pi, vb + d0, D, nb); break;
            case 3: pv_block<3>(ai + d0, pi, vb + d0, D, nb); break;
            case 2: pv_block<2>(ai + d0, pi, vb + d0, D, nb); break;
            case 1: pv_block<1>(ai + d0, pi, vb + d0, D, nb); break;
            default: break;
          }
          for (int32_t d = D / W * W; d < D; ++d)
            for (int32_t jj = 0; jj < nb; ++jj) ai[d] += pi[jj] * vb[(size_t)jj * D + d];
        }
      }
      for (int32_t i = 0; i < G; ++i) {
        uint16_t* o = a->o + t * a->o_tok + (int64_t)(g * G + i) * a->o_head;
        const float* ai = acc + (size_t)i * D;
        for (int32_t d = 0; d < D; ++d) o[d] = f32_to_bf16(nv ? ai[d] : qnan);
      }
    }
  }
}

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(attention_bf16)(cpumoe_attention* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
  k->scratch_bytes = &scratch_bytes;
  k->heads = &heads;
  return true;
#else
  (void)k;
  return false;  // nothing of its own: the tier below runs
#endif
}
