// Runs the mxfp4 work items of every tier and compares them bit for bit (see run.sh):
//   w4a8: avx2, avxvnni, avx512f, avx512vnni == scalar (exact integers, the same fp32 epilogue);
//   native: avx512f == avx2 (the same FMAs per column in the same order);
//   every tier: n tokens in one work item == each token alone (the batched decode).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "cpumoe_formats/abi.h"
#define DECL(t) bool cpumoe_init_mxfp4_##t(cpumoe_kernel*);
DECL(scalar) DECL(avx2) DECL(avxvnni) DECL(avx512f) DECL(avx512vnni)
typedef bool (*Init)(cpumoe_kernel*);
static uint16_t tobf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7FFF + ((u >> 16) & 1); return u >> 16; }
static std::mt19937 rng(1);

struct Out {
  std::vector<uint16_t> g;  // [items][T][I]
  std::vector<float> acc;   // [items][T][H]
};
struct Setup {
  int E, H, I, T;
  std::vector<cpumoe_bank> banks;
  std::vector<uint16_t> x, gin;  // x [T][H]; g rows for down [T][I]
};

// batched: all T tokens per call; else one call per token.
static Out run(Init init, int mode, const Setup& s, bool batched, bool* ok) {
  cpumoe_kernel k{};
  k.params.format = CPUMOE_FMT_MXFP4, k.params.mode = mode, k.params.num_experts = s.E;
  k.params.hidden = s.H, k.params.inter = s.I, k.params.act = CPUMOE_ACT_SWIGLUOAI;
  k.params.alpha = 1.702f, k.params.limit = 7.f;
  Out o;
  if (!(*ok = init(&k))) return o;
  const int H = s.H, I = s.I, T = s.T;
  std::vector<std::vector<char>> xp(T, std::vector<char>(k.act_bytes(&k, H) + 64)),
      gp(T, std::vector<char>(k.act_bytes(&k, I) + 64));
  for (int t = 0; t < T; ++t) k.prep_act(&k, &s.x[(size_t)t * H], H, xp[t].data());
  for (int t = 0; t < T; ++t) k.prep_act(&k, &s.gin[(size_t)t * I], I, gp[t].data());
  auto clamp = [](int v, int n) { return v < 0 ? 0 : v > n ? n : v; };
  std::vector<std::pair<int, int>> gi, hi;  // work items: whole, one vector, odd edges, straddling, last row
  for (auto r : {std::pair<int, int>{0, I}, {0, 32}, {5, I - 3}, {I / 2 - 17, I / 2 + 48}, {I - 1, I}})
    if (clamp(r.first, I) < clamp(r.second, I)) gi.push_back({clamp(r.first, I), clamp(r.second, I)});
  for (auto r : {std::pair<int, int>{0, H}, {0, 64}, {7, H - 9}, {H / 2 - 33, H / 2 + 70}, {H - 1, H}})
    if (clamp(r.first, H) < clamp(r.second, H)) hi.push_back({clamp(r.first, H), clamp(r.second, H)});
  for (auto& r : gi) {
    std::vector<uint16_t> g((size_t)T * I, 0x7FC1);
    for (int t0 = 0; t0 < T; t0 += batched ? T : 1) {
      const int n = batched ? T : 1;
      std::vector<const void*> xs;
      std::vector<float> w;
      std::vector<uint16_t*> gs;
      for (int t = t0; t < t0 + n; ++t) xs.push_back(xp[t].data()), w.push_back(1.f), gs.push_back(&g[(size_t)t * I]);
      k.gate_up(&k, s.banks.data(), 1, r.first, r.second, n, xs.data(), w.data(), gs.data());
    }
    o.g.insert(o.g.end(), g.begin(), g.end());
  }
  for (auto& r : hi) {
    std::vector<float> acc((size_t)T * H, 0.25f);
    for (int t0 = 0; t0 < T; t0 += batched ? T : 1) {
      const int n = batched ? T : 1;
      std::vector<cpumoe_route> routes;
      for (int t = t0; t < t0 + n; ++t) routes.push_back({t, 1, 0.5f + 0.25f * t, 0, gp[t].data()});
      k.down(&k, s.banks.data(), r.first, r.second, routes.data(), n, acc.data() + r.first, H);
    }
    o.acc.insert(o.acc.end(), acc.begin(), acc.end());
  }
  return o;
}

