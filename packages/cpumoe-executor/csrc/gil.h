// Native work with the GIL released, for every binding that releases it.
//
// CPython 3.8 to 3.13 ends a thread that takes the GIL back while the interpreter finalizes with pthread_exit(),
// a forced unwind. Through pybind11's gil_scoped_release (its destructor is noexcept) that aborts the process
// ("terminate called without an active exception": a daemon thread in decode as the interpreter exits), and
// through pybind11's frames it would drop Python references without the GIL. Such a thread parks here instead,
// holding no lock: the process is exiting and takes it down. (3.14 hangs such a thread itself.)
#pragma once
#include <Python.h>
#include <cxxabi.h>

#include <chrono>
#include <exception>
#include <thread>
#include <type_traits>
#include <utility>

namespace cpumoe_exec {

[[noreturn]] inline void park_thread() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

inline void take_gil_back(PyThreadState* ts) {
  if (interpreter_finalizing()) park_thread();
  try {
    PyEval_RestoreThread(ts);
  } catch (abi::__forced_unwind&) {  // finalization began after the check: the unwind stops here, never returns
    park_thread();
  }
}

// f() with the GIL released; its exception, if any, is rethrown once the GIL is back.
template <class F>
auto without_gil(F&& f) -> decltype(f()) {
  using R = decltype(f());
  PyThreadState* ts = PyEval_SaveThread();
  std::exception_ptr err;
  if constexpr (std::is_void_v<R>) {
    try {
      std::forward<F>(f)();
    } catch (...) {
      err = std::current_exception();
    }
    take_gil_back(ts);
    if (err) std::rethrow_exception(err);
  } else {
    R r{};
    try {
      r = std::forward<F>(f)();
    } catch (...) {
      err = std::current_exception();
    }
    take_gil_back(ts);
    if (err) std::rethrow_exception(err);
    return r;
  }
}
}  // namespace cpumoe_exec
