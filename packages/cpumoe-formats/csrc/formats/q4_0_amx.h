// q4_0 mode w4a8 on AMX int8 tiles (tier amx, opt-in; included by q4_0.cpp at that tier only).
//
// Why: the avx512vnni kernel spends 32 vpdpbusd per 32-K block of 16 rows for every token, so a batch of 8
// tokens sharing an expert costs ~3.6x one token (16-thread executor, H200 host). On tiles one instruction
// takes a block of 16 rows for up to 16 tokens; what stays per token is the fp32 fold.
// One q4_0 block (32 K) is one tile product, because its scale d changes every 32 K:
//   A = 16 weight rows' (nibble - 8) of block b, one 32-byte tile row per weight row in element order (the low
//       nibbles of qs are elements 0..15, the high ones 16..31). Decoded per row in runs of kSpan blocks (the
//       row's 18 * kSpan bytes read once, contiguously): a vpermb places each block's 16 qs bytes twice, a
//       per-dword shift by 0 / 4 and a mask give both halves;
//   B = the tokens' Q8_0 int8 activations of block b in AMX's 4-byte K groups, B[r][t] = q_t[4r .. 4r + 3]: for
//       one token its prepared vector read in place (row stride 4), for several tokens interleaved once per work
//       item;
//   C = int32 [16 rows][nt tokens], exactly sum((nibble - 8) * q) over the block (TDPBSSD).
// The fold: acc[row][t] = fma(float(C), fp32(fp16(d)[row] * d_a[t][b]), acc), block by block in K order: the
// scale s = fp32(d * d_a) of the w4a8 definition (q4_0.cpp). One token folds a vector of 16 rows, several tokens
// a vector of tokens per row: the same products in the same order, so a token's result does not depend on its
// batch or on which tokens share the tile, and a row's does not depend on the work split. Against the other w4a8
// tiers the integer block sums are the same; their fp32 sums are grouped otherwise (avx512vnni: 8-element lanes).
// Two sets of 16 rows run per block step (gate and up; down: rows h and h + 16).
// (The first version, tokens as A and weights as B, gathered each B row from 16 weight rows: 46% of the
// single-thread read ceiling on the H200 host against avx512vnni's 88%.)
#pragma once
// (included inside q4_0.cpp's namespaces: <cstring>, <vector> and amx_common.h come with q4_0.cpp)

#ifndef CPUMOE_Q4_AMX_SPAN
#define CPUMOE_Q4_AMX_SPAN 8
#endif
#ifndef CPUMOE_Q4_AMX_PF
#define CPUMOE_Q4_AMX_PF 512
#endif

