// The format registry: one line per format (constraints), the per-tier
// variant table, and kernel creation by tier ladder with a cap.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "registry.h"
#include "tiers.h"

#define CPUMOE_DECL(fmt, tag) bool cpumoe_init_##fmt##_##tag(cpumoe_kernel*);
#define CPUMOE_DECL_ALL(tag) \
  CPUMOE_DECL(bf16, tag) CPUMOE_DECL(nvfp4, tag) CPUMOE_DECL(mxfp4, tag) \
  CPUMOE_DECL(ds_fp4, tag) CPUMOE_DECL(q4_0, tag) CPUMOE_DECL(fp8_block, tag) CPUMOE_DECL(mxfp4_panel, tag) \
  CPUMOE_DECL(q4_0_x16, tag) CPUMOE_DECL(fp8_block_x16, tag) CPUMOE_DECL(nvfp4_x16, tag) CPUMOE_DECL(ds_fp4_x16, tag) \
  CPUMOE_DECL(bf16_x16, tag) CPUMOE_DECL(mxfp4_x16, tag) CPUMOE_DECL(q8_0, tag) CPUMOE_DECL(q4_k, tag) \
  CPUMOE_DECL(q6_k, tag) CPUMOE_DECL(q4_k_x16, tag) CPUMOE_DECL(q8_0_x16, tag) CPUMOE_DECL(q5_k, tag) \
  CPUMOE_DECL(q6_k_x16, tag) CPUMOE_DECL(q5_k_x16, tag)
CPUMOE_DECL_ALL(scalar)
#ifdef CPUMOE_BUILT_avx2
CPUMOE_DECL_ALL(avx2)
#define V_avx2(f) &cpumoe_init_##f##_avx2
#else
#define V_avx2(f) nullptr
#endif
#ifdef CPUMOE_BUILT_avxvnni
CPUMOE_DECL_ALL(avxvnni)
#define V_avxvnni(f) &cpumoe_init_##f##_avxvnni
#else
#define V_avxvnni(f) nullptr
#endif
#ifdef CPUMOE_BUILT_avx512f
CPUMOE_DECL_ALL(avx512f)
#define V_avx512f(f) &cpumoe_init_##f##_avx512f
#else
#define V_avx512f(f) nullptr
#endif
#ifdef CPUMOE_BUILT_avx512vnni
CPUMOE_DECL_ALL(avx512vnni)
#define V_avx512vnni(f) &cpumoe_init_##f##_avx512vnni
#else
#define V_avx512vnni(f) nullptr
#endif
#ifdef CPUMOE_BUILT_avx512bf16
CPUMOE_DECL_ALL(avx512bf16)
#define V_avx512bf16(f) &cpumoe_init_##f##_avx512bf16
#else
#define V_avx512bf16(f) nullptr
#endif
// amx: only bf16, fp8_block, q4_0 and fp8_block_x16 have tile kernels (hatch_build.py's TIER_FORMATS compiles
// those alone at this tier); the others run their best tier below it.
#ifdef CPUMOE_BUILT_amx
CPUMOE_DECL(bf16, amx)
CPUMOE_DECL(fp8_block, amx)
CPUMOE_DECL(q4_0, amx)
CPUMOE_DECL(fp8_block_x16, amx)
#define V_amx_bf16 &cpumoe_init_bf16_amx
#define V_amx_fp8_block &cpumoe_init_fp8_block_amx
#define V_amx_q4_0 &cpumoe_init_q4_0_amx
#define V_amx_fp8_block_x16 &cpumoe_init_fp8_block_x16_amx
#else
#define V_amx_bf16 nullptr
#define V_amx_fp8_block nullptr
#define V_amx_q4_0 nullptr
#define V_amx_fp8_block_x16 nullptr
#endif
#define V_amx_nvfp4 nullptr
#define V_amx_mxfp4 nullptr
#define V_amx_ds_fp4 nullptr
#define V_amx_mxfp4_panel nullptr
#define V_amx_q4_0_x16 nullptr
#define V_amx_nvfp4_x16 nullptr
#define V_amx_ds_fp4_x16 nullptr
#define V_amx_bf16_x16 nullptr
#define V_amx_mxfp4_x16 nullptr
#define V_amx_q8_0 nullptr
#define V_amx_q4_k nullptr
#define V_amx_q6_k nullptr
#define V_amx_q4_k_x16 nullptr
#define V_amx_q8_0_x16 nullptr
#define V_amx_q5_k nullptr
#define V_amx_q6_k_x16 nullptr
#define V_amx_q5_k_x16 nullptr

