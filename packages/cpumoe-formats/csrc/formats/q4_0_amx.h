// q4_0 mode w4a8 on AMX int8 tiles (tier amx, opt-in; included by q4_0.cpp at that tier only).
//
// Why: the avx512vnni kernel spends 32 vpdpbusd per 32-K block of 16 rows for every token, so a batch of 8
// tokens sharing an expert costs ~3.6x one token (16-thread executor, H200 host). On tiles one instruction
// takes the blocks of 16 rows for several tokens at once; what stays per token is a 4-op fold of 16 rows.
// q4_0's scale d changes every 32 K, so a tile's int32 sums cannot run past a block: one tile product covers
// kPair blocks (1 or 2; K = 32 kPair bytes, AMX's most is 64) and keeps their sums apart in separate C rows:
//   A = the tokens' Q8_0 int8 activations, row j * nt + t = token t's block j of the product at bytes 32 j ..
//       32 j + 31, zeros elsewhere (kPair * nt <= 16 rows of 32 kPair bytes; for kPair = 1 and one token its
//       prepared vector read in place, otherwise laid out once per work item);
//   B = 16 weight rows' (nibble - 8) in AMX's 4-byte K groups: B[8 j + r][c] = row c's elements 4r..4r+3 of
//       block j. The K group r < 4 is the low nibbles of bytes 4r..4r+3 of the block's qs, r >= 4 the high
//       nibbles of bytes 4(r-4)..: one 16-row dword gather per r, masked and shifted;
//   C = int32, row j * nt + t = exactly sum((nibble - 8) * q) over block j for every (token, row) (TDPBSSD).
// The fold: acc[t][rows] = fma(float(C), fp32(fp16(d)[rows] * d_a[t]), acc[t]), block by block in K order, the
// scale s = fp32(d * d_a) of the w4a8 definition (q4_0.cpp). Every (token, row) element depends only on its
// token, its row and the K order (not on kPair), so a token's result does not depend on its batch or on which
// tokens share the tile, and a row's does not depend on the work split. Against the other w4a8 tiers the
// integer block sums are the same; the fp32 sums are grouped per whole block (avx512vnni: 8-element lanes).
// Two sets of 16 rows run per product (gate and up; down: rows h and h + 16), so two tile products are in
// flight while the other set's C is folded.
// kPair 2: 51% of the read ceiling against 41-46% with 1 (H200 host, one thread; docs/formats/q4_0.md); software
// prefetch 1 KB ahead in every row is slower (42%). Weights as A tiles with a contiguous
// (vpermb) decode and tokens as B was slower still (28%): it moves 16-row A tiles and C stores per block where
// tokens as A move nt rows.
#pragma once
// (included inside q4_0.cpp's namespaces: <cstring>, <vector> and amx_common.h come with q4_0.cpp)

#ifndef CPUMOE_Q4_AMX_PAIR
#define CPUMOE_Q4_AMX_PAIR 2  // blocks per tile product (1 or 2; build knob, bench/device/kernel_sweep.sh)
#endif