namespace amx4 {
constexpr int kRows = 16, kTok = 16, kBlk = QK, kSpan = CPUMOE_Q4_AMX_SPAN;
static_assert(kSpan % 2 == 0, "blocks are decoded in pairs");

// vpermb index of a pair of blocks (36 bytes): bytes 0..15 and 16..31 <- the first block's qs (bytes 2..17),
// 32..47 and 48..63 <- the second's (20..35); a shift of dwords 4..7 and 12..15 by 4 then brings the high nibbles.
struct PermTable {
  alignas(64) uint8_t p[64];
  constexpr PermTable() : p() {
    for (int i = 0; i < 64; ++i) p[i] = (uint8_t)((i < 32 ? 2 : 2 + QB) + (i & 15));
  }
};
constexpr PermTable kPerm{};

// palette 1: tiles 0 / 1 = A of sets 0 / 1 (m rows x 32 B), 2 = B (8 rows x 4 nt B), 3 / 4 = C of sets 0 / 1
// (m rows x 4 nt B); tiles 1 and 4 unused (0) with one set.
using amx::TileConfig;
using amx::Tiles;
inline TileConfig tile_config(int nt, int m0, int m1) {
  TileConfig c;
  c.set(0, m0, kBlk), c.set(2, kBlk / 4, 4 * nt), c.set(3, m0, 4 * nt);
  if (m1 > 0) c.set(1, m1, kBlk), c.set(4, m1, 4 * nt);
  return c;
}

// The B operand of nt <= 16 prepared activations (ActQ8, natural order) and their d_a per block.
struct BOperand {
  BOperand(const void* const* acts, int nt, int K) : nt_(nt) {
    const int nb = K / kBlk;
    for (int t = 0; t < nt; ++t) {
      const ActQ8 a(acts[t], K);
      q_[t] = a.q, da_[t] = a.da;
    }
    if (nt == 1) return;
    thread_local std::vector<int32_t> bt;
    thread_local std::vector<float> da;
    bt.resize((size_t)K / 4 * nt);
    da.assign((size_t)nb * kTok, 0.0f);
    for (int t = 0; t < nt; ++t) {
      for (int i = 0; i < K / 4; ++i) std::memcpy(&bt[(size_t)i * nt + t], q_[t] + 4 * i, 4);
      for (int b = 0; b < nb; ++b) da[(size_t)b * kTok + t] = da_[t][b];
    }
    bt_ = bt.data(), dav_ = da.data();
  }
  const void* block(int b, int* stride) const {
    *stride = 4 * nt_;
    return nt_ == 1 ? (const void*)(q_[0] + (size_t)b * kBlk) : (const void*)(bt_ + (size_t)b * (kBlk / 4) * nt_);
  }
  int nt_;
  const int8_t* q_[kTok];
  const float* da_[kTok];
  const int32_t* bt_ = nullptr;
  const float* dav_ = nullptr;  // [nb][16]: d_a of block b for tokens 0..nt-1, 0 past nt
};

// One set of m <= 16 rows of a bank from row0 (expert e): per span its decoded A rows a[row][block][32] and the
// rows' fp32 d; the accumulators acc[row][t] (one token: acc1[row]).
struct RowSet {
  const uint8_t* row[kRows];
  int m;
  alignas(64) int8_t a[kRows][kSpan][kBlk];
  alignas(64) float d[kSpan][kRows];
  alignas(64) float acc[kRows][kTok];
  alignas(64) float acc1[kRows];
  void init(const cpumoe_bank& bank, int e, int row0, int m_) {
    m = m_;
    for (int c = 0; c < kRows; ++c) row[c] = bank_row<uint8_t>(bank, e, row0 + (c < m ? c : 0));
    std::memset(acc, 0, sizeof acc);
    std::memset(acc1, 0, sizeof acc1);
    std::memset(d, 0, sizeof d);  // rows past m stay 0
  }
  // blocks [b0, b0 + n) of every row, n <= kSpan
  CPUMOE_INLINE void decode(int b0, int n, int nb) {
    const __m512i perm = _mm512_load_si512(kPerm.p);
    const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i lo4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int c = 0; c < m; ++c) {
      const uint8_t* p = row[c] + (size_t)b0 * QB;
#if CPUMOE_Q4_AMX_PF
      if (b0 + kSpan < nb)
        for (int l = 0; l < (kSpan * QB + 63) / 64; ++l) __builtin_prefetch(p + CPUMOE_Q4_AMX_PF + 64 * l, 0, 3);
#endif
      for (int j = 0; j < n; j += 2) {  // a pair of blocks (the second absent when n is odd: masked, unused)
        const int bytes = n - j >= 2 ? 2 * QB : QB;
        const __m512i raw = _mm512_maskz_loadu_epi8((__mmask64)((1ull << bytes) - 1), p + (size_t)j * QB);
        const __m512i q = _mm512_srlv_epi32(_mm512_permutexvar_epi8(perm, raw), shift);
        const __m512i v = _mm512_sub_epi8(_mm512_and_si512(q, lo4), eight);
        _mm512_storeu_si512(a[c][j], v);  // a[c][j] and a[c][j + 1]: 64 contiguous bytes
        d[j][c] = _cvtsh_ss(ld16(p + (size_t)j * QB));
        if (bytes > QB) d[j + 1][c] = _cvtsh_ss(ld16(p + (size_t)(j + 1) * QB));
      }
    }
  }
  // acc += float(C) * (d * d_a) for block j of the span (C stored at c: m rows x nt int32, row stride 64 B)
  CPUMOE_INLINE void fold(const int32_t (*c)[kTok], int j, const BOperand& B, int b) {
    if (B.nt_ == 1) {  // C is one int32 per row, contiguous
      const __m512 s = _mm512_mul_ps(_mm512_load_ps(d[j]), _mm512_set1_ps(B.da_[0][b]));
      _mm512_store_ps(acc1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c)), s, _mm512_load_ps(acc1)));
      return;
    }
    // lanes past nt: whatever C held there (finite) times d_a = 0, in accumulators nobody reads
    const __m512 dav = _mm512_loadu_ps(B.dav_ + (size_t)b * kTok);  // (a std::vector: not 64-aligned)
    for (int r = 0; r < m; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(d[j][r]), dav);
      _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[r])), s,
                                              _mm512_load_ps(acc[r])));
    }
  }
  float get(int r, int t, int nt) const { return nt == 1 ? acc1[r] : acc[r][t]; }
};

