// bf16 experts on AMX tiles (tier amx; included by bf16.cpp at that tier only).
//
// One tile dot product C[16 rows][16 tokens] += A[16 rows][32 k] . B[32 k][16 tokens] per 32-wide K chunk:
//   A = 16 consecutive weight rows, 64 bytes each, loaded straight from the bank (tileloadd takes the row stride);
//   B = the tokens' activations for that chunk in AMX's pair layout, B[r][t] = (x_t[32c + 2r], x_t[32c + 2r + 1]),
//       built once per work item for all chunks (a few KB per token) and reused by every row block;
//   C = fp32, one element per (row, token), accumulated over the chunks in order.
// Each C element depends only on its row and its token's column, so a token's result does not depend on which
// tokens share the tile (batch identity) and a row's does not depend on where its block starts (work splits).
// A work item's last block of m < 16 rows runs on tiles configured for m rows (nothing past the range is
// read); a K tail (K % 32) is zero-padded in A and B (a bf16 NaN in the next row's bytes times a zero
// activation would still be NaN). Precision: as vdpbf16ps (bf16
// products in fp32, bf16 subnormal inputs read as zero), the same W16A16 mode as the avx512bf16 tier.
//
// Tiles, their configuration and the B operand: amx_common.h.
#pragma once
#include <vector>

#include "amx_common.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace amx {

// C[r][t] = sum over k of row (row0 + r)[k] * act_t[k] for rows [row0, row0 + nr) of `bank` (expert e), in
// 16-row tiles, with the rows [row0b, row0b + nr) as a second set sharing every B load when row0b >= 0 (gate
// and up). emit(r, m, c0, c1) receives each finished block of m <= 16 rows: c0[i][t] (c1: the second set).
template <class Emit>
void rows_x_tokens(Tiles& tiles, const cpumoe_bank& bank, int e, int row0, int nr, int row0b, int K, const BOperand& B,
                   Emit emit) {
  const int nfull = K / kChunk, nchunks = (K + kChunk - 1) / kChunk;
  const int64_t rs = bank.row_stride;
  const char* base = (const char*)bank.ptr + (int64_t)e * bank.expert_stride;
  alignas(64) uint16_t pad[2][kRows][kChunk];  // zero-padded A for the K tail
  alignas(64) float c0[kRows][kCols], c1[kRows][kCols];
  for (int r = 0; r < nr; r += kRows) {
    const int m = nr - r < kRows ? nr - r : kRows;
    tiles.configure(B.n_, m);
    const char* a[2] = {base + (int64_t)(row0 + r) * rs, row0b >= 0 ? base + (int64_t)(row0b + r) * rs : nullptr};
    auto load_a = [&](int which, int c) CPUMOE_LAMBDA_INLINE {  // tile `which` <- chunk c of the block's rows
      const int kn = c < nfull ? kChunk : K % kChunk;
      if (kn == kChunk) {
        if (which == 0) _tile_loadd(0, a[0] + 2 * c * kChunk, rs);
        else _tile_loadd(1, a[1] + 2 * c * kChunk, rs);
        return;
      }
      std::memset(pad[which], 0, sizeof pad[which]);
      for (int i = 0; i < m; ++i) std::memcpy(pad[which][i], a[which] + i * rs + 2 * c * kChunk, (size_t)kn * 2);
      if (which == 0) _tile_loadd(0, pad[0], 64);
      else _tile_loadd(1, pad[1], 64);
    };
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < nchunks; ++c) {
      int bs;
      const void* b = B.chunk(c, &bs);
      _tile_loadd(4, b, bs);
      load_a(0, c);
      _tile_dpbf16ps(2, 0, 4);
      if (a[1]) {
        load_a(1, c);
        _tile_dpbf16ps(3, 1, 4);
      }
    }
    _tile_stored(2, c0, 64);
    if (a[1]) _tile_stored(3, c1, 64);
    emit(r, m, c0, c1);
  }
}

void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  tile_gate_up(k, e, i0, i1, n, xs, w_in, g, [&](Tiles& t, int ex, int row0, int nr, int row0b, int K, const BOperand& B,
                                                 auto emit) { rows_x_tokens(t, banks[0], ex, row0, nr, row0b, K, B, emit); });
}

void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  if (k->params.inter <= Dot::kSmallK) {  // tiny I (a layer property): vdpbf16ps row blocks, as the avx512bf16 tier
    for (int32_t j = 0; j < n; ++j)
      Dot::rows_acc(k, banks, routes[j].expert, h0, h1, routes[j].act, routes[j].weight,
                    acc + routes[j].token * acc_stride);
    return;
  }
  tile_down(k, h0, h1, routes, n, acc, acc_stride, [&](Tiles& t, int ex, int row0, int nr, int row0b, int K,
                                                       const BOperand& B, auto emit) {
    rows_x_tokens(t, banks[1], ex, row0, nr, row0b, K, B, emit);
  });
}

}  // namespace amx
}  // namespace CPUMOE_NS
}  // namespace cpumoe
