// Placeholder until the fp8_block kernels land: no tier provides a kernel yet.
#include "../common.h"
bool CPUMOE_INIT_FN(fp8_block)(cpumoe_kernel*) { return false; }
