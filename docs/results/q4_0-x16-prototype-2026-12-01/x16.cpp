// Feasibility microbench: q4_0 with 16 rows interleaved per 32-block (lanes = rows), w4a8 (Q8_0 activations).
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <chrono>
#include <vector>
#include <random>
static const int QK = 32;
// group block: 16 fp16 d (32 B), then 4 x 64 B: vector j lane r = row r's qs bytes 4j..4j+3
template <int NT, int G>  // G row groups at once
static inline void groups(const uint8_t* W, int nb, const int8_t* const* q, const float* const* da,
                          const int32_t* const* corr, float* out, int g0) {
  const __m512i m = _mm512_set1_epi8(0x0F);
  __m512 acc[G][NT];
  for (int k = 0; k < G; ++k) for (int t = 0; t < NT; ++t) acc[k][t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    for (int k = 0; k < G; ++k) {
      const uint8_t* p = W + ((size_t)(g0 + k) * nb + b) * 288;
      _mm_prefetch((const char*)p + 2048, _MM_HINT_T0);
      _mm_prefetch((const char*)p + 2048 + 64, _MM_HINT_T0);
      _mm_prefetch((const char*)p + 2048 + 128, _MM_HINT_T0);
      _mm_prefetch((const char*)p + 2048 + 192, _MM_HINT_T0);
      _mm_prefetch((const char*)p + 2048 + 256, _MM_HINT_T0);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      __m512i lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i w = _mm512_loadu_si512(p + 32 + 64 * j);
        lo[j] = _mm512_and_si512(w, m);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(w, 4), m);
      }
      for (int t = 0; t < NT; ++t) {
        const int32_t* qa = (const int32_t*)(q[t] + (size_t)b * QK);
        __m512i s0 = _mm512_set1_epi32(corr[t][b]), s1 = _mm512_setzero_si512();
        s0 = _mm512_dpbusd_epi32(s0, lo[0], _mm512_set1_epi32(qa[0]));
        s1 = _mm512_dpbusd_epi32(s1, hi[0], _mm512_set1_epi32(qa[4]));
        s0 = _mm512_dpbusd_epi32(s0, lo[1], _mm512_set1_epi32(qa[1]));
        s1 = _mm512_dpbusd_epi32(s1, hi[1], _mm512_set1_epi32(qa[5]));
        s0 = _mm512_dpbusd_epi32(s0, lo[2], _mm512_set1_epi32(qa[2]));
        s1 = _mm512_dpbusd_epi32(s1, hi[2], _mm512_set1_epi32(qa[6]));
        s0 = _mm512_dpbusd_epi32(s0, lo[3], _mm512_set1_epi32(qa[3]));
        s1 = _mm512_dpbusd_epi32(s1, hi[3], _mm512_set1_epi32(qa[7]));
        const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(da[t][b]));
        acc[k][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), sc, acc[k][t]);
      }
    }
  }
  for (int k = 0; k < G; ++k) for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + ((size_t)(g0 + k) * NT + t) * 16, acc[k][t]);
}
template <int NT, int G>
void gemv(const uint8_t* W, int ngroups, int nb, const int8_t* const* q, const float* const* da, const int32_t* const* corr, float* out) {
  for (int g = 0; g < ngroups; g += G) groups<NT, G>(W, nb, q, da, corr, out, g);
}
static float h2f(uint16_t h) { return _cvtsh_ss(h); }
int main(int argc, char** argv) {
  const int K = argc > 1 ? atoi(argv[1]) : 2816, rows = argc > 2 ? atoi(argv[2]) : 1408, nb = K / 32, ng = rows / 16;
  std::mt19937 rng(1);
  // row-major q4_0 source
  std::vector<uint8_t> src((size_t)rows * nb * 18);
  for (auto& v : src) v = rng();
  for (int r = 0; r < rows; ++r) for (int b = 0; b < nb; ++b) { uint16_t d = _cvtss_sh((rng() % 1000) / 1e5f + 1e-3f, 0); memcpy(&src[((size_t)r * nb + b) * 18], &d, 2); }
  std::vector<uint8_t> W((size_t)ng * nb * 288 + 4096);
  for (int g = 0; g < ng; ++g) for (int b = 0; b < nb; ++b) {
    uint8_t* p = &W[((size_t)g * nb + b) * 288];
    for (int r = 0; r < 16; ++r) {
      const uint8_t* s = &src[((size_t)(16 * g + r) * nb + b) * 18];
      memcpy(p + 2 * r, s, 2);
      for (int j = 0; j < 4; ++j) memcpy(p + 32 + 64 * j + 4 * r, s + 2 + 4 * j, 4);
    }
  }
  const int NT = 8;
  std::vector<std::vector<int8_t>> Q(NT, std::vector<int8_t>(K));
  std::vector<std::vector<float>> DA(NT, std::vector<float>(nb));
  std::vector<std::vector<int32_t>> C(NT, std::vector<int32_t>(nb));
  const int8_t* qp[NT]; const float* dp[NT]; const int32_t* cp[NT];
  for (int t = 0; t < NT; ++t) {
    for (int i = 0; i < K; ++i) Q[t][i] = (int8_t)(rng() % 255 - 127);
    for (int b = 0; b < nb; ++b) { DA[t][b] = (rng() % 1000) / 1e4f + 1e-3f; int s = 0; for (int i = 0; i < 32; ++i) s += Q[t][32 * b + i]; C[t][b] = -8 * s; }
    qp[t] = Q[t].data(); dp[t] = DA[t].data(); cp[t] = C[t].data();
  }
  std::vector<float> out((size_t)rows * NT);
  // check NT=8 against double
  gemv<8, 1>(W.data(), ng, nb, qp, dp, cp, out.data());
  double maxrel = 0;
  for (int r = 0; r < rows; ++r) for (int t = 0; t < NT; ++t) {
    double ref = 0, mag = 0;
    for (int b = 0; b < nb; ++b) {
      const uint8_t* s = &src[((size_t)r * nb + b) * 18]; uint16_t dh; memcpy(&dh, s, 2);
      long is = 0; for (int i = 0; i < 16; ++i) { is += ((s[2 + i] & 15) - 8) * Q[t][32 * b + i] + ((s[2 + i] >> 4) - 8) * Q[t][32 * b + 16 + i]; }
      double sc = (double)(float)(h2f(dh) * DA[t][b]); ref += is * sc; mag += fabs(is * sc);
    }
    const float got = out[((size_t)(r / 16) * NT + t) * 16 + r % 16];
    maxrel = std::max(maxrel, fabs(got - ref) / (mag + 1e-30));
  }
  printf("check: max |got-ref|/sum|terms| = %.2e\n", maxrel);
  auto bench = [&](const char* name, auto f) {
    double best = 1e9;
    for (int rep = 0; rep < 200; ++rep) { auto t0 = std::chrono::steady_clock::now(); f(); best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()); }
    printf("%s: %.1f us (%.1f GB/s of weights)\n", name, best * 1e6, (double)ng * nb * 288 / best / 1e9);
  };
  bench("x16 NT=1 G=2", [&] { gemv<1, 2>(W.data(), ng, nb, qp, dp, cp, out.data()); });
  bench("x16 NT=1 G=4", [&] { gemv<1, 4>(W.data(), ng, nb, qp, dp, cp, out.data()); });
  bench("x16 NT=8 G=1", [&] { gemv<8, 1>(W.data(), ng, nb, qp, dp, cp, out.data()); });
  return 0;
}
