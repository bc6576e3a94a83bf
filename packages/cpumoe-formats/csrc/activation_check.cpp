// Test hook: the kernels' activation epilogue, activate() (fp32 fast path) and activate_f64() (the reference's
// double formulas), each rounded to bf16 as every caller does, over arrays: tests/test_activation.py checks that
// the two always give the same bf16. Compiled once (baseline flags); the tiers compile the same inline code.
#include "common.h"
#include "registry.h"

namespace cpumoe {
void activate_bf16_both(int32_t act, float alpha, float limit, const float* gate, const float* up, size_t n,
                        uint16_t* fast, uint16_t* ref) {
  cpumoe_params p{};
  p.act = act, p.alpha = alpha, p.limit = limit;
  for (size_t i = 0; i < n; ++i) {
    fast[i] = CPUMOE_NS::f32_to_bf16(CPUMOE_NS::activate(p, gate[i], up[i]));
    ref[i] = CPUMOE_NS::f32_to_bf16(CPUMOE_NS::activate_f64(p, gate[i], up[i]));
  }
}
}  // namespace cpumoe
