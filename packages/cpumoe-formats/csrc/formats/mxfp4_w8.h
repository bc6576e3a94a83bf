// mxfp4 mode w4a8 (private to mxfp4.cpp, included after its Tile / V256 / V512 definitions).
//
// Activations are quantized to int8 per 32-K block (the e8m0 scale block), in fp32: s_b = amax / 127,
// id = 1 / s_b (0 where not finite: amax == 0, or 1/s_b overflows), q = clamp(rint(x * id), -127, 127),
// half to even (as q4_0's Q8_0). Weights are the exact int8 w = 2 * E2M1[code] in {0, +-1, ..., +-12}.
// Per group (16 K-pair rows = 32 K) and column: the exact integer S = sum(w * q), then
//   tot = fma((float)S, (e8m0 * 0.5f) * s_b, tot)    (one product, one fma; in every tier)
// so every tier computes the same integers and the same fp32 operations: bit-identical outputs.
//
// Prepared vector of length K (act_bytes = K + K/32 * 8): int8 q[K], then fp32 s_b[K/32], then
// int32 c12[K/32] = 12 * (sum of the block's q).
//
// SIMD: the weights are decoded ONCE per (row pair, W columns), independently of the token, to the
// unsigned u = w + 12 (0..24, one vpshufb, fp4::w2_offset) and interleaved so that each dword holds
// (u[2kb], u[2kb+1], u[2kb+2], u[2kb+3]) of one column: the row pair's four K in the order of the
// activation's bytes q[4m .. 4m+3]. A token then needs one dword broadcast and, per 8 columns, one
// u.q dot of 4 bytes into int32: vpdpbusd on VNNI tiers; otherwise vpmaddubsw (pairs <= 2*24*127 = 6096,
// never saturating) into int16 accumulators over 4 row pairs (<= 24384), widened by vpmaddwd(1): the same
// exact integer. S = acc - c12 per group. The
// decoded group (8 row pairs x 4 vectors) stays in L1 while every token of the item uses it.
// Lane order of the 4 int32 vectors of a W-column load: vector q, lane l = column w8_col(q, l).
#pragma once

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
namespace w8 {

size_t act_bytes(const cpumoe_kernel*, int32_t K) { return (size_t)K + (size_t)K / 32 * 8; }

void prep_act(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  int8_t* q = (int8_t*)dst;
  float* sb = (float*)((uint8_t*)dst + K);
  int32_t* c12 = (int32_t*)(sb + K / 32);
  for (int32_t b = 0; b < K / 32; ++b) {
#if defined(__AVX2__)  // the same codes, scale and sum (common.h q8_block32)
    const uint16_t* p = src + 32 * b;
    const __m256 xv[4] = {bf16x8_f32(p), bf16x8_f32(p + 8), bf16x8_f32(p + 16), bf16x8_f32(p + 24)};
    const __m256i v = q8_block32(xv, &sb[b]);
    _mm256_storeu_si256((__m256i*)(q + 32 * b), v);
    c12[b] = fp4::kW2Offset * hsum8_i32(sum4_i8(v));
#else
    float x[32];
    for (int j = 0; j < 32; ++j) x[j] = bf16_to_f32(src[32 * b + j]);
    sb[b] = q8_block(x, 32, q + 32 * b);  // the Q8_0 rule (common.h)
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += q[32 * b + j];
    c12[b] = fp4::kW2Offset * sum;
#endif
  }
}

CPUMOE_INLINE float e8m0_half(uint8_t s) { return e8m0_to_f32(s) * 0.5f; }  // exact: >= 2^-128

void tile_scalar(const Tile& T, int c0, int nc, int nt, const uint8_t* const* as, float* out, int os) {
  const int ng = T.nkp / kGroupRows;
  int32_t S[kMaxCols];
  for (int t = 0; t < nt; ++t) {
    const int8_t* q = (const int8_t*)as[t];
    const float* sb = (const float*)(as[t] + 2 * T.nkp);
    float* o = out + t * os + c0;
    for (int c = 0; c < nc; ++c) o[c] = 0.f;
    for (int g = 0; g < ng; ++g) {
      for (int c = 0; c < nc; ++c) S[c] = 0;
      for (int r = 0; r < kGroupRows; ++r) {
        const int kb = g * kGroupRows + r;
        const uint8_t* row = T.blk + kb * T.bs + c0;
        const int q0 = q[2 * kb], q1 = q[2 * kb + 1];
        for (int c = 0; c < nc; ++c) S[c] += fp4::kW2[row[c] & 15] * q0 + fp4::kW2[row[c] >> 4] * q1;
      }
      const uint8_t* srow = T.scl + g * T.ss + c0;
      for (int c = 0; c < nc; ++c) o[c] = std::fma((float)S[c], e8m0_half(srow[c]) * sb[g], o[c]);
    }
  }
}

#if CPUMOE_TIER >= CPUMOE_T_AVX2
// Tokens per register block with 256-bit vectors (4 int32 + 4 int16 accumulators each); 1, 2 and 3
// were within the dev box's noise for batch 8.
constexpr int kW8Ntg256 = 2;
CPUMOE_INLINE int w8_col(int q, int l) { return 16 * (l / 4) + 4 * q + (l % 4); }

// Rows kb, kb+1 (at p, p + bs), W columns -> d[q] dword lane l = (u_lo[kb], u_hi[kb], u_lo[kb+1],
// u_hi[kb+1]) of column w8_col(q, l).
template <class V>
CPUMOE_INLINE void decode_pair(const uint8_t* p, int64_t bs, typename V::I m0f, typename V::I lut,
                               typename V::I* d) {
  using I = typename V::I;
  const I b0 = V::load(p), b1 = V::load(p + bs);
  const I l0 = V::shuf(lut, V::band(b0, m0f)), h0 = V::shuf(lut, V::band(V::srl4(b0), m0f));
  const I l1 = V::shuf(lut, V::band(b1, m0f)), h1 = V::shuf(lut, V::band(V::srl4(b1), m0f));
  const I p0 = V::ulo8(l0, h0), p0h = V::uhi8(l0, h0), p1 = V::ulo8(l1, h1), p1h = V::uhi8(l1, h1);
  d[0] = V::ulo16(p0, p1);
  d[1] = V::uhi16(p0, p1);
  d[2] = V::ulo16(p0h, p1h);
  d[3] = V::uhi16(p0h, p1h);
}

// NT tokens against one decoded group (buf[4 rp + q], rp = row pair 0..7).
template <class V, int NT>
CPUMOE_INLINE void dot_tokens(const typename V::I* buf, const uint8_t* const* as, int nkp, int kb0, int g,
                              const typename V::F* sc, typename V::F* tot, int ts) {
  using I = typename V::I;
  using F = typename V::F;
  I acc[NT][4];
  MX_UNROLL
  for (int t = 0; t < NT; ++t)
    MX_UNROLL
    for (int q = 0; q < 4; ++q) acc[t][q] = V::zero();
  // Row pairs in runs of kRun: without VNNI each int16 lane sums kRun rows, <= 4 * 6096 = 24384.
  constexpr int kRun = 4;
  for (int r0 = 0; r0 < kGroupRows / 2; r0 += kRun) {
    I acc16[NT][4];
    MX_UNROLL
    for (int t = 0; t < NT; ++t)
      MX_UNROLL
      for (int q = 0; q < 4; ++q) acc16[t][q] = V::zero();
    for (int rp = r0; rp < r0 + kRun; ++rp) {
      I a[NT];
      MX_UNROLL
      for (int t = 0; t < NT; ++t) {
        int32_t a4;
        std::memcpy(&a4, as[t] + 2 * kb0 + 4 * rp, 4);  // q[2kb .. 2kb+3], kb = kb0 + 2 rp
        a[t] = V::set1_32(a4);
      }
      MX_UNROLL
      for (int q = 0; q < 4; ++q) {
        const I u = buf[4 * rp + q];
        MX_UNROLL
        for (int t = 0; t < NT; ++t) {
          if (V::kVnni)
            acc[t][q] = V::dot4(acc[t][q], u, a[t]);
          else
            acc16[t][q] = V::madd2(acc16[t][q], u, a[t]);
        }
      }
    }
    if (!V::kVnni)
      MX_UNROLL
      for (int t = 0; t < NT; ++t)
        MX_UNROLL
        for (int q = 0; q < 4; ++q) acc[t][q] = V::widen(acc[t][q], acc16[t][q]);
  }
  MX_UNROLL
  for (int t = 0; t < NT; ++t) {
    const float* sb = (const float*)(as[t] + 2 * nkp);
    const int32_t* c12 = (const int32_t*)(sb + nkp / 16);
    const I corr = V::set1_32(c12[g]);
    const F bt = V::set1(sb[g]);
    MX_UNROLL
    for (int q = 0; q < 4; ++q) {
      F& d = tot[t * ts + q];
      d = V::fma(V::cvt(V::sub32(acc[t][q], corr)), V::mul(sc[q], bt), d);
    }
  }
}

// nt >= 1 tokens, nch chunks of W columns from column c0.
template <class V, int NTG>
void tile_simd(const Tile& T, int c0, int nch, int nt, const uint8_t* const* as, float* out, int os) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int W = V::W, L = W / 4;
  const I m0f = V::set1_8(0x0F), lut = V::ulut();
  const int ts = os / L;
  F tot[kPassFloats / L];
  for (int t = 0; t < nt; ++t)
    for (int v = 0; v < nch * 4; ++v) tot[t * ts + v] = V::fzero();
  const auto [blk, scl, pfd, unaligned, unaligned_s, ng] = TileWalk(T, c0, nch * W);
  for (int g = 0; g < ng; ++g) {
    const int kb0 = g * kGroupRows;
    for (int ch = 0; ch < nch; ++ch) {
      I buf[4 * kGroupRows / 2];
      const uint8_t* p = blk + (int64_t)kb0 * T.bs + ch * W;
      for (int rp = 0; rp < kGroupRows / 2; ++rp, p += 2 * T.bs) {
        MX_PREFETCH(p + pfd);
        MX_PREFETCH(p + T.bs + pfd);
        if (unaligned) MX_PREFETCH(p + pfd + W - 1), MX_PREFETCH(p + T.bs + pfd + W - 1);
        decode_pair<V>(p, T.bs, m0f, lut, buf + 4 * rp);
      }
      const uint8_t* sp = scl + (int64_t)g * T.ss + ch * W;
      prefetch_scales(T, sp, g, W, unaligned_s);
      F sc[4];
      {  // scales in w8_col order: byte s -> word s << 8 -> dword s << 24 -> e8m0, times 0.5
        const I s = V::minu8(V::load(sp), 254), z = V::zero();
        const I s0 = V::ulo8(z, s), s1 = V::uhi8(z, s);
        const F half = V::set1(0.5f);
        sc[0] = V::mul(V::e8m0(V::ulo16(z, s0)), half);
        sc[1] = V::mul(V::e8m0(V::uhi16(z, s0)), half);
        sc[2] = V::mul(V::e8m0(V::ulo16(z, s1)), half);
        sc[3] = V::mul(V::e8m0(V::uhi16(z, s1)), half);
      }
      F* tt = tot + ch * 4;
      int t = 0;
      for (; t + NTG <= nt; t += NTG) dot_tokens<V, NTG>(buf, as + t, T.nkp, kb0, g, sc, tt + t * ts, ts);
      switch (nt - t) {
        case 1: dot_tokens<V, 1>(buf, as + t, T.nkp, kb0, g, sc, tt + t * ts, ts); break;
        case 2: dot_tokens<V, (NTG > 2 ? 2 : 1)>(buf, as + t, T.nkp, kb0, g, sc, tt + t * ts, ts); break;
        case 3: dot_tokens<V, (NTG > 3 ? 3 : 1)>(buf, as + t, T.nkp, kb0, g, sc, tt + t * ts, ts); break;
        default: break;
      }
    }
  }
  store_totals<V, w8_col>(tot, ts, nt, nch, out, os, c0);
}