namespace amx4 {
constexpr int kRows = 16, kBlk = QK, kPair = CPUMOE_Q4_AMX_PAIR, kTok = 16 / kPair;  // kTok: tokens per product
static_assert(kPair == 1 || kPair == 2, "a tile product covers 1 or 2 blocks (K <= 64 bytes)");

// palette 1: tile 0 = A (kPair nt rows x 32 kPair B), 1 / 2 = B of sets 0 / 1 (8 kPair rows x 64 B), 3 / 4 = C of
// sets 0 / 1 (kPair nt rows x 64 B).
using amx::TileConfig;
using amx::Tiles;
inline TileConfig tile_config(int nt) {
  TileConfig c;
  c.set(0, kPair * nt, kPair * kBlk);
  for (int t = 1; t <= 2; ++t) c.set(t, kPair * kBlk / 4, 4 * kRows);
  for (int t = 3; t <= 4; ++t) c.set(t, kPair * nt, 4 * kRows);
  return c;
}

// The A operand of nt <= kTok prepared activations (ActQ8, natural order): product p's rows and the tokens' d_a.
struct AOperand {
  AOperand(const void* const* acts, int nt, int K) : nt_(nt) {
    for (int t = 0; t < nt; ++t) {
      const ActQ8 a(acts[t], K);
      q_[t] = a.q, da_[t] = a.da;
    }
    if (kPair == 1 && nt == 1) return;
    const int nb = K / kBlk, np = (nb + kPair - 1) / kPair;
    thread_local std::vector<int8_t> buf;
    buf.assign((size_t)np * kPair * nt * kPair * kBlk, 0);
    for (int b = 0; b < nb; ++b) {
      const int p = b / kPair, j = b % kPair;
      for (int t = 0; t < nt; ++t)
        std::memcpy(&buf[(((size_t)p * kPair + j) * nt + t) * kPair * kBlk + j * kBlk], q_[t] + (size_t)b * kBlk, kBlk);
    }
    buf_ = buf.data();
  }
  const int8_t* product(int p) const {
    return kPair == 1 && nt_ == 1 ? q_[0] + (size_t)p * kBlk : buf_ + (size_t)p * kPair * nt_ * kPair * kBlk;
  }
  int nt_;
  const int8_t* q_[kTok];
  const float* da_[kTok];
  const int8_t* buf_ = nullptr;
};

// One set of m <= 16 rows of a bank starting at row0 (expert e): the gather offsets (row c; rows past m read
// row 0 again, their columns are ignored) and its accumulators acc[t][c].
struct RowSet {
  const uint8_t* base;
  __m512i idx;
  int m;
  alignas(64) float acc[kTok][kRows];
  void init(const cpumoe_bank& bank, int e, int row0, int m_) {
    base = bank_row<uint8_t>(bank, e, row0), m = m_;
    const int32_t stride = (int32_t)bank.row_stride;
    alignas(64) int32_t o[kRows];
    for (int c = 0; c < kRows; ++c) o[c] = c < m ? c * stride : 0;
    idx = _mm512_load_si512(o);
    std::memset(acc, 0, sizeof acc);
  }
  // B of block b into bt (8 rows x 16 dwords); returns the 16 rows' fp32 d.
  CPUMOE_INLINE __m512 decode(int b, int32_t (*bt)[kRows]) const {
    const uint8_t* p = base + (size_t)b * QB;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int r = 0; r < 4; ++r) {  // bytes 2 + 4r .. 5 + 4r of each row's block: inside its 18 bytes
      const __m512i q = _mm512_i32gather_epi32(idx, p + 2 + 4 * r, 1);
      _mm512_store_si512(bt[r], _mm512_sub_epi8(_mm512_and_si512(q, lo4), eight));
      _mm512_store_si512(bt[r + 4], _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi32(q, 4), lo4), eight));
    }
    const __m512i d = _mm512_i32gather_epi32(idx, p, 1);  // fp16 d in the low half of each dword
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
  }
  // acc[t] += float(C[j nt + t]) * (d[j] * d_a[t][b + j]) for the n blocks j of the product at block b
  CPUMOE_INLINE void fold(const int32_t (*c)[kRows], const __m512* d, int n, const AOperand& A, int b) {
    const int nt = A.nt_;
    for (int t = 0; t < nt; ++t) {
      __m512 a = _mm512_load_ps(acc[t]);
      for (int j = 0; j < n; ++j)
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[j * nt + t])),
                            _mm512_mul_ps(d[j], _mm512_set1_ps(A.da_[t][b + j])), a);
      _mm512_store_ps(acc[t], a);
    }
  }
};

