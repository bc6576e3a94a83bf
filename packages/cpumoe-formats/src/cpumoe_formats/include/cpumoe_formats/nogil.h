/* Releasing the GIL around native work in a Python extension, safe when the interpreter exits meanwhile.
 *
 * Header-only C++ (needs Python.h first); for the bindings of cpumoe-formats and of packages built against it.
 *
 * Why not pybind11's gil_scoped_release: CPython 3.11-3.13 ends a thread that re-takes the GIL after
 * finalization began (a daemon thread still inside a native call when the interpreter exits) with
 * pthread_exit(), which unwinds the thread's stack by a forced unwind (abi::__forced_unwind). gil_scoped_release
 * re-takes the GIL in its destructor, which is noexcept: the unwind reaches the noexcept boundary and the process
 * aborts with "terminate called without an active exception". numpy's C loops have no such boundary, so they exit.
 * cpumoe::NoGil re-takes the GIL in a function that catches the forced unwind and parks the thread for good
 * instead: it may not run Python again, it holds no lock (CPython drops the GIL before pthread_exit), and the
 * process's exit ends it. Nothing is unwound, so no destructor runs without the GIL. */
#ifndef CPUMOE_FORMATS_NOGIL_H
#define CPUMOE_FORMATS_NOGIL_H
#include <cxxabi.h>
#include <unistd.h>

namespace cpumoe {

/* Never returns: the calling thread sleeps until the process ends. */
[[noreturn]] inline void park_thread_forever() noexcept {
  for (;;) ::pause();
}

/* Re-take the GIL released by PyEval_SaveThread(); parks the thread if the interpreter is finalizing. */
inline void restore_gil(PyThreadState* ts) noexcept {
  try {
    PyEval_RestoreThread(ts);
  } catch (abi::__forced_unwind&) {
    park_thread_forever();  // never leaves the handler: the forced unwind is neither swallowed nor rethrown
  }
}

/* RAII: the GIL is released for the object's scope. Use for every binding that releases the GIL. */
class NoGil {
 public:
  NoGil() : ts_(PyEval_SaveThread()) {}
  ~NoGil() { restore_gil(ts_); }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  PyThreadState* ts_;
};

}  // namespace cpumoe
#endif