// One token, every SIMD tier: each K row goes straight from the load into vpmaddubsw, no buffer. The two
// nibble vectors of a row (u of K = 2kb and 2kb+1, one vpshufb each) are byte-interleaved
// (vpunpck{l,h}bw), so each 16-bit lane holds (u[2kb], u[2kb+1]) of one column, in the native tile's
// lane order (lane_col; the scales and the final store are shared with it); against the activation pair
// (q[2kb], q[2kb+1]) broadcast to every 16-bit lane, vpmaddubsw gives u[2kb] q[2kb] + u[2kb+1] q[2kb+1]
// per column (<= 2 * 24 * 127 = 6096). int16 sums over kRun1 = 4 rows (<= 24384), then vpmaddwd with
// (1, 0) / (0, 1) per dword widens the even / odd columns' words into int32 accumulators that start at
// -c12, so they end as the group's S; the fp32 epilogue is dot_tokens': bit-identical. Per 32 columns and K row: 2 vpshufb,
// 2 vpunpck, 2 vpmaddubsw (+ 1 vpmaddwd amortized) instead of decode_pair's 3 shuffles per vector,
// the buffer's stores and reloads, and dot_tokens' 4-row-pair dword layout.
constexpr int kRun1 = 4;
template <class V, int NCV>
void tile_one(const Tile& T, int c0, int nch, const uint8_t* a, float* out, int os) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int W = V::W, NV = 4 * NCV, L = W / 4, CW = NCV * W;
  static_assert(kGroupRows % kRun1 == 0, "runs per group");
  const I m0f = V::set1_8(0x0F), lut = V::ulut(), sel_lo = V::set1_32(1), sel_hi = V::set1_32(0x10000);
  const F half = V::set1(0.5f);
  F tot[kPassFloats / L];
  for (int v = 0; v < nch * NV; ++v) tot[v] = V::fzero();
  const int8_t* q = (const int8_t*)a;
  const float* sb = (const float*)(a + 2 * T.nkp);
  const int32_t* c12 = (const int32_t*)(sb + T.nkp / 16);
  const auto [blk, scl, pfd, unaligned, unaligned_s, ng] = TileWalk(T, c0, nch * CW);
  for (int g = 0; g < ng; ++g) {
    const int kb0 = g * kGroupRows;
    int32_t a2[kGroupRows];  // (q[2kb], q[2kb+1]) twice per dword: one vpbroadcastd per row
    for (int r = 0; r < kGroupRows; ++r) {
      uint16_t pr;
      std::memcpy(&pr, q + 2 * (kb0 + r), 2);
      a2[r] = (int32_t)((uint32_t)pr * 0x10001u);
    }
    const I ncorr = V::set1_32(-c12[g]);
    const F bt = V::set1(sb[g]);
    for (int ch = 0; ch < nch; ++ch) {
      I acc[NV];  // start at -c12: ends as S = sum(u q) - 12 sum(q), the same exact integer
      MX_UNROLL
      for (int v = 0; v < NV; ++v) acc[v] = ncorr;
      const uint8_t* p = blk + (int64_t)kb0 * T.bs + ch * CW;
      for (int r0 = 0; r0 < kGroupRows; r0 += kRun1) {
        I acc16[2 * NCV];
        MX_UNROLL
        for (int v = 0; v < 2 * NCV; ++v) acc16[v] = V::zero();
        MX_UNROLL
        for (int r = r0; r < r0 + kRun1; ++r, p += T.bs) {
          MX_UNROLL
          for (int o = 0; o < CW; o += 64) MX_PREFETCH(p + pfd + o);
          if (CW % 64 == 0 && unaligned) MX_PREFETCH(p + pfd + CW - 1);
          const I ar = V::set1_32(a2[r]);
          MX_UNROLL
          for (int c = 0; c < NCV; ++c) {
            const I b = V::load(p + c * W);
            const I ul = V::shuf(lut, V::band(b, m0f)), uh = V::shuf(lut, V::band(V::srl4(b), m0f));
            acc16[2 * c] = V::madd2(acc16[2 * c], V::ulo8(ul, uh), ar);
            acc16[2 * c + 1] = V::madd2(acc16[2 * c + 1], V::uhi8(ul, uh), ar);
          }
        }
        MX_UNROLL
        for (int c = 0; c < NCV; ++c) {
          acc[4 * c] = V::widen_sel(acc[4 * c], acc16[2 * c], sel_lo);
          acc[4 * c + 1] = V::widen_sel(acc[4 * c + 1], acc16[2 * c], sel_hi);
          acc[4 * c + 2] = V::widen_sel(acc[4 * c + 2], acc16[2 * c + 1], sel_lo);
          acc[4 * c + 3] = V::widen_sel(acc[4 * c + 3], acc16[2 * c + 1], sel_hi);
        }
      }
      const uint8_t* sp = scl + (int64_t)g * T.ss + ch * CW;
      prefetch_scales(T, sp, g, CW, unaligned_s);
      MX_UNROLL
      for (int c = 0; c < NCV; ++c) {
        F sc[4];
        scales4<V>(sp + c * W, sc);
        MX_UNROLL
        for (int v = 0; v < 4; ++v) {
          F& d = tot[ch * NV + 4 * c + v];
          d = V::fma(V::cvt(acc[4 * c + v]), V::mul(V::mul(sc[v], half), bt), d);
        }
      }
    }
  }
  store_totals<V, lane_col>(tot, os / L, 1, nch * NCV, out, os, c0);
}