static bool same(const Out& a, const Out& b) {
  size_t gd = 0, ad = 0;
  for (size_t i = 0; i < a.g.size() && i < b.g.size(); ++i) gd += a.g[i] != b.g[i];
  for (size_t i = 0; i < a.acc.size() && i < b.acc.size(); ++i) ad += std::memcmp(&a.acc[i], &b.acc[i], 4) != 0;
  const bool ok = a.g.size() == b.g.size() && a.acc.size() == b.acc.size() && gd == 0 && ad == 0;
  if (!ok) printf("    differ: g %zu/%zu, acc %zu/%zu\n", gd, a.g.size(), ad, a.acc.size());
  return ok;
}

int main() {
  int fails = 0, checks = 0;
  struct Tier { const char* name; Init init; bool native; };
  const Tier tiers[] = {{"scalar", cpumoe_init_mxfp4_scalar, true},   {"avx2", cpumoe_init_mxfp4_avx2, true},
                        {"avxvnni", cpumoe_init_mxfp4_avxvnni, false}, {"avx512f", cpumoe_init_mxfp4_avx512f, true},
                        {"avx512vnni", cpumoe_init_mxfp4_avx512vnni, false}};
  const int shapes[][3] = {{160, 96, 5}, {2880, 224, 8}, {512, 1024, 3}, {64, 32, 2}, {288, 416, 11}};
  for (auto& sh : shapes) {
    Setup s{2, sh[0], sh[1], sh[2], {}, {}, {}};
    const int E = s.E, H = s.H, I = s.I;
    static std::vector<uint8_t> gb, gsc, db, dsc;
    static std::vector<uint16_t> gbias, dbias;
    gb.resize((size_t)E * H / 2 * 2 * I), gsc.resize((size_t)E * H / 32 * 2 * I);
    db.resize((size_t)E * I / 2 * H), dsc.resize((size_t)E * I / 32 * H);
    gbias.resize((size_t)E * 2 * I), dbias.resize((size_t)E * H);
    for (auto& v : gb) v = rng();
    for (auto& v : db) v = rng();
    for (auto& v : gsc) v = rng() % 16 == 0 ? (uint8_t)(rng() % 256) : 118 + rng() % 4;  // a few extreme codes
    for (auto& v : dsc) v = 118 + rng() % 4;
    for (auto& v : gbias) v = tobf(0.01f * (float)((int)(rng() % 200) - 100) / 100.f);
    for (auto& v : dbias) v = tobf(0.01f * (float)((int)(rng() % 200) - 100) / 100.f);
    s.banks.assign(8, cpumoe_bank{nullptr, 0, 0});
    s.banks[0] = {gb.data(), (int64_t)H / 2 * 2 * I, 2 * I};
    s.banks[1] = {gsc.data(), (int64_t)H / 32 * 2 * I, 2 * I};
    s.banks[2] = {gbias.data(), (int64_t)2 * I * 2, 2};
    s.banks[3] = {db.data(), (int64_t)I / 2 * H, H};
    s.banks[4] = {dsc.data(), (int64_t)I / 32 * H, H};
    s.banks[5] = {dbias.data(), (int64_t)H * 2, 2};
    std::normal_distribution<float> nd;
    s.x.resize((size_t)s.T * H), s.gin.resize((size_t)s.T * I);
    for (auto& v : s.x) v = tobf(nd(rng));
    for (auto& v : s.gin) v = tobf(nd(rng));
    for (int mode = 0; mode < 2; ++mode) {
      bool ok;
      const Out ref = run(mode ? cpumoe_init_mxfp4_scalar : cpumoe_init_mxfp4_avx2, mode, s, true, &ok);
      for (auto& t : tiers) {
        if (mode == 0 && !t.native) continue;
        bool ok1, ok2;
        const Out a = run(t.init, mode, s, true, &ok1), b = run(t.init, mode, s, false, &ok2);
        if (!ok1 || !ok2) { printf("%s mode %d: init failed\n", t.name, mode); ++fails; continue; }
        const bool batch_ok = same(a, b);
        const bool tier_ok = (mode == 0 && !strcmp(t.name, "scalar")) || same(a, ref);
        checks += 2;
        fails += !batch_ok + !tier_ok;
        printf("%-10s %-6s H=%4d I=%4d T=%2d: batched == per-token %s, == %s %s\n", t.name, mode ? "w4a8" : "native", H,
               I, s.T, batch_ok ? "ok" : "FAIL", mode ? "scalar" : "avx2",
               (mode == 0 && !strcmp(t.name, "scalar")) ? "(n/a)" : tier_ok ? "ok" : "FAIL");
      }
    }
  }
  printf("%d checks, %s\n", checks, fails ? "FAILURES" : "all ok");
  return fails != 0;
}
