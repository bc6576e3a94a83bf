// Compares the nvfp4 / ds_fp4 tiers work item by work item (see run.sh).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include "cpumoe_formats/abi.h"
#define DECL(f, t) bool cpumoe_init_##f##_##t(cpumoe_kernel*);
DECL(nvfp4, scalar) DECL(nvfp4, avx2) DECL(nvfp4, avxvnni) DECL(nvfp4, avx512f) DECL(nvfp4, avx512vnni)
DECL(ds_fp4, scalar) DECL(ds_fp4, avx2) DECL(ds_fp4, avx512f) DECL(ds_fp4, avx512vnni)
typedef bool (*Init)(cpumoe_kernel*);
static float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t tobf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7FFF + ((u >> 16) & 1); return u >> 16; }
struct Out { std::vector<uint16_t> g; std::vector<float> acc; };
static std::mt19937 rng(1);
static Out run(Init init, int fmt, int mode, int E, int H, int I, int T, const std::vector<cpumoe_bank>& banks,
               const std::vector<uint16_t>& x, bool* ok) {
  cpumoe_kernel k{};
  k.params.format = fmt; k.params.mode = mode; k.params.num_experts = E; k.params.hidden = H; k.params.inter = I;
  k.params.act = CPUMOE_ACT_SILU; k.params.alpha = 1.f; k.params.limit = INFINITY;
  *ok = init(&k);
  Out o;
  if (!*ok) return o;
  size_t xa = k.act_bytes(&k, H), ga = k.act_bytes(&k, I);
  std::vector<std::vector<char>> xp(T, std::vector<char>(xa + 64)), gp(T * E, std::vector<char>(ga + 64));
  for (int t = 0; t < T; ++t) k.prep_act(&k, &x[(size_t)t * H], H, xp[t].data());
  o.g.assign((size_t)T * E * I, 0x7FC1);
  for (int e = 0; e < E; ++e) {
    std::vector<const void*> xs;
    std::vector<float> w;
    std::vector<uint16_t*> gs;
    for (int t = 0; t < T; ++t) xs.push_back(xp[t].data()), w.push_back(1.f), gs.push_back(&o.g[((size_t)e * T + t) * I]);
    for (int i0 = 0; i0 < I; i0 += 32) k.gate_up(&k, banks.data(), e, i0, std::min(I, i0 + 32), T, xs.data(), w.data(), gs.data());
    for (int t = 0; t < T; ++t) k.prep_act(&k, gs[t], I, gp[e * T + t].data());
  }
  std::vector<cpumoe_route> routes;
  for (int e = 0; e < E; ++e)
    for (int t = 0; t < T; ++t) routes.push_back({t, e, 0.5f + 0.25f * t, 0, gp[e * T + t].data()});
  o.acc.assign((size_t)T * H, 0.f);
  for (int h0 = 0; h0 < H; h0 += 32) k.down(&k, banks.data(), h0, std::min(H, h0 + 32), routes.data(), (int)routes.size(), o.acc.data() + h0, H);
  return o;
}
int main() {
  int fails = 0;
  struct Case { const char* name; int fmt, mode; Init ref; Init test; };
  Case cases[] = {
      {"nvfp4 native avx512f vs avx2", 1, 0, cpumoe_init_nvfp4_avx2, cpumoe_init_nvfp4_avx512f},
      {"nvfp4 native avx512f vs scalar", 1, 0, cpumoe_init_nvfp4_scalar, cpumoe_init_nvfp4_avx512f},
      {"nvfp4 w4a8 avxvnni vs avx2", 1, 1, cpumoe_init_nvfp4_avx2, cpumoe_init_nvfp4_avxvnni},
      {"nvfp4 w4a8 avx512vnni vs avx2", 1, 1, cpumoe_init_nvfp4_avx2, cpumoe_init_nvfp4_avx512vnni},
      {"nvfp4 w4a8 avx512vnni vs scalar", 1, 1, cpumoe_init_nvfp4_scalar, cpumoe_init_nvfp4_avx512vnni},
      {"ds_fp4 avx512f vs avx2", 3, 0, cpumoe_init_ds_fp4_avx2, cpumoe_init_ds_fp4_avx512f},
      {"ds_fp4 avx512f vs scalar", 3, 0, cpumoe_init_ds_fp4_scalar, cpumoe_init_ds_fp4_avx512f},
      {"ds_fp4 w4a8 avx512f vs avx2", 3, 1, cpumoe_init_ds_fp4_avx2, cpumoe_init_ds_fp4_avx512f},
      {"ds_fp4 w4a8 avx512f vs scalar", 3, 1, cpumoe_init_ds_fp4_scalar, cpumoe_init_ds_fp4_avx512f},
      {"ds_fp4 w4a8 avx512vnni vs avx512f", 3, 1, cpumoe_init_ds_fp4_avx512f, cpumoe_init_ds_fp4_avx512vnni},
  };
  int shapes[][2] = {{272, 144}, {2048, 512}, {384, 384}, {16, 16}, {384, 1152}, {128, 256}};
  for (auto& c : cases)
    for (auto& sh : shapes) {
      int H = sh[0], I = sh[1], E = 2, T = 3;
      if (c.fmt == 3 && (H % 128 || I % 128)) continue;
      int sb = c.fmt == 1 ? 16 : 32;
      std::vector<uint8_t> gp((size_t)E * 2 * I * H / 2), gs((size_t)E * 2 * I * H / sb), dp((size_t)E * H * I / 2), ds((size_t)E * H * I / sb);
      std::vector<uint16_t> gg((size_t)E * 2 * I), dg((size_t)E * H);
      for (auto& v : gp) v = rng(); for (auto& v : dp) v = rng();
      for (auto& v : gs) v = c.fmt == 1 ? 0x30 + rng() % 13 : 119 + rng() % 3;
      for (auto& v : ds) v = c.fmt == 1 ? 0x30 + rng() % 13 : 119 + rng() % 3;
      for (auto& v : gg) v = 0x2000 + rng() % 0x400; for (auto& v : dg) v = 0x2000 + rng() % 0x400;
      std::vector<cpumoe_bank> banks(8, cpumoe_bank{nullptr, 0, 0});
      if (c.fmt == 1) {
        banks[0] = {gp.data(), (int64_t)2 * I * H / 2, H / 2}; banks[1] = {gs.data(), (int64_t)2 * I * H / 16, H / 16};
        banks[2] = {gg.data(), (int64_t)2 * I * 2, 2}; banks[3] = {dp.data(), (int64_t)H * I / 2, I / 2};
        banks[4] = {ds.data(), (int64_t)H * I / 16, I / 16}; banks[5] = {dg.data(), (int64_t)H * 2, 2};
      } else {
        banks[0] = {gp.data(), (int64_t)2 * I * H / 2, H / 2}; banks[1] = {gs.data(), (int64_t)2 * I * H / 32, H / 32};
        banks[2] = {dp.data(), (int64_t)H * I / 2, I / 2}; banks[3] = {ds.data(), (int64_t)H * I / 32, I / 32};
      }
      std::normal_distribution<float> nd;
      std::vector<uint16_t> x((size_t)T * H);
      for (auto& v : x) v = tobf(nd(rng));
      bool ok1, ok2;
      Out a = run(c.ref, c.fmt, c.mode, E, H, I, T, banks, x, &ok1), b = run(c.test, c.fmt, c.mode, E, H, I, T, banks, x, &ok2);
      if (!ok1 || !ok2) { printf("%s: init failed %d %d\n", c.name, ok1, ok2); ++fails; continue; }
      size_t gdiff = 0, gbig = 0;
      float gmax = 0;
      for (size_t i = 0; i < a.g.size(); ++i) gmax = std::max(gmax, std::fabs(bf(a.g[i])));
      for (size_t i = 0; i < a.g.size(); ++i) {
        if (a.g[i] != b.g[i]) ++gdiff;
        float fa = bf(a.g[i]), fb = bf(b.g[i]);
        if (!(std::fabs(fa - fb) <= std::fabs(fa) * 0.016f + 1e-6f * gmax)) { ++gbig; printf("  g[%zu]: %g vs %g\n", i, fa, fb); }
      }
      double amax = 0, dmax = 0; size_t adiff = 0; bool nan = false;
      for (size_t i = 0; i < a.acc.size(); ++i) {
        amax = std::max(amax, (double)std::fabs(a.acc[i]));
        dmax = std::max(dmax, (double)std::fabs(a.acc[i] - b.acc[i]));
        if (a.acc[i] != b.acc[i]) ++adiff;
        if (!std::isfinite(b.acc[i])) nan = true;
      }
      // w4a8 VNNI tiers vs avx2 (nvfp4) / avx512f (ds_fp4): the same integers and fp32 operations, so every bit
      // must agree
      const bool exact = c.mode == 1 && (c.ref == cpumoe_init_nvfp4_avx2 || c.ref == cpumoe_init_ds_fp4_avx512f);
      bool bad = gbig || nan || dmax > 2e-3 * amax || (exact && (gdiff || adiff));
      fails += bad;
      printf("%-34s H=%4d I=%4d: g differ %zu/%zu (beyond 1 ulp: %zu), acc differ %zu/%zu rel %.2e %s\n", c.name, H, I,
             gdiff, a.g.size(), gbig, adiff, a.acc.size(), dmax / amax, bad ? "FAIL" : "ok");
    }
  printf("%s\n", fails ? "FAILURES" : "all ok");
  return fails != 0;
}
