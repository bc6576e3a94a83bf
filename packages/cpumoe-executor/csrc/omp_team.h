// The host process's OpenMP team as the synchronous step's workers (Config::team_openmp). Where torch runs the rest
// of a model on the CPU, its OpenMP threads spin for ~12 ms after each parallel region (libgomp's default 300k
// pauses on the Zen 4 VM): a pool of our own on the same cores waits for them to yield (workers woke 390-650 us into
// a 760 us step there, 2 cores, 8-layer Qwen3-30B-shaped model). Run on the OpenMP team instead, the step starts on
// threads that are already spinning for work, and no second pool shares their cores.
// The runtime is the one the process already loaded (libgomp.so.1, which torch's wheels bundle), found by its
// soname without loading anything; its GOMP_parallel is the entry GCC emits for `#pragma omp parallel`.
// Threads: a team belongs to the thread that starts the region (libgomp keeps one per such thread), so a second
// thread calling in brings a team of its own; inside another parallel region the team is the caller alone
// (libgomp's nesting default). GNU libgomp does not survive fork(): a child's region waits for the parent's
// threads forever, so a forked child gets no team (host() says why).
#pragma once
#include <string>

namespace cpumoe_exec {

class OmpTeam {
 public:
  using Fn = void (*)(void* ctx, int tid);
  // The loaded libgomp's entry points, or nullptr with *why set: this process has not loaded libgomp.so.1, or it
  // is a fork of the one that loaded this library. Any thread; nothing is loaded by asking.
  static const OmpTeam* host(std::string* why = nullptr);
  // Runs fn(ctx, tid) on up to `team` threads of the calling thread's OpenMP team (tid 0: the caller) and returns
  // once every one has left fn. The runtime may give fewer threads (nested, OMP_THREAD_LIMIT, OMP_DYNAMIC):
  // every_tid makes the caller run the missing tids after its own (work split by tid); without it they do not run
  // (fn claims its work dynamically). An exception is caught on its thread and the first one rethrown here after
  // the region: none unwinds through libgomp's C frames. Returns whether every thread of the region had entered fn
  // by the time the caller's fn returned: false when one came late (its core taken by other work), which the caller
  // then waited for at the region's end.
  bool run(Fn fn, void* ctx, int team, bool every_tid) const;

 private:
  void (*parallel_)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num_)() = nullptr;
  int (*num_threads_)() = nullptr;
  friend struct OmpCall;
};

}  // namespace cpumoe_exec