// Both sets (ns = 1 or 2) against the nt tokens of A over all nb blocks of K.
CPUMOE_INLINE void run_sets(RowSet* sets, int ns, const AOperand& A, int nb) {
  alignas(64) int32_t bt[2][kPair * kBlk / 4][kRows];
  alignas(64) int32_t c[2][kRows][kRows];
  __m512 d[2][kPair];
  if (kPair > 1 && nb % kPair) std::memset(bt, 0, sizeof bt);  // the missing block's B rows: zero, never read
  for (int b = 0; b < nb; b += kPair) {
    const int n = nb - b < kPair ? nb - b : kPair;
    for (int s = 0; s < ns; ++s)
      for (int j = 0; j < n; ++j) d[s][j] = sets[s].decode(b + j, bt[s] + 8 * j);
    _tile_loadd(0, A.product(b / kPair), kPair * kBlk);
    _tile_loadd(1, bt[0], 4 * kRows);
    _tile_zero(3);
    _tile_dpbssd(3, 0, 1);
    if (ns == 2) {
      _tile_loadd(2, bt[1], 4 * kRows);
      _tile_zero(4);
      _tile_dpbssd(4, 0, 2);
    }
    _tile_stored(3, c[0], 4 * kRows);
    sets[0].fold(c[0], d[0], n, A, b);
    if (ns == 2) {
      _tile_stored(4, c[1], 4 * kRows);
      sets[1].fold(c[1], d[1], n, A, b);
    }
  }
}

void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  const cpumoe_params& p = k->params;
  ActSink sink(p);  // g in SIMD lanes (common.h)
  Tiles tiles;
  RowSet sets[2];
  for (int32_t j0 = 0; j0 < n; j0 += kTok) {  // token groups
    const int nt = n - j0 < kTok ? n - j0 : kTok;
    tiles.load(tile_config(nt));
    const AOperand A(xs + j0, nt, p.hidden);
    for (int32_t i = i0; i < i1; i += kRows) {
      const int m = i1 - i < kRows ? i1 - i : kRows;
      sets[0].init(banks[0], e, i, m);
      sets[1].init(banks[0], e, p.inter + i, m);
      run_sets(sets, 2, A, p.hidden / kBlk);
      for (int t = 0; t < nt; ++t) {
        const float wi = w_in[j0 + t];
        for (int c = 0; c < m; ++c)
          sink.put(&g[j0 + t][i + c], sets[0].acc[t][c] * wi, sets[1].acc[t][c] * wi);
      }
    }
  }
}

// Routes of one expert (adjacent) in groups of kTok share every tile; each route's y * weight is added in route
// order, as the row kernels do.
void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  const int K = k->params.inter;
  Tiles tiles;
  RowSet sets[2];
  const void* acts[kTok];
  for (int32_t a = 0; a < n;) {
    const int32_t b = amx::route_group_end(routes, a, n, kTok);
    const int nt = b - a;
    for (int t = 0; t < nt; ++t) acts[t] = routes[a + t].act;
    tiles.load(tile_config(nt));
    const AOperand A(acts, nt, K);
    for (int32_t h = h0; h < h1; h += 2 * kRows) {
      const int m0 = h1 - h < kRows ? h1 - h : kRows, m1 = h1 - h - kRows < kRows ? h1 - h - kRows : kRows;
      const int ns = m1 > 0 ? 2 : 1;
      sets[0].init(banks[1], routes[a].expert, h, m0);
      if (ns == 2) sets[1].init(banks[1], routes[a].expert, h + kRows, m1);
      run_sets(sets, ns, A, K / kBlk);
      for (int t = 0; t < nt; ++t) {
        const cpumoe_route& rt = routes[a + t];
        float* out = acc + rt.token * acc_stride + (h - h0);
        for (int s = 0; s < ns; ++s)
          for (int c = 0; c < sets[s].m; ++c) out[s * kRows + c] += sets[s].acc[t][c] * rt.weight;
      }
    }
    a = b;
  }
}
}  // namespace amx4
