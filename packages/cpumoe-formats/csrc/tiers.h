// Tier tags and the variant table, shared by registry.cpp and dispatch.cpp.
#pragma once
#include "cpumoe_formats/abi.h"

#define CPUMOE_FOR_EACH_TIER(X) X(scalar) X(avx2) X(avxvnni) X(avx512f) X(avx512vnni) X(avx512bf16) X(amx)
#define CPUMOE_FOR_EACH_FORMAT(X) X(bf16) X(nvfp4) X(mxfp4) X(ds_fp4) X(q4_0) X(fp8_block)

namespace cpumoe {
// Tiers the CPU, the OS (XCR0) and this build can run, as a bit set.
unsigned usable_tier_mask();
int detected_tier();
// The CPU's vendor is AMD (or Hygon): some formats' auto tier choice depends on it (registry.cpp).
bool cpu_is_amd();
// CPUMOE_X16_PREFETCH (auto | on | off; unset or empty = auto), read once, at the first call (thread-safe): whether
// the avx512vnni tier's GGUF x16 kernels (q4_0_x16, q4_k_x16, q6_k_x16, q8_0_x16) run their software prefetch.
// auto: off on AMD (Zen 4 read more of the DRAM ceiling on its hardware prefetchers alone), on elsewhere (a Xeon
// host read less without it). on: 1, off: 0, an invalid value: -1 (kernel_create then fails naming the variable).
int x16_prefetch();
// Why x16_prefetch() chose as it did, e.g. "auto: AuthenticAMD" or "CPUMOE_X16_PREFETCH=on"; the error message when invalid.
const char* x16_prefetch_why();
// Parse CPUMOE_ISA; returns the cap, CPUMOE_TIER_COUNT-1 when unset, -1 when invalid.
int env_tier_cap();
// CPUMOE_ISA names a tier (not unset, empty or auto): opt-in tiers may then run.
bool env_tier_named();
const char* tier_name(int tier);
int tier_from_name(const char* name);
}  // namespace cpumoe
