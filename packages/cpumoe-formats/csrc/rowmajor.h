// Work-item loops shared by the row-major formats (bf16, fp8_block): a format
// supplies only its row dot for its tier.
//
//   struct Dot {
//     static constexpr bool kRoundGateUp = false;   // ds_fp4: gate/up -> bf16 before the activation
//     static constexpr bool kRoundRouteTerm = false; // ds_fp4: each route's term -> bf16 before the sum
//     // pass 0: gate_up row `row` (K = H), pass 1: down row `row` (K = I); act is a prepared vector
//     static float dot(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row, const void* act);
//     // optional, the multi-token micro-kernel: out[t] = dot(row, acts[t]) for NT = 1..kMaxNT tokens at once
//     static constexpr int kMaxNT = 4;
//     template <int NT> static void dotn(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e,
//                                        int row, const void* const* acts, float* out);
//   };
//
// Several tokens routed to one expert share each weight row: the row is pulled from DRAM once. With dotn the
// row is also DECODED once per chunk and FMA'd into the accumulators of up to kMaxNT tokens (register
// blocking), so batch n costs n FMA streams, not n decodes + n reductions. Contract of dotn: every token's
// arithmetic (its chains, their order, the final reduction) is the same whatever NT and whichever other
// tokens share the call, so a token's output never depends on its batch (tests/test_batch_identity.py).
#pragma once
#include <type_traits>

#include "common.h"

// Full unrolling of the small constant loops over tokens / chains of the micro-kernels: without it GCC may
// keep accumulator arrays in memory.
#if defined(__clang__)
#define CPUMOE_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define CPUMOE_UNROLL _Pragma("GCC unroll 16")
#else
#define CPUMOE_UNROLL
#endif

