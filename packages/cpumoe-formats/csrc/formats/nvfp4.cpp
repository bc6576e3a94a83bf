// Placeholder until the nvfp4 kernels land: no tier provides a kernel yet.
#include "../common.h"
bool CPUMOE_INIT_FN(nvfp4)(cpumoe_kernel*) { return false; }