// One token takes tile_one on the VNNI tiers too unless built with -DCPUMOE_MX_ONE_VNNI=0
// (bench/device/kernel_sweep.sh).
#ifndef CPUMOE_MX_ONE_VNNI
#define CPUMOE_MX_ONE_VNNI 1
#endif
template <class V, int NTG>
int tile_run(const Tile& T, int c, int nc, int nt, const uint8_t* const* as, float* out, int os) {
  if (nc - c < V::W) return c;
  if (nt == 1 && (CPUMOE_MX_ONE_VNNI || !V::kVnni)) {
    if (nc - c >= 2 * V::W) {
      const int nch = (nc - c) / (2 * V::W);
      tile_one<V, 2>(T, c, nch, as[0], out, os);
      c += nch * 2 * V::W;
    }
    if (nc - c >= V::W) {
      tile_one<V, 1>(T, c, 1, as[0], out, os);
      c += V::W;
    }
    return c;
  }
  const int nch = (nc - c) / V::W;
  tile_simd<V, NTG>(T, c, nch, nt, as, out, os);
  return c + nch * V::W;
}
#endif

// out[t * os + c] for c < nc (see tile() in mxfp4.cpp).
void tile_any(const Tile& T, int nc, int nt, const uint8_t* const* as, float* out, int os) {
  int c = 0;
#if CPUMOE_TIER >= CPUMOE_T_AVX512F
  c = tile_run<V512, 4>(T, c, nc, nt, as, out, os);
  c = tile_run<V256, kW8Ntg256>(T, c, nc, nt, as, out, os);
#elif CPUMOE_TIER >= CPUMOE_T_AVX2
  c = tile_run<V256, kW8Ntg256>(T, c, nc, nt, as, out, os);
#endif
  if (c < nc) tile_scalar(T, c, nc - c, nt, as, out, os);
}

}  // namespace w8
}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
