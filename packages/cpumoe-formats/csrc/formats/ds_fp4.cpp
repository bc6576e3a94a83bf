// Placeholder until the ds_fp4 kernels land: no tier provides a kernel yet.
#include "../common.h"
bool CPUMOE_INIT_FN(ds_fp4)(cpumoe_kernel*) { return false; }
