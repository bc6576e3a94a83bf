// without_gil(f): f() with the GIL released, through cpumoe-formats' NoGil (cpumoe_formats/nogil.h), which parks a
// thread that would take the GIL back while the interpreter finalizes instead of aborting the process. One
// mechanism for both packages' bindings; this is only the call-shaped wrapper the executor's bindings use.
#pragma once
#include <Python.h>

#include <utility>

#include "cpumoe_formats/nogil.h"

namespace cpumoe_exec {
template <class F>
auto without_gil(F&& f) -> decltype(f()) {
  cpumoe::NoGil released;
  return std::forward<F>(f)();
}
}  // namespace cpumoe_exec
