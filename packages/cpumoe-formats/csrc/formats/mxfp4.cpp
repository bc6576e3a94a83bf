// Placeholder until the mxfp4 kernels land: no tier provides a kernel yet.
#include "../common.h"
bool CPUMOE_INIT_FN(mxfp4)(cpumoe_kernel*) { return false; }