namespace cpumoe {
namespace {
using InitFn = bool (*)(cpumoe_kernel*);
#define ROW(f) {&cpumoe_init_##f##_scalar, V_avx2(f), V_avxvnni(f), V_avx512f(f), V_avx512vnni(f), V_avx512bf16(f), V_amx_##f}
const InitFn kVariants[CPUMOE_FMT_COUNT][CPUMOE_TIER_COUNT] = {ROW(bf16),   ROW(nvfp4), ROW(mxfp4),
                                                              ROW(ds_fp4), ROW(q4_0),  ROW(fp8_block),
                                                              ROW(mxfp4_panel), ROW(q4_0_x16), ROW(fp8_block_x16),
                                                              ROW(nvfp4_x16), ROW(ds_fp4_x16), ROW(bf16_x16),
                                                              ROW(mxfp4_x16), ROW(q8_0), ROW(q4_k), ROW(q6_k),
                                                              ROW(q4_k_x16), ROW(q8_0_x16), ROW(q5_k),
                                                              ROW(q6_k_x16), ROW(q5_k_x16)};
#undef ROW
}  // namespace

unsigned variant_tier_mask(int32_t format) {
  unsigned m = 0;
  if (format < 0 || format >= CPUMOE_FMT_COUNT) return 0;
  for (int t = 0; t < CPUMOE_TIER_COUNT; ++t)
    if (kVariants[format][t]) m |= 1u << t;
  return m;
}

// name, banks, K multiple (H and I), router weight on input, modes (bit set), opt-in tiers (bit set), tiers auto
// picks only on AMD CPUs (bit set).
// fp8_block's amx kernel is opt-in: its tiles make a batch sharing experts cost ~1.2-1.5x one token, but it
// reads a lone token's weights at about half the avx512f kernel's rate (docs/formats/fp8_block.md), and a
// format's kernel may not switch with the batch (a token's result must not depend on its batch).
// q4_0's amx kernel (w4a8) is opt-in for the same reason (docs/formats/q4_0.md).
// fp8_block's avx512bf16 kernel is auto on AMD only: on Zen 4 it takes ~25-30% less time per step than avx512f
// (2 threads, from DRAM), on the H200 host's Xeon ~10-15% more at batch 1 (docs/formats/fp8_block.md).
const FormatInfo kFormats[CPUMOE_FMT_COUNT] = {
    {"bf16", 2, 1, true, 1u << CPUMOE_MODE_NATIVE, 0u, 0u},
    {"nvfp4", 6, 16, true, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
    {"mxfp4", 6, 32, false, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
    {"ds_fp4", 4, 128, false, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
    {"q4_0", 2, 32, true, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 1u << CPUMOE_TIER_AMX, 0u},
    {"fp8_block", 4, 1, true, 1u << CPUMOE_MODE_NATIVE, 1u << CPUMOE_TIER_AMX, 1u << CPUMOE_TIER_AVX512BF16},
    {"mxfp4_panel", 6, 32, false, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
    {"q4_0_x16", 2, 32, true, 1u << CPUMOE_MODE_W4A8, 0u, 0u},
    {"fp8_block_x16", 4, 16, true, 1u << CPUMOE_MODE_NATIVE, 0u, 0u},
    {"nvfp4_x16", 4, 16, true, 1u << CPUMOE_MODE_W4A8, 0u, 0u},
    {"ds_fp4_x16", 2, 128, false, 1u << CPUMOE_MODE_W4A8, 0u, 0u},
    {"bf16_x16", 2, 16, true, 1u << CPUMOE_MODE_NATIVE, 0u, 0u},
    {"mxfp4_x16", 4, 32, false, 1u << CPUMOE_MODE_W4A8, 0u, 0u},
    {"q8_0", 2, 32, true, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
    {"q4_k", 2, 256, true, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
    {"q6_k", 2, 256, true, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
    {"q4_k_x16", 2, 256, true, 1u << CPUMOE_MODE_W4A8, 0u, 0u},
    {"q8_0_x16", 2, 32, true, 1u << CPUMOE_MODE_W4A8, 0u, 0u},
    {"q5_k", 2, 256, true, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
    {"q6_k_x16", 2, 256, true, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
    {"q5_k_x16", 2, 256, true, (1u << CPUMOE_MODE_NATIVE) | (1u << CPUMOE_MODE_W4A8), 0u, 0u},
};

static const char* const kModeNames[CPUMOE_MODE_COUNT] = {"native", "w4a8"};
const char* mode_name(int mode) { return mode >= 0 && mode < CPUMOE_MODE_COUNT ? kModeNames[mode] : "invalid"; }

int32_t kernel_create(const cpumoe_params* p, int32_t cap, cpumoe_kernel** out, char* err, size_t errlen) {
  *out = nullptr;
#define FAIL(...) do { std::snprintf(err, errlen, __VA_ARGS__); return -1; } while (0)
  if (p->format < 0 || p->format >= CPUMOE_FMT_COUNT) FAIL("format id %d is not in [0, %d)", p->format, CPUMOE_FMT_COUNT);
  const FormatInfo& f = kFormats[p->format];
  if (p->act < 0 || p->act >= CPUMOE_ACT_COUNT) FAIL("activation id %d is not in [0, %d)", p->act, CPUMOE_ACT_COUNT);
  if (p->mode < 0 || p->mode >= CPUMOE_MODE_COUNT || !(f.modes & (1u << p->mode)))
    FAIL("format %s does not support mode %s", f.name, mode_name(p->mode));
  if (p->num_experts <= 0 || p->hidden <= 0 || p->inter <= 0)
    FAIL("E=%d, H=%d, I=%d must be positive", p->num_experts, p->hidden, p->inter);
  if (p->hidden % f.k_multiple || p->inter % f.k_multiple)
    FAIL("format %s needs H and I to be multiples of %d (got H=%d, I=%d)", f.name, f.k_multiple, p->hidden, p->inter);
  if (p->apply_router_weight_on_input && !f.input_weight)
    FAIL("format %s applies the router weight on the output; apply_router_weight_on_input is not supported", f.name);
  if (!(p->limit > 0.f)) FAIL("limit must be > 0 (use +inf for no clamp), got %g", (double)p->limit);
  if (!std::isfinite(p->alpha)) FAIL("alpha must be finite, got %g", (double)p->alpha);
  bool by_name = cap >= 0;  // a tier asked for by name may be an opt-in one; auto never picks those
  if (cap < 0) {
    by_name = env_tier_named();
    cap = env_tier_cap();
    if (cap < 0) {
      const char* v = std::getenv("CPUMOE_ISA");
      FAIL("CPUMOE_ISA=%s is not a tier; expected one of scalar, avx2, avxvnni, avx512f, avx512vnni, avx512bf16, amx, auto",
           v ? v : "");
    }
  }
  if (cap >= CPUMOE_TIER_COUNT) FAIL("tier cap %d is not in [0, %d)", cap, CPUMOE_TIER_COUNT);
  if (x16_prefetch() < 0)  // every format, as CPUMOE_ISA: a mistyped value fails where it is set, not only on AVX-512
    FAIL("%s", x16_prefetch_why());
  const unsigned usable = usable_tier_mask();
  cpumoe_kernel* k = new (std::nothrow) cpumoe_kernel();
  if (!k) FAIL("out of memory");
  for (int t = cap; t >= 0; --t) {
    const bool auto_skips = (f.opt_in >> t & 1u) || ((f.amd_auto >> t & 1u) && !cpu_is_amd());
    if (!(usable & (1u << t)) || !kVariants[p->format][t] || (!by_name && auto_skips)) continue;
    *k = cpumoe_kernel();
    k->struct_size = sizeof(cpumoe_kernel);
    k->params = *p;
    k->block_hint = 32;
    if (!kVariants[p->format][t](k)) continue;
    k->tier = t;
    std::snprintf(k->name_buf, sizeof k->name_buf, "%s%s", tier_name(t), p->mode == CPUMOE_MODE_W4A8 ? "+w4a8" : "");
    k->name = k->name_buf;
    *out = k;
    return 0;
  }
  delete k;
  FAIL("format %s has no kernel for mode %s at or below tier %s", f.name, mode_name(p->mode), tier_name(cap));
#undef FAIL
}

void kernel_destroy(cpumoe_kernel* k) {
  if (!k) return;
  std::free(k->state);
  delete k;
}

}  // namespace cpumoe

// ---- the dense bf16 linear (ABI 1.9): one init function per tier, no amx one (linear_bf16.cpp) ----
#define CPUMOE_LDECL(tag) bool cpumoe_init_linear_bf16_##tag(cpumoe_linear*);
CPUMOE_LDECL(scalar)
#ifdef CPUMOE_BUILT_avx2
CPUMOE_LDECL(avx2)
#define L_avx2 &cpumoe_init_linear_bf16_avx2
#else
#define L_avx2 nullptr
#endif
#ifdef CPUMOE_BUILT_avxvnni
CPUMOE_LDECL(avxvnni)
#define L_avxvnni &cpumoe_init_linear_bf16_avxvnni
#else
#define L_avxvnni nullptr
#endif
#ifdef CPUMOE_BUILT_avx512f
CPUMOE_LDECL(avx512f)
#define L_avx512f &cpumoe_init_linear_bf16_avx512f
#else
#define L_avx512f nullptr
#endif
#ifdef CPUMOE_BUILT_avx512vnni
CPUMOE_LDECL(avx512vnni)
#define L_avx512vnni &cpumoe_init_linear_bf16_avx512vnni
#else
#define L_avx512vnni nullptr
#endif
#ifdef CPUMOE_BUILT_avx512bf16
CPUMOE_LDECL(avx512bf16)
#define L_avx512bf16 &cpumoe_init_linear_bf16_avx512bf16
#else
#define L_avx512bf16 nullptr
#endif
// ---- decode attention (ABI 1.11): scalar, avx2 and avx512f of their own (attention_bf16.cpp; no amx object) ----
#define CPUMOE_ADECL(tag) bool cpumoe_init_attention_bf16_##tag(cpumoe_attention*);
CPUMOE_ADECL(scalar)
#ifdef CPUMOE_BUILT_avx2
CPUMOE_ADECL(avx2)
#define A_avx2 &cpumoe_init_attention_bf16_avx2
#else
#define A_avx2 nullptr
#endif
#ifdef CPUMOE_BUILT_avx512f
CPUMOE_ADECL(avx512f)
#define A_avx512f &cpumoe_init_attention_bf16_avx512f
#else
#define A_avx512f nullptr
#endif
namespace cpumoe {
namespace {
using LinearInit = bool (*)(cpumoe_linear*);
const LinearInit kLinear[CPUMOE_TIER_COUNT] = {&cpumoe_init_linear_bf16_scalar, L_avx2, L_avxvnni, L_avx512f,
                                               L_avx512vnni, L_avx512bf16, nullptr};
// The tiers between have nothing of their own (their init returns false, or no object: nullptr): the ladder goes on.
using AttentionInit = bool (*)(cpumoe_attention*);
const AttentionInit kAttention[CPUMOE_TIER_COUNT] = {&cpumoe_init_attention_bf16_scalar, A_avx2, nullptr, A_avx512f,
                                                     nullptr, nullptr, nullptr};

// A stateless kernel table (cpumoe_linear, cpumoe_attention) at the best usable tier <= cap whose init accepts it.
template <class K, class Init>
int32_t create_tiered(int32_t cap, const Init (&inits)[CPUMOE_TIER_COUNT], const char* what, K** out, char* err,
                      size_t errlen) {
  *out = nullptr;
  if (cap < 0) {
    cap = env_tier_cap();
    if (cap < 0) {
      const char* v = std::getenv("CPUMOE_ISA");
      std::snprintf(err, errlen, "CPUMOE_ISA=%s is not a tier; expected one of scalar, avx2, avxvnni, avx512f, "
                    "avx512vnni, avx512bf16, amx, auto", v ? v : "");
      return -1;
    }
  }
  if (cap >= CPUMOE_TIER_COUNT) {
    std::snprintf(err, errlen, "tier cap %d is not in [0, %d)", cap, CPUMOE_TIER_COUNT);
    return -1;
  }
  const unsigned usable = usable_tier_mask();
  K* k = new (std::nothrow) K();
  if (!k) {
    std::snprintf(err, errlen, "out of memory");
    return -1;
  }
  for (int t = cap; t >= 0; --t) {
    if (!(usable & (1u << t)) || !inits[t]) continue;
    *k = K();
    k->struct_size = sizeof(K);
    if (!inits[t](k)) continue;
    k->tier = t;
    std::snprintf(k->name_buf, sizeof k->name_buf, "%s", tier_name(t));
    k->name = k->name_buf;
    *out = k;
    return 0;
  }
  delete k;
  std::snprintf(err, errlen, "no %s kernel at or below tier %s", what, tier_name(cap));
  return -1;
}
}  // namespace

int32_t linear_create(int32_t cap, cpumoe_linear** out, char* err, size_t errlen) {
  return create_tiered(cap, kLinear, "dense bf16 linear", out, err, errlen);
}

int32_t attention_create(int32_t cap, cpumoe_attention** out, char* err, size_t errlen) {
  return create_tiered(cap, kAttention, "decode attention", out, err, errlen);
}

void attention_destroy(cpumoe_attention* k) { delete k; }

void linear_destroy(cpumoe_linear* k) { delete k; }

int32_t format_bank_count(int32_t format) {
  return format >= 0 && format < CPUMOE_FMT_COUNT ? kFormats[format].banks : -1;
}
}  // namespace cpumoe
