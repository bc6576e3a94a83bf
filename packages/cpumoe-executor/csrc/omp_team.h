// The host process's OpenMP team as the synchronous step's workers (Config::team_openmp). Where torch runs the rest
// of a model on the CPU, its OpenMP threads spin for ~12 ms after each parallel region (libgomp's default 300k
// pauses on the Zen 4 VM): a pool of our own on the same cores waits for them to yield (workers woke 390-650 us into
// a 760 us step there, 2 cores, 8-layer Qwen3-30B-shaped model). Run on the OpenMP team instead, the step starts on
// threads that are already spinning for work, and no second pool shares their cores.
// The runtime is the one the process already loaded (libgomp.so.1, which torch's wheels bundle), found by its
// soname without loading anything; its GOMP_parallel is the entry GCC emits for `#pragma omp parallel`.
#pragma once

namespace cpumoe_exec {

class OmpTeam {
 public:
  using Fn = void (*)(void* ctx, int tid);
  // The loaded libgomp's entry points, or nullptr when this process has not loaded libgomp.so.1. Any thread.
  static const OmpTeam* host();
  // fn(ctx, tid) on `team` threads of the calling thread's OpenMP team (tid 0: the caller); returns when every one
  // has returned. Inside another parallel region the team is the caller alone (libgomp's nesting default). fn must
  // not throw. Returns whether every thread had entered fn by the time the caller's fn returned: false when one
  // came late (preempted by other work on its core), which the caller then waited for at the region's end.
  bool run(Fn fn, void* ctx, int team) const;

 private:
  void (*parallel_)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num_)() = nullptr;
};

}  // namespace cpumoe_exec
