// The executor's exported C ABI table (cpumoe_executor/abi.h).
#include "capi.h"

#include "executor.h"

namespace cpumoe_exec {
namespace {
Executor* X(cpumoe_executor* e) { return reinterpret_cast<Executor*>(e); }
cpumoe_iob_header* api_iob(cpumoe_executor* e) { return X(e)->iob(); }
cpumoe_hostfn_arg* api_arg(cpumoe_executor* e, uint32_t layer, uint32_t T) { return X(e)->hostfn_arg(layer, T); }
void api_submit(void* a) {
  auto* arg = static_cast<cpumoe_hostfn_arg*>(a);
  X(arg->exec)->hostfn_submit(arg->task);
}
void api_wait(void* a) { X(static_cast<cpumoe_hostfn_arg*>(a)->exec)->hostfn_wait(); }
int32_t api_run_task(cpumoe_executor* e, uint64_t task) { return X(e)->run_task(task); }
#ifndef CPUMOE_EXEC_BUILD_INFO
#define CPUMOE_EXEC_BUILD_INFO "unknown build"
#endif
const cpumoe_executor_api kApi = {CPUMOE_EXECUTOR_ABI_MAJOR, CPUMOE_EXECUTOR_ABI_MINOR, sizeof(cpumoe_executor_api),
                                  CPUMOE_PROTOCOL_VERSION,   CPUMOE_EXEC_BUILD_INFO,   &api_iob,
                                  &api_arg,                  &api_submit,              &api_wait,
                                  &api_run_task};
}  // namespace
const cpumoe_executor_api* executor_api() { return &kApi; }
}  // namespace cpumoe_exec
