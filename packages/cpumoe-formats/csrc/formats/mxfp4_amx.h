// mxfp4 w4a8 on AMX-INT8 tiles (tier amx; included by mxfp4_w8.h at that tier only): the integer dots of a
// work item's tokens when two or more share it.
//
// Why: on avx512vnni every token costs one vpdpbusd per 16 columns x 4 K of a decoded group, so 8 tokens routed
// to one expert cost ~2x one token (16-thread executor, H200 host), where the weight bytes are the same. The
// transposed layout is already AMX's B operand: tile_simd decodes each group (16 K-pair rows = 32 K, one scale
// row) into buf[4 rp + q], whose dword lane l holds (u[4 rp .. 4 rp + 3]) of column w8_col(q, l), i.e. B rows
// (K / 4) x 16 columns x 4 bytes with a 256-byte row stride. The tokens' int8 q of the group are A (nt rows x
// 32 bytes), and one tdpbsud (A signed x B unsigned) per column vector q gives C[t][l] = sum(u * q), the very
// integer dot_tokens accumulates with vpdpbusd (|S| <= 32 * 24 * 127, exact). The fp32 epilogue is
// dot_tokens' (S - c12, convert, times scale * s_b, add, in that order), so the results are bit-identical to
// avx512vnni whatever the batch: one token keeps tile_one, two or more come here.
// Tiles: 0 = A (nt x 32 B), 1 = B (8 x 64 B), 2-5 = C of the four column vectors (nt x 64 B). The tile state is
// per thread and another library on it (oneDNN under torch) may configure it differently, so each tile_simd
// call loads this configuration and releases the tiles when it returns.
#pragma once

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
namespace w8 {

struct AmxTokens {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  AmxTokens(int nt, int nkp) : nt_(nt), nkp_(nkp) {
    Config cfg;
    cfg.rows[0] = (uint8_t)nt, cfg.colsb[0] = 32;
    cfg.rows[1] = 8, cfg.colsb[1] = 64;
    for (int t = 2; t < 6; ++t) cfg.rows[t] = (uint8_t)nt, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
  }
  ~AmxTokens() { _tile_release(); }
  AmxTokens(const AmxTokens&) = delete;
  AmxTokens& operator=(const AmxTokens&) = delete;

  // Group g (K-pair rows kb0 .. kb0 + 15): the tokens' 32 q bytes into A, their c12 and s_b for the epilogue.
  void group(const uint8_t* const* as, int kb0, int g) {
    for (int t = 0; t < nt_; ++t) {
      std::memcpy(a_[t], as[t] + 2 * kb0, 32);
      const float* sb = (const float*)(as[t] + 2 * nkp_);
      corr_[t] = ((const int32_t*)(sb + nkp_ / 16))[g];
      bt_[t] = sb[g];
    }
    _tile_loadd(0, a_, 32);
  }

  // The decoded group buf (32 zmm, buf[4 rp + q]) against A: tot[t * ts + q] += its group term (dot_tokens').
  void dot(const __m512i* buf, const __m512* sc, __m512* tot, int ts) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_loadd(1, buf + 0, 256);
    _tile_dpbsud(2, 0, 1);
    _tile_loadd(1, buf + 1, 256);
    _tile_dpbsud(3, 0, 1);
    _tile_loadd(1, buf + 2, 256);
    _tile_dpbsud(4, 0, 1);
    _tile_loadd(1, buf + 3, 256);
    _tile_dpbsud(5, 0, 1);
    _tile_stored(2, c_[0], 64);
    _tile_stored(3, c_[1], 64);
    _tile_stored(4, c_[2], 64);
    _tile_stored(5, c_[3], 64);
    for (int t = 0; t < nt_; ++t) {
      const __m512i corr = _mm512_set1_epi32(corr_[t]);
      const __m512 bt = _mm512_set1_ps(bt_[t]);
      for (int q = 0; q < 4; ++q) {
        __m512& d = tot[t * ts + q];
        const __m512i s = _mm512_sub_epi32(_mm512_load_si512(c_[q][t]), corr);
        d = _mm512_add_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sc[q], bt)));
      }
    }
  }

  int nt_, nkp_;
  alignas(64) int8_t a_[16][32];
  alignas(64) int32_t c_[4][16][16];
  int32_t corr_[16];
  float bt_[16];
};

}  // namespace w8
}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
