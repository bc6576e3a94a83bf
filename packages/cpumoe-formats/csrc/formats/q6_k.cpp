// q6_k: kernels to come (registered so that the format table's ids are fixed).
#include "../common.h"
bool CPUMOE_INIT_FN(q6_k)(cpumoe_kernel*) { return false; }
