// fp8_block experts on AMX tiles (tier amx; included by fp8_block.cpp at that tier only).
//
// Why: the avx512f kernel decodes a 64-code chunk once and spends 4 fp32 FMAs per token on it, so a batch of
// 8 tokens sharing an expert costs ~4x one token (16-thread executor, H200 host). On tiles the decode is done
// once per weight and every token column comes almost free: C[16 rows][16 tokens] += A . B per 32-wide K chunk.
//   A = 16 weight rows x 32 codes decoded to bf16 (1 KB per chunk), exactly, by byte tables (Decoder);
//   B = the tokens' bf16 activations in AMX's pair layout (amx_common.h BOperand), as in bf16_amx.h;
//   C = fp32 products of exact bf16 values, summed by the tile unit over one 128-K block (4 chunks), then
//       stored and folded into an fp32 accumulator per (row, token): acc = fma(C, scale[row / 128][kb], acc),
//       each row with its own scale (so a 16-row tile may straddle a 128-row block: ragged I).
// Every (row, token) element depends only on its row, its token and the K order, so a token's result does not
// depend on its batch or on which tokens share the tile, and a row's does not depend on the work split. Mode
// stays W8A16 (x consumed as bf16); what differs from avx512f is the summation order and that a bf16-subnormal
// activation (|x| < 2^-126) reads as zero, as on the bf16 amx tier.
// Reads: per 16-row block, each row's next kSpan x 128 codes in one run (16 rows, gate_up 32), then the tiles
// and folds of those kSpan blocks; software prefetch CPUMOE_FP8_AMX_PF bytes ahead in each row (0 = off; 1 KB
// was slower than 512 B with span 4 on the H200 host).
// Cost: the byte-table decode (~7 vector ops and two 64-byte stores per 64 codes, then tile loads) plus the
// per-block fold; H200 host, 16 threads: one token reads at ~60% of the ceiling where avx512f reads
// ~85%, shared batch 8 / batch 1 is ~1.5x (avx512f ~4.5x). Hence an opt-in tier (registry.cpp): auto keeps
// avx512f; isa="amx" / CPUMOE_ISA=amx picks this kernel for batches that share experts.
#pragma once
#include "amx_common.h"
#include "fp8_block_decode.h"

