// AMX tile plumbing shared by the tile kernels (bf16_amx.h, fp8_block_amx.h): the tile configuration, its
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

// Tiles 0, 1: A (m rows x 64 bytes); 4: B (16 rows x 4 nt bytes); 2, 3 and 5, 6: C (m rows x 4 nt bytes; 5, 6 for
// fp8_block's pipelining), for nt tokens
// and a block of m <= 16 rows (fewer only in a work item's last block: the tiles then read only m rows).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig(int nt, int m) {
    for (int t = 0; t < 7; ++t) rows[t] = t == 4 ? kRows : (uint8_t)m, colsb[t] = t < 2 ? 64 : (uint16_t)(4 * nt);
  }
};

struct Tiles {  // released when the work item returns
  ~Tiles() { _tile_release(); }
  void configure(int nt, int m) {  // LDTILECFG (which also zeroes the tiles) only when the shape changes
    if (nt == nt_ && m == m_) return;
    const TileConfig cfg(nt, m);
    _tile_loadconfig(&cfg);
    nt_ = nt, m_ = m;
  }
  int nt_ = 0, m_ = 0;
};

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

}  // namespace amx
}  // namespace CPUMOE_NS
}  // namespace cpumoe