namespace cpumoe {
namespace CPUMOE_NS {

// Dot::kMaxNT, or 1 for a Dot without dotn.
template <class D, class = void>
struct MaxNT : std::integral_constant<int, 1> {
  static constexpr bool has_dotn = false;
};
template <class D>
struct MaxNT<D, std::void_t<decltype(D::kMaxNT)>> : std::integral_constant<int, D::kMaxNT> {
  static constexpr bool has_dotn = true;
};

// out[t] = Dot's dot of `row` with acts[t], t < nt (nt <= MaxNT<Dot>), through dotn<nt> where the Dot has it.
template <class Dot, int NT = MaxNT<Dot>::value>
CPUMOE_INLINE void dot_tokens(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row, int nt,
                              const void* const* acts, float* out) {
  if constexpr (NT == 1) {
    (void)nt;
    if constexpr (!MaxNT<Dot>::has_dotn)
      out[0] = Dot::dot(k, banks, pass, e, row, acts[0]);
    else
      Dot::template dotn<1>(k, banks, pass, e, row, acts, out);
  } else {
    if (nt == NT)
      Dot::template dotn<NT>(k, banks, pass, e, row, acts, out);
    else
      dot_tokens<Dot, NT - 1>(k, banks, pass, e, row, nt, acts, out);
  }
}

// gate_up when a work item's tokens fill several token blocks (n > NT): kRowChunk rows at a time and, within them,
// one token block after another (the chunk's gate rows, then its up rows). A block's prepared activations then
// stay in L1 while the chunk's weight rows come again from L2 for the next block; row by row, every block's
// activations came from L2 for every row (fp8_block's fp32 activations: 4 bytes per code and token against the
// weights' one; 30% of the H200 host's shared batch-8 step). The same dot calls in another order, so the same bits.
//   dot(row, j0, nt, out): out[t] = dot of bank row `row` (gate rows [0, I), up rows [I, 2I)) with token j0 + t
//   put(i, j, gate, up):   token j's gate / up of row i
constexpr int kRowChunk = 16;
template <int NT, class Dot, class Put>
CPUMOE_INLINE void gate_up_row_chunks(int32_t i0, int32_t i1, int32_t inter, int32_t n, Dot&& dot, Put&& put) {
  for (int32_t i = i0; i < i1; i += kRowChunk) {
    const int rc = i1 - i < kRowChunk ? i1 - i : kRowChunk;
    for (int32_t j0 = 0; j0 < n; j0 += NT) {
      const int nt = n - j0 < NT ? n - j0 : NT;
      float gate[kRowChunk][NT], up[kRowChunk][NT];
      for (int r = 0; r < rc; ++r) dot(i + r, j0, nt, gate[r]);
      for (int r = 0; r < rc; ++r) dot(inter + i + r, j0, nt, up[r]);
      for (int r = 0; r < rc; ++r)
        for (int t = 0; t < nt; ++t) put(i + r, j0 + t, gate[r][t], up[r][t]);
    }
  }
}

// gate_up_row_chunks' usual put: g = act(gate * w_in, up * w_in), each product rounded to bf16 first when kRound
// (ds_fp4), into the sink (fp8_block's avx2 / avx512f kernel scales by its own factors instead).
template <bool kRound>
CPUMOE_INLINE auto gate_up_put(ActSink& sink, uint16_t* const* g, const float* w_in) {
  return [&sink, g, w_in](int32_t i, int32_t j, float gt, float ut) {
    gt *= w_in[j], ut *= w_in[j];
    if (kRound) gt = round_bf16(gt), ut = round_bf16(ut);
    sink.put(&g[j][i], gt, ut);
  };
}

template <class Dot>
void rowmajor_gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
                      const void* const* xs, const float* w_in, uint16_t* const* g) {
  constexpr int NT = MaxNT<Dot>::value;
  const cpumoe_params& p = k->params;
  ActSink sink(p);  // g in SIMD lanes (common.h)
  if (n > NT) {
    gate_up_row_chunks<NT>(
        i0, i1, p.inter, n,
        [&](int32_t row, int32_t j0, int nt, float* out) { dot_tokens<Dot>(k, banks, 0, e, row, nt, xs + j0, out); },
        gate_up_put<Dot::kRoundGateUp>(sink, g, w_in));
    return;
  }
  for (int32_t i = i0; i < i1; ++i) {
    for (int32_t j0 = 0; j0 < n; j0 += NT) {  // token blocks: each decode of a row chunk serves nt tokens
      const int nt = n - j0 < NT ? n - j0 : NT;
      float gate[NT], up[NT];
      dot_tokens<Dot>(k, banks, 0, e, i, nt, xs + j0, gate);
      dot_tokens<Dot>(k, banks, 0, e, p.inter + i, nt, xs + j0, up);
      for (int t = 0; t < nt; ++t) {
        float gt = gate[t] * w_in[j0 + t], ut = up[t] * w_in[j0 + t];
        if (Dot::kRoundGateUp) gt = round_bf16(gt), ut = round_bf16(ut);
        sink.put(&g[j0 + t][i], gt, ut);
      }
    }
  }
}

// Dot::rows_acc (optional): for down rows [h0, h1) and one route when I <= kSmallK:
// out[h - h0] += dot(h, act) * weight (product rounded, then the sum: the same two roundings as the row path
// below). At tiny I a row's dot is a few lanes and its fixed cost (call, chains, horizontal sum) is everything:
// the 2,048 rows of an H = 2048 layer with I = 8 took ~25 us one row at a time, a few us in blocks.
template <class D, class = void>
struct SmallK {
  static constexpr bool value = false;
  static bool applies(const cpumoe_kernel*) { return false; }
};
template <class D>
struct SmallK<D, std::void_t<decltype(D::kSmallK)>> {
  static_assert(!D::kRoundRouteTerm, "rows_acc adds unrounded route terms");
  static constexpr bool value = true;
  static bool applies(const cpumoe_kernel* k) { return k->params.inter <= D::kSmallK; }
};

template <class Dot>
void rowmajor_down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
                   int32_t n, float* acc, int64_t acc_stride) {
  constexpr int NT = MaxNT<Dot>::value;
  if constexpr (SmallK<Dot>::value) {
    if (SmallK<Dot>::applies(k)) {  // route by route (tokens never share a row's registers here), rows in blocks
      for (int32_t j = 0; j < n; ++j)
        Dot::rows_acc(k, banks, routes[j].expert, h0, h1, routes[j].act, routes[j].weight,
                      acc + routes[j].token * acc_stride);
      return;
    }
  }
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int32_t e = routes[a].expert;
    for (int32_t h = h0; h < h1; ++h)
      for (int32_t r0 = a; r0 < b; r0 += NT) {  // route blocks of the expert group
        const int nt = b - r0 < NT ? b - r0 : NT;
        const void* acts[NT];
        float y[NT];
        for (int t = 0; t < nt; ++t) acts[t] = routes[r0 + t].act;
        dot_tokens<Dot>(k, banks, 1, e, h, nt, acts, y);
        for (int t = 0; t < nt; ++t) {
          const cpumoe_route& r = routes[r0 + t];
          float v = y[t] * r.weight;
          if (Dot::kRoundRouteTerm) v = round_bf16(v);
          acc[r.token * acc_stride + (h - h0)] += v;
        }
      }
    a = b;
  }
}

// Installs the shared loops for a Dot.
template <class Dot>
void install_rowmajor(cpumoe_kernel* k) {
  k->gate_up = &rowmajor_gate_up<Dot>;
  k->down = &rowmajor_down<Dot>;
}

// Horizontal sums.
#if defined(__AVX2__)
CPUMOE_INLINE float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
CPUMOE_INLINE int32_t hsum256_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif
#if defined(__AVX512F__)
CPUMOE_INLINE float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// bf16 activation vector -> fp32 (the usual prepared form for fp32 dots).
inline size_t act_bytes_f32(const cpumoe_kernel*, int32_t K) { return (size_t)K * sizeof(float); }
inline void prep_act_f32(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  float* d = (float*)dst;
  for (int32_t i = 0; i < K; ++i) d[i] = bf16_to_f32(src[i]);
}
inline size_t act_bytes_bf16(const cpumoe_kernel*, int32_t K) { return (size_t)K * sizeof(uint16_t); }
inline void prep_act_bf16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  std::memcpy(dst, src, (size_t)K * sizeof(uint16_t));
}

}  // namespace CPUMOE_NS
}  // namespace cpumoe