// Sets [0, ns) against the tokens of B over all nb blocks of K.
CPUMOE_INLINE void run_sets(Tiles& tiles, RowSet* sets, int ns, const BOperand& B, int nb) {
  alignas(64) int32_t c[2][kRows][kTok];
  std::memset(c, 0, sizeof c);
  const int nt = B.nt_;
  tiles.load(tile_config(nt, sets[0].m, ns == 2 ? sets[1].m : 0));
  // one token: C rows are single int32s, stored with a 4-byte stride (16 contiguous int32s)
  const int cstride = nt == 1 ? 4 : 4 * kTok;
  for (int b0 = 0; b0 < nb; b0 += kSpan) {
    const int n = nb - b0 < kSpan ? nb - b0 : kSpan;
    for (int s = 0; s < ns; ++s) sets[s].decode(b0, n, nb);
    for (int j = 0; j < n; ++j) {
      int bs;
      const void* bp = B.block(b0 + j, &bs);
      _tile_loadd(2, bp, bs);
      _tile_loadd(0, sets[0].a[0][j], kSpan * kBlk);
      _tile_zero(3);
      _tile_dpbssd(3, 0, 2);
      if (ns == 2) {
        _tile_loadd(1, sets[1].a[0][j], kSpan * kBlk);
        _tile_zero(4);
        _tile_dpbssd(4, 1, 2);
      }
      _tile_stored(3, c[0], cstride);
      sets[0].fold(c[0], j, B, b0 + j);
      if (ns == 2) {
        _tile_stored(4, c[1], cstride);
        sets[1].fold(c[1], j, B, b0 + j);
      }
    }
  }
}

void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  const cpumoe_params& p = k->params;
  Tiles tiles;
  RowSet sets[2];
  for (int32_t j0 = 0; j0 < n; j0 += kTok) {  // token groups of 16
    const int nt = n - j0 < kTok ? n - j0 : kTok;
    const BOperand B(xs + j0, nt, p.hidden);
    for (int32_t i = i0; i < i1; i += kRows) {
      const int m = i1 - i < kRows ? i1 - i : kRows;
      sets[0].init(banks[0], e, i, m);
      sets[1].init(banks[0], e, p.inter + i, m);
      run_sets(tiles, sets, 2, B, p.hidden / kBlk);
      for (int t = 0; t < nt; ++t) {
        const float wi = w_in[j0 + t];
        for (int r = 0; r < m; ++r)
          g[j0 + t][i + r] = f32_to_bf16(activate(p, sets[0].get(r, t, nt) * wi, sets[1].get(r, t, nt) * wi));
      }
    }
  }
}

// Routes of one expert (adjacent) in groups of 16 share every tile; each route's y * weight is added in route
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
    const BOperand B(acts, nt, K);
    for (int32_t h = h0; h < h1; h += 2 * kRows) {
      const int m0 = h1 - h < kRows ? h1 - h : kRows, m1 = h1 - h - kRows < kRows ? h1 - h - kRows : kRows;
      const int ns = m1 > 0 ? 2 : 1;
      sets[0].init(banks[1], routes[a].expert, h, m0);
      if (ns == 2) sets[1].init(banks[1], routes[a].expert, h + kRows, m1);
      run_sets(tiles, sets, ns, B, K / kBlk);
      for (int t = 0; t < nt; ++t) {
        const cpumoe_route& rt = routes[a + t];
        float* out = acc + rt.token * acc_stride + (h - h0);
        for (int s = 0; s < ns; ++s)
          for (int r = 0; r < sets[s].m; ++r) out[s * kRows + r] += sets[s].get(r, t, nt) * rt.weight;
      }
    }
    a = b;
  }
}
}  // namespace amx4