#ifndef CPUMOE_FP8_AMX_PF
#define CPUMOE_FP8_AMX_PF 512
#endif
#ifndef CPUMOE_FP8_AMX_SPAN
#define CPUMOE_FP8_AMX_SPAN 4
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
namespace amx8 {
using amx::BOperand;
using amx::kChunk;
using amx::kCols;
using amx::kRows;
using amx::Tiles;
constexpr int kKB = 128, kChunksPerKB = kKB / kChunk;
// 128-K blocks of a row decoded in one contiguous run before the next row (CPUMOE_FP8_AMX_SPAN; the A buffer
// holds kSpan x 8 KB): longer runs per row, fewer row switches for the DRAM pages and the prefetchers.
constexpr int kSpan = CPUMOE_FP8_AMX_SPAN;

// The byte-table e4m3 -> bf16 decode (fp8_block_decode.h), stored as two 32-code A-tile chunks.
struct Decoder : fp8dec::Decoder {
  CPUMOE_INLINE void decode64(const uint8_t* src, int n, uint16_t* dst0, uint16_t* dst1) const {
    __m512i w0, w1;
    decode(src, n, w0, w1);
    _mm512_store_si512(dst0, w0);
    _mm512_store_si512(dst1, w1);
  }
};

// acc[s][i][t] = sum over K of row (row0_s + r + i) of the fp8 bank `wb` (scales `sb`) times token t, for the
// rows [row0_s, row0_s + nr) of up to two sets s (row0b < 0: one set), in 16-row blocks; emit(r, m, acc0, acc1)
// receives each finished block of m <= 16 rows. Per kSpan 128-K blocks: every row's codes decoded, then per
// 128-K block the tiles and the fold. (A software-pipelined order with the earlier word-wise decode, decoding
// block kb + 1 before the tiles of kb and folding kb - 1 after, with double A / C buffers, measured no faster on
// the H200 host: 32% vs 33% of the single-thread ceiling.)
template <class Emit>
void rows_x_tokens(Tiles& tiles, const cpumoe_bank& wb, const cpumoe_bank& sb, int e, int row0, int nr, int row0b,
                   int K, const BOperand& B, Emit emit) {
  const int nsets = row0b >= 0 ? 2 : 1, nt = B.n_;
  const __mmask16 tmask = (__mmask16)((1u << nt) - 1u);
  // [set][chunk]: decoded A tiles of kSpan 128-K blocks
  alignas(64) uint16_t a[2][kSpan * kChunksPerKB][kRows][kChunk];
  alignas(64) float c[kRows][kCols];  // C of one 128-K block
  alignas(64) float acc[2][kRows][kCols];
  const Decoder dec;
  for (int r = 0; r < nr; r += kRows) {
    const int m = nr - r < kRows ? nr - r : kRows;
    tiles.configure(nt, m);
    const uint8_t* w[2][kRows];
    const uint16_t* srow[2][kRows];
    for (int s = 0; s < nsets; ++s)
      for (int i = 0; i < m; ++i) {
        const int row = (s ? row0b : row0) + r + i;
        w[s][i] = bank_row<uint8_t>(wb, e, row);
        srow[s][i] = bank_row<uint16_t>(sb, e, row / kKB);  // stride from the view: padded columns skipped
      }
    std::memset(acc, 0, sizeof acc);
    for (int k0 = 0, kb0 = 0; k0 < K; k0 += kSpan * kKB, kb0 += kSpan) {
      const int span = K - k0 < kSpan * kKB ? K - k0 : kSpan * kKB;  // codes of each row decoded in one run
      for (int s = 0; s < nsets; ++s)
        for (int i = 0; i < m; ++i) {
#if CPUMOE_FP8_AMX_PF
          if (k0 + CPUMOE_FP8_AMX_PF < K)
            for (int l = 0; l < 2 * kSpan; ++l) __builtin_prefetch(w[s][i] + k0 + CPUMOE_FP8_AMX_PF + 64 * l, 0, 3);
#endif
          // 64 codes at a time; an odd tail chunk's partner is written (zeros) and never loaded
          for (int cc = 0; cc * kChunk < span; cc += 2)
            dec.decode64(w[s][i] + k0 + cc * kChunk, span - cc * kChunk, a[s][cc][i], a[s][cc + 1][i]);
        }
      for (int kb = kb0, c0 = 0; c0 * kChunk < span; ++kb, c0 += kChunksPerKB) {
        const int kn = span - c0 * kChunk < kKB ? span - c0 * kChunk : kKB, nc = (kn + kChunk - 1) / kChunk;
        _tile_zero(2);
        _tile_zero(3);
        for (int cc = 0; cc < nc; ++cc) {
          int bs;
          const void* b = B.chunk(kb * kChunksPerKB + cc, &bs);
          _tile_loadd(4, b, bs);
          _tile_loadd(0, a[0][c0 + cc], 64);
          _tile_dpbf16ps(2, 0, 4);
          if (nsets == 2) {
            _tile_loadd(1, a[1][c0 + cc], 64);
            _tile_dpbf16ps(3, 1, 4);
          }
        }
        for (int s = 0; s < nsets; ++s) {  // acc += C * this row's block scale
          if (s == 0) _tile_stored(2, c, 64);
          else _tile_stored(3, c, 64);
          for (int i = 0; i < m; ++i)
            _mm512_store_ps(acc[s][i], _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tmask, c[i]),
                                                       _mm512_set1_ps(bf16_to_f32(srow[s][i][kb])),
                                                       _mm512_load_ps(acc[s][i])));
        }
      }
    }
    emit(r, m, acc[0], acc[1]);
  }
}

void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  amx::tile_gate_up(k, e, i0, i1, n, xs, w_in, g, [&](Tiles& t, int ex, int row0, int nr, int row0b, int K,
                                                      const BOperand& B, auto emit) {
    rows_x_tokens(t, banks[0], banks[1], ex, row0, nr, row0b, K, B, emit);
  });
}

void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  amx::tile_down(k, h0, h1, routes, n, acc, acc_stride, [&](Tiles& t, int ex, int row0, int nr, int row0b, int K,
                                                            const BOperand& B, auto emit) {
    rows_x_tokens(t, banks[2], banks[3], ex, row0, nr, row0b, K, B, emit);
  });
}

}  // namespace amx8
}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
