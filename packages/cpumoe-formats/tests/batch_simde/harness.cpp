// ctypes entry for check.py: one whole MoE step (csrc/step.cpp, the package's own step) through the kernel
// that a given format's init installs at a given tier, where the AVX-512 / VNNI tiers were compiled against
// SIMDe (see run.sh), so those kernels run on a CPU without them. The registry / dispatch pieces step.cpp
// links against are stubbed: the tier is chosen by name here, never detected.
#include <cstring>
#include <vector>

#include "../../csrc/step.cpp"

#define BK_DECL(f, t) extern "C++" bool cpumoe_init_##f##_##t(cpumoe_kernel*);
#define BK_TIERS(f) BK_DECL(f, scalar) BK_DECL(f, avx2) BK_DECL(f, avxvnni) BK_DECL(f, avx512f) BK_DECL(f, avx512vnni) \
  BK_DECL(f, avx512bf16)
BK_TIERS(bf16) BK_TIERS(fp8_block) BK_TIERS(nvfp4) BK_TIERS(ds_fp4) BK_TIERS(q4_0) BK_TIERS(nvfp4_x16)
BK_DECL(bf16, amx) BK_DECL(fp8_block, amx) BK_DECL(q4_0, amx)  // amx_emu.h

namespace cpumoe {
unsigned usable_tier_mask() { return 3; }
int detected_tier() { return 1; }
int env_tier_cap() { return 1; }
const char* tier_name(int) { return "simde"; }
uint64_t peak_loop(int32_t, int32_t, uint64_t) { return 0; }  // step.cpp's API table (ABI 1.6): "no such loop here"
int32_t kernel_create(const cpumoe_params*, int32_t, cpumoe_kernel**, char*, size_t) { return -1; }
void kernel_destroy(cpumoe_kernel*) {}
int32_t format_bank_count(int32_t) { return 0; }
}  // namespace cpumoe

typedef bool (*Init)(cpumoe_kernel*);
struct Entry {
  int format;
  Init init[7];
};
#define BK_ROW(id, f, amx) {id, {cpumoe_init_##f##_scalar, cpumoe_init_##f##_avx2, cpumoe_init_##f##_avxvnni, \
  cpumoe_init_##f##_avx512f, cpumoe_init_##f##_avx512vnni, cpumoe_init_##f##_avx512bf16, amx}}
#define BK_ROW6(id, f) BK_ROW(id, f, nullptr)
static const Entry kEntries[] = {BK_ROW(CPUMOE_FMT_BF16, bf16, cpumoe_init_bf16_amx), BK_ROW(CPUMOE_FMT_FP8_BLOCK, fp8_block, cpumoe_init_fp8_block_amx),
                                 BK_ROW6(CPUMOE_FMT_NVFP4, nvfp4), BK_ROW6(CPUMOE_FMT_DS_FP4, ds_fp4),
                                 BK_ROW(CPUMOE_FMT_Q4_0, q4_0, cpumoe_init_q4_0_amx),
                                 BK_ROW6(CPUMOE_FMT_NVFP4_X16, nvfp4_x16)};

// Returns 0, -2 when the format has no kernel of its own at `tier` for the mode, -1 on a step error.
extern "C" __attribute__((visibility("default"))) int bk_step(const cpumoe_params* p, int tier, int block_hint,
                                                                const cpumoe_bank* banks, int T, int top_k,
                                                                const uint16_t* x, const int32_t* ids, const float* w,
                                                                uint16_t* y) {
  for (const Entry& e : kEntries) {
    if (e.format != p->format) continue;
    cpumoe_kernel k{};
    k.struct_size = sizeof k;
    k.params = *p;
    k.block_hint = block_hint;
    if (!e.init[tier] || !e.init[tier](&k)) return -2;
    std::vector<char> scratch(cpumoe::step_scratch_bytes(&k, T, top_k));
    char err[256];
    const int rc = cpumoe::moe_step(&k, banks, T, top_k, x, ids, w, y, scratch.data(), err, sizeof err);
    std::free(k.state);
    return rc;
  }
  return -1;
}
