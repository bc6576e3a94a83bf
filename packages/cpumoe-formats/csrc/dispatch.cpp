// Run-time ISA detection: CPUID feature bits AND the OS's XCR0 state
// (a CPU with AVX-512 under an OS that does not save ZMM state must not run it),
// AND what this build compiled (CPUMOE_BUILT_<tag> from hatch_build.py).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tiers.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace cpumoe {
namespace {
struct Features {
  bool avx2 = false, avxvnni = false, avx512 = false, avx512vnni = false, avx512bf16 = false, amx = false;
};

// Linux hands out AMX tile data state per process, on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); without it the first tile instruction is SIGILL. Asked once, at detection.
bool os_grants_amx() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) return false;
  unsigned long long perm = 0;
  return syscall(SYS_arch_prctl, kGetXcompPerm, &perm) == 0 && (perm >> kXtiledata & 1);
#else
  return false;
#endif
}

Features probe() {
  Features f;
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  unsigned xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool os_ymm = (xlo & 0x6u) == 0x6u;             // SSE + AVX state
  const bool os_zmm = os_ymm && (xlo & 0xE0u) == 0xE0u;  // opmask, ZMM_Hi256, Hi16_ZMM
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5), bmi1 = b & (1u << 3), bmi2 = b & (1u << 8);
  const bool f512 = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  const bool vnni512 = c & (1u << 11), vbmi = c & (1u << 1);
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24), amx_int8 = d & (1u << 25);
  const bool os_tiles = (xlo & (3u << 17)) == (3u << 17);  // XTILECFG + XTILEDATA enabled in XCR0
  unsigned a1 = 0, b1, c1, d1;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  f.avx2 = os_ymm && avx2 && fma && f16c && bmi1 && bmi2;
  f.avxvnni = f.avx2 && (a1 & (1u << 4));
  f.avx512 = f.avx2 && os_zmm && f512 && dq && bw && vl;
  f.avx512vnni = f.avx512 && vnni512;
  // + AVX512-VBMI (fp8_block's byte-table decode, its avx512bf16 and amx kernels): every BF16 CPU but Cooper Lake
  f.avx512bf16 = f.avx512vnni && (a1 & (1u << 5)) && vbmi;
  // (AMX-INT8: q4_0's tile kernel; every AMX CPU so far has it)
  f.amx = f.avx512bf16 && amx_tile && amx_bf16 && amx_int8 && os_tiles && os_grants_amx();
#endif
  return f;
}

unsigned built_mask() {
  unsigned m = 1u << CPUMOE_TIER_SCALAR;
#ifdef CPUMOE_BUILT_avx2
  m |= 1u << CPUMOE_TIER_AVX2;
#endif
#ifdef CPUMOE_BUILT_avxvnni
  m |= 1u << CPUMOE_TIER_AVXVNNI;
#endif
#ifdef CPUMOE_BUILT_avx512f
  m |= 1u << CPUMOE_TIER_AVX512F;
#endif
#ifdef CPUMOE_BUILT_avx512vnni
  m |= 1u << CPUMOE_TIER_AVX512VNNI;
#endif
#ifdef CPUMOE_BUILT_avx512bf16
  m |= 1u << CPUMOE_TIER_AVX512BF16;
#endif
#ifdef CPUMOE_BUILT_amx
  m |= 1u << CPUMOE_TIER_AMX;
#endif
  return m;
}

const char* const kNames[CPUMOE_TIER_COUNT] = {"scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512bf16", "amx"};
}  // namespace

// The CPUID vendor string ("AuthenticAMD", "GenuineIntel", ...); "unknown" off x86 or without leaf 0.
static const char* cpu_vendor() {
  static const struct V { char s[13] = "unknown"; } vendor = [] {
    V v;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d))
      std::memcpy(v.s, &b, 4), std::memcpy(v.s + 4, &d, 4), std::memcpy(v.s + 8, &c, 4), v.s[12] = 0;
