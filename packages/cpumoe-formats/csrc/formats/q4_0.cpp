// Placeholder until the q4_0 kernels land: no tier provides a kernel yet.
#include "../common.h"
bool CPUMOE_INIT_FN(q4_0)(cpumoe_kernel*) { return false; }
