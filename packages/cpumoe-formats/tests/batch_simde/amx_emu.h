// AMX-TILE / AMX-BF16 / AMX-INT8 (tdpbssd) emulation for the amx tiers of bf16, fp8_block and q4_0 (run.sh compiles them at tier 6 with it, after
// simde_extra.h): a thread-local register file of 8 tiles x 16 rows x 64 bytes and the palette-1 config. The
// shape rules of the instructions are checked (a mismatch aborts: it would #UD or compute garbage on the real
// thing); tdpbf16ps reads bf16 subnormals as zero and sums each pair's products in fp32, like the hardware up to
// the order of its internal additions.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct bk_tilecfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
// One tile state per thread shared by every object that includes this (inline variables, not per-TU statics), as
// on the hardware: amx_common.h's inline Tiles::load may come from another format's object file than the kernel
// that uses the tiles it configured.
inline thread_local bk_tilecfg bk_cfg;
inline thread_local uint8_t bk_tmm[8][16][64];
inline thread_local bool bk_configured;

static inline void bk_tile_loadconfig(const void* p) {
  memcpy(&bk_cfg, p, sizeof bk_cfg);
  if (bk_cfg.palette != 1) abort();
  for (int t = 0; t < 8; ++t)
    if (bk_cfg.rows[t] > 16 || bk_cfg.colsb[t] > 64) abort();
  memset(bk_tmm, 0, sizeof bk_tmm);
  bk_configured = true;
}
static inline void bk_tile_release() {
  memset(&bk_cfg, 0, sizeof bk_cfg);
  bk_configured = false;
}
static inline void bk_tile_check(int t) {
  if (!bk_configured || t < 0 || t > 7 || !bk_cfg.rows[t] || !bk_cfg.colsb[t]) abort();
}
static inline void bk_tile_zero(int t) {
  bk_tile_check(t);
  memset(bk_tmm[t], 0, sizeof bk_tmm[t]);
}
static inline void bk_tile_loadd(int t, const void* base, long stride) {
  bk_tile_check(t);
  memset(bk_tmm[t], 0, sizeof bk_tmm[t]);
  for (int r = 0; r < bk_cfg.rows[t]; ++r) memcpy(bk_tmm[t][r], (const char*)base + r * stride, bk_cfg.colsb[t]);
}
static inline void bk_tile_stored(int t, void* base, long stride) {
  bk_tile_check(t);
  for (int r = 0; r < bk_cfg.rows[t]; ++r) memcpy((char*)base + r * stride, bk_tmm[t][r], bk_cfg.colsb[t]);
}
static inline float bk_bf16(const uint8_t* p) {
  uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
  if ((u & 0x7F800000u) == 0) u &= 0x80000000u;  // subnormal -> zero
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// C (M x N dwords) += A (M x K dwords) . B (K x N dwords), the shapes the instructions require (else abort): each
// C element, as T, goes through dot(acc, a_row, b_col_k) with a_row = A's row m and b(k) = B's dword (k, n).
template <class T, class Dot>
static inline void bk_tile_dp(int c, int a, int b, Dot dot) {
  bk_tile_check(c), bk_tile_check(a), bk_tile_check(b);
  const int M = bk_cfg.rows[c], N = bk_cfg.colsb[c] / 4, K = bk_cfg.colsb[a] / 4;
  if (bk_cfg.rows[a] != M || bk_cfg.rows[b] != K || bk_cfg.colsb[b] != bk_cfg.colsb[c]) abort();
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      T acc;
      memcpy(&acc, &bk_tmm[c][m][4 * n], 4);
      for (int k = 0; k < K; ++k) dot(acc, &bk_tmm[a][m][4 * k], &bk_tmm[b][k][4 * n]);
      memcpy(&bk_tmm[c][m][4 * n], &acc, 4);
    }
}
static inline void bk_tile_dpbf16ps(int c, int a, int b) {  // bf16 pairs, each pair's sum added in fp32
  bk_tile_dp<float>(c, a, b, [](float& acc, const uint8_t* x, const uint8_t* y) {
    acc += bk_bf16(x) * bk_bf16(y) + bk_bf16(x + 2) * bk_bf16(y + 2);
  });
}
static inline void bk_tile_dpbssd(int c, int a, int b) {  // int8 x int8 products summed exactly in int32
  bk_tile_dp<int32_t>(c, a, b, [](int32_t& acc, const uint8_t* x, const uint8_t* y) {
    for (int i = 0; i < 4; ++i) acc += (int8_t)x[i] * (int8_t)y[i];
  });
}
#define _tile_loadconfig(p) bk_tile_loadconfig(p)
#define _tile_release() bk_tile_release()
#define _tile_zero(t) bk_tile_zero(t)
#define _tile_loadd(t, base, stride) bk_tile_loadd((t), (base), (long)(stride))
#define _tile_stored(t, base, stride) bk_tile_stored((t), (base), (long)(stride))
#define _tile_dpbf16ps(c, a, b) bk_tile_dpbf16ps((c), (a), (b))
#define _tile_dpbssd(c, a, b) bk_tile_dpbssd((c), (a), (b))