#endif
    return v;
  }();
  return vendor.s;
}

bool cpu_is_amd() {
  static const bool amd = !std::strcmp(cpu_vendor(), "AuthenticAMD") || !std::strcmp(cpu_vendor(), "HygonGenuine");
  return amd;
}

namespace {
struct X16Prefetch {
  int on;
  char why[192];
};
// A function-local static: the variable is read once, at the first call, whichever thread makes it. auto: off on AMD
// (Zen 4, 2 threads, q8_0_x16 batch 1 from DRAM: 94% of the read ceiling with it, 100% without), on elsewhere (a Xeon
// host, 15 threads: q4_k_x16 batch 1 from DRAM 195 us a step with it, 218 without).
const X16Prefetch& x16_prefetch_choice() {
  static const X16Prefetch c = [] {
    X16Prefetch r{};
    const char* v = std::getenv("CPUMOE_X16_PREFETCH");
    if (!v || !*v || !std::strcmp(v, "auto")) {
      r.on = cpu_is_amd() ? 0 : 1;
      std::snprintf(r.why, sizeof r.why, "auto: %s", cpu_vendor());
    } else if (!std::strcmp(v, "on") || !std::strcmp(v, "off")) {
      r.on = v[1] == 'n';
      std::snprintf(r.why, sizeof r.why, "CPUMOE_X16_PREFETCH=%s", v);
    } else {
      r.on = -1;  // the message kernel creation (registry.cpp) and cf.x16_prefetch() raise
      std::snprintf(r.why, sizeof r.why, "CPUMOE_X16_PREFETCH=%.100s is not valid; expected one of auto, on, off", v);
    }
    return r;
  }();
  return c;
}
}  // namespace

int x16_prefetch() { return x16_prefetch_choice().on; }
const char* x16_prefetch_why() { return x16_prefetch_choice().why; }

unsigned usable_tier_mask() {
  static const unsigned mask = [] {
    Features f = probe();
    unsigned m = 1u << CPUMOE_TIER_SCALAR;
    if (f.avx2) m |= 1u << CPUMOE_TIER_AVX2;
    if (f.avxvnni) m |= 1u << CPUMOE_TIER_AVXVNNI;
    if (f.avx512) m |= 1u << CPUMOE_TIER_AVX512F;
    if (f.avx512vnni) m |= 1u << CPUMOE_TIER_AVX512VNNI;
    if (f.avx512bf16) m |= 1u << CPUMOE_TIER_AVX512BF16;
    if (f.amx) m |= 1u << CPUMOE_TIER_AMX;
    return m & built_mask();
  }();
  return mask;
}

int detected_tier() {
  unsigned m = usable_tier_mask();
  for (int t = CPUMOE_TIER_COUNT - 1; t > 0; --t)
    if (m & (1u << t)) return t;
  return CPUMOE_TIER_SCALAR;
}

const char* tier_name(int tier) { return tier >= 0 && tier < CPUMOE_TIER_COUNT ? kNames[tier] : "invalid"; }

int tier_from_name(const char* name) {
  for (int t = 0; t < CPUMOE_TIER_COUNT; ++t)
    if (std::strcmp(name, kNames[t]) == 0) return t;
  if (std::strcmp(name, "avx512") == 0) return CPUMOE_TIER_AVX512F;  // reference executor's spelling
  return -1;
}

// CPUMOE_ISA naming a tier (not unset, empty or "auto"), else nullptr.
static const char* env_isa_named() {
  const char* v = std::getenv("CPUMOE_ISA");
  return v && *v && std::strcmp(v, "auto") != 0 ? v : nullptr;
}
bool env_tier_named() { return env_isa_named() != nullptr; }
int env_tier_cap() {
  const char* v = env_isa_named();
  return v ? tier_from_name(v) : CPUMOE_TIER_COUNT - 1;
}
}  // namespace cpumoe
