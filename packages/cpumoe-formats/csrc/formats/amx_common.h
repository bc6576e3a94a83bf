// AMX tile plumbing shared by the tile kernels (bf16_amx.h, fp8_block_amx.h, q4_0_amx.h): the tile configuration, its
// per-work-item lifetime and the B operand (the tokens' bf16 activations in AMX's pair layout).
//
// Tile configuration: palette 1, every tile 16 rows x 64 bytes. The tile state is per thread and another
// library on the same thread (oneDNN under torch) may configure it differently, so every work item loads ours
// and releases the tiles when it returns.
#pragma once
#include <cstring>
#include <vector>

namespace cpumoe {
namespace CPUMOE_NS {
namespace amx {

constexpr int kRows = 16, kCols = 16, kChunk = 32;  // rows per A tile, tokens per B/C tile, k per chunk

// A palette-1 tile configuration: set(t, rows, bytes per row) for the tiles a kernel uses, 0 elsewhere.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int t, int r, int cb) { rows[t] = (uint8_t)r, colsb[t] = (uint16_t)cb; }
};

struct Tiles {  // released when the work item returns
  ~Tiles() { _tile_release(); }
  // LDTILECFG (which also zeroes the tiles) only when the configuration changes
  void load(const TileConfig& c) {
    if (loaded_ && std::memcmp(&c, &cur_, sizeof c) == 0) return;
    _tile_loadconfig(&c);
    cur_ = c, loaded_ = true;
  }
  // bf16 / fp8_block layout: tiles 0, 1: A (m rows x 64 bytes); 4: B (16 rows x 4 nt bytes); 2, 3: C (m rows x
  // 4 nt bytes), for nt tokens and a block of m <= 16 rows (fewer only in a work item's last block: the tiles
  // then read only m rows).
  void configure(int nt, int m) {
    TileConfig c;
    for (int t = 0; t < 5; ++t) c.set(t, t == 4 ? kRows : m, t < 2 ? 64 : 4 * nt);
    load(c);
  }
  TileConfig cur_;
  bool loaded_ = false;
};

// The end of the group of routes starting at a: the following routes of the same expert, at most `most`.
inline int32_t route_group_end(const cpumoe_route* routes, int32_t a, int32_t n, int most) {
  int32_t b = a + 1;
  while (b < n && b - a < most && routes[b].expert == routes[a].expert) ++b;
  return b;
}

// B operands of n <= 16 prepared activations (bf16, length K), chunk by chunk: B[r][t] = pair r of chunk c of
// token t. One token's full chunks are its own activation read with a 4-byte row stride; otherwise (several
// tokens, or the K tail) the pairs are interleaved into `buf`, zero past K.
struct BOperand {
  BOperand(const void* const* acts, int n, int K, std::vector<uint32_t>& buf) : acts_(acts), n_(n) {
    const int nchunks = (K + kChunk - 1) / kChunk, npairs = K / 2;
    const bool direct = n == 1;
    const int built = direct ? (K % kChunk ? 1 : 0) : nchunks;  // chunks that live in buf
    first_built_ = nchunks - built;
    buf.assign((size_t)built * kRows * n, 0u);
    for (int t = 0; t < n; ++t) {
      const uint16_t* x = (const uint16_t*)acts[t];
      for (int q = first_built_ * kRows; q < npairs; ++q) {  // whole pairs
        uint32_t v;
        std::memcpy(&v, x + 2 * q, 4);
        buf[(size_t)(q - first_built_ * kRows) * n + t] = v;
      }
      if (K & 1) {  // a half pair: the odd element alone
        const int q = npairs;
        buf[(size_t)(q - first_built_ * kRows) * n + t] = x[K - 1];
      }
    }
    buf_ = buf.data();
  }
  // (pointer, row stride in bytes) of chunk c
  const void* chunk(int c, int* stride) const {
    if (c < first_built_) {
      *stride = 4;
      return (const uint16_t*)acts_[0] + (size_t)c * kChunk;
    }
    *stride = 4 * n_;
    return buf_ + (size_t)(c - first_built_) * kRows * n_;
  }
  const void* const* acts_;
  int n_, first_built_ = 0;
  const uint32_t* buf_ = nullptr;
};

inline std::vector<uint32_t>& scratch() {
  thread_local std::vector<uint32_t> b;
  return b;
}

// The work-item entry points over a format's tile routine rows(tiles, expert, row0, nr, row0b, K, B, emit), which
// computes C[r][t] for rows [row0, row0 + nr) of the expert (and the second set [row0b, ...) when row0b >= 0)
// against B's tokens and hands each finished block of m <= 16 rows to emit(r, m, c0, c1).
// gate_up: gate rows i and up rows I + i together, token groups of 16; g = bf16(activate(gate * w, up * w)).
template <class Rows>
void tile_gate_up(const cpumoe_kernel* k, int32_t e, int32_t i0, int32_t i1, int32_t n, const void* const* xs,
                  const float* w_in, uint16_t* const* g, Rows rows) {
  const cpumoe_params& p = k->params;
  ActSink sink(p);  // g in SIMD lanes (common.h)
  Tiles tiles;
  for (int32_t j0 = 0; j0 < n; j0 += kCols) {  // token groups of 16
    const int nt = n - j0 < kCols ? n - j0 : kCols;
    const BOperand B(xs + j0, nt, p.hidden, scratch());
    rows(tiles, e, i0, i1 - i0, p.inter + i0, p.hidden, B, [&](int r, int m, float (*gate)[kCols], float (*up)[kCols]) {
      for (int i = 0; i < m; ++i)
        for (int t = 0; t < nt; ++t) {
          const float wi = w_in[j0 + t];
          sink.put(&g[j0 + t][i0 + r + i], gate[i][t] * wi, up[i][t] * wi);
        }
    });
  }
}

// down: output rows [h0, h1) for every route, routes of one expert (adjacent) in groups of 16 sharing each A tile;
// each route's y * weight is added in route order, as the row path does.
template <class Rows>
void tile_down(const cpumoe_kernel* k, int32_t h0, int32_t h1, const cpumoe_route* routes, int32_t n, float* acc,
               int64_t acc_stride, Rows rows) {
  const cpumoe_params& p = k->params;
  Tiles tiles;
  const void* acts[kCols];
  for (int32_t a = 0; a < n;) {
    const int32_t b = route_group_end(routes, a, n, kCols);
    const int nt = b - a;
    for (int t = 0; t < nt; ++t) acts[t] = routes[a + t].act;
    const BOperand B(acts, nt, p.inter, scratch());
    rows(tiles, routes[a].expert, h0, h1 - h0, -1, p.inter, B, [&](int r, int m, float (*y)[kCols], float (*)[kCols]) {
      for (int t = 0; t < nt; ++t) {
        const cpumoe_route& rt = routes[a + t];
        float* out = acc + rt.token * acc_stride + r;
        for (int i = 0; i < m; ++i) out[i] += y[i][t] * rt.weight;
      }
    });
    a = b;
  }
}

}  // namespace amx
}  // namespace CPUMOE_NS
}  // namespace cpumoe
