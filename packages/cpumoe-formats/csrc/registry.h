#pragma once
#include <cstddef>
#include <cstdint>

#include "cpumoe_formats/abi.h"

namespace cpumoe {
struct FormatInfo {
  const char* name;
  int banks;
  int k_multiple;     // H and I must be multiples of this
  bool input_weight;  // supports apply_router_weight_on_input
  unsigned modes;     // bit set of cpumoe_mode
  unsigned opt_in;    // tiers (bit set) run only when asked for by name (isa argument or CPUMOE_ISA), never by auto
  unsigned amd_auto;  // tiers (bit set) auto picks only on AMD CPUs; elsewhere they are opt-in
};
extern const FormatInfo kFormats[CPUMOE_FMT_COUNT];
const char* mode_name(int mode);
// Tiers (bit set) at which this build has an init function for the format (whether or not this CPU can run them).
unsigned variant_tier_mask(int32_t format);
int32_t kernel_create(const cpumoe_params* p, int32_t cap, cpumoe_kernel** out, char* err, size_t errlen);
void kernel_destroy(cpumoe_kernel* k);
int32_t format_bank_count(int32_t format);
size_t step_scratch_bytes(const cpumoe_kernel* k, int32_t T, int32_t top_k);
int32_t moe_step(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t T, int32_t top_k, const uint16_t* x,
                 const int32_t* ids, const float* w, uint16_t* y, void* scratch, char* err, size_t errlen);
const cpumoe_formats_api* api_table();
// The dense bf16 linear (ABI 1.9) at the best tier <= cap (< 0: CPUMOE_ISA's cap).
int32_t linear_create(int32_t cap, cpumoe_linear** out, char* err, size_t errlen);
void linear_destroy(cpumoe_linear* k);
// Decode attention (ABI 1.11) at the best tier <= cap (< 0: CPUMOE_ISA's cap).
int32_t attention_create(int32_t cap, cpumoe_attention** out, char* err, size_t errlen);
void attention_destroy(cpumoe_attention* k);
double read_bandwidth_gbps(const void* p, size_t n, int reps);
uint64_t read_sum(const void* p, size_t n);
uint64_t peak_loop(int32_t kind, int32_t tier, uint64_t iters);  // peak.cpp
// activation_check.cpp: bf16(activate()) and bf16(activate_f64()) per element (test hook).
void activate_bf16_both(int32_t act, float alpha, float limit, const float* gate, const float* up, size_t n,
                        uint16_t* fast, uint16_t* ref);
}  // namespace cpumoe
