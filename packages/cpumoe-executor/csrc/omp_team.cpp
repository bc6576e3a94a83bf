#include "omp_team.h"

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <exception>

// libgomp is not built with ThreadSanitizer: the region's start and end (its barrier) are made visible to it as
// release / acquire on the call, so TSan sees the step's real ordering and reports only races of ours.
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define OMP_TEAM_ACQUIRE(p) __tsan_acquire(p)
#define OMP_TEAM_RELEASE(p) __tsan_release(p)
#else
#define OMP_TEAM_ACQUIRE(p) (void)(p)
#define OMP_TEAM_RELEASE(p) (void)(p)
#endif

namespace cpumoe_exec {

struct OmpCall {
  const OmpTeam* rt;
  OmpTeam::Fn fn;
  void* ctx;
  int team;
  bool every_tid;
  std::atomic<int> entered{0};
  bool prompt = true;  // tid 0's
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first thread to set failed writes it; read after the region's end

  void fail() noexcept {
    if (!failed.exchange(true, std::memory_order_acq_rel)) error = std::current_exception();
  }
  static void tramp(void* p) noexcept {
    auto* c = static_cast<OmpCall*>(p);
    OMP_TEAM_ACQUIRE(c);
    const int tid = c->rt->thread_num_(), n = c->rt->num_threads_();
    c->entered.fetch_add(1, std::memory_order_relaxed);
    try {
      c->fn(c->ctx, tid);
    } catch (...) {
      c->fail();
    }
    if (tid == 0) {
      // a thread not in by now finds nothing left to claim, and the region's end waits for it
      c->prompt = c->entered.load(std::memory_order_relaxed) >= n;
      for (int t = n; c->every_tid && t < c->team && !c->failed.load(std::memory_order_relaxed); ++t) try {
          c->fn(c->ctx, t);
        } catch (...) {
          c->fail();
        }
    }
    OMP_TEAM_RELEASE(c);
  }
};

namespace {
std::atomic<const OmpTeam*> g_host{nullptr};
// A fork of the process this library was loaded in (the handler is registered at load, before any fork of ours).
std::atomic<bool> g_forked{false};
void on_fork_child() { g_forked.store(true, std::memory_order_relaxed); }
const int g_atfork = pthread_atfork(nullptr, nullptr, &on_fork_child);
}  // namespace

const OmpTeam* OmpTeam::host(std::string* why) {
  (void)g_atfork;
  if (g_forked.load(std::memory_order_relaxed)) {
    if (why)
      *why = "this process is a fork of the one that loaded the executor, and GNU libgomp does not survive fork() "
             "(a region would wait for the parent's threads forever); use team='pool' here, or start child "
             "processes with multiprocessing's 'spawn' or 'forkserver' method";
    return nullptr;
  }
  if (const OmpTeam* t = g_host.load(std::memory_order_acquire)) return t;
  // RTLD_NOLOAD: only a runtime already in the process (a library of ours must not bring a second one in); the
  // handle stays open, so the runtime stays loaded while an executor may call it.
  void* h = dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD);
  auto* t = new OmpTeam;
  if (h) {
    t->parallel_ = reinterpret_cast<decltype(t->parallel_)>(dlsym(h, "GOMP_parallel"));
    t->thread_num_ = reinterpret_cast<decltype(t->thread_num_)>(dlsym(h, "omp_get_thread_num"));
    t->num_threads_ = reinterpret_cast<decltype(t->num_threads_)>(dlsym(h, "omp_get_num_threads"));
  }
  if (!t->parallel_ || !t->thread_num_ || !t->num_threads_) {
    delete t;
    if (why)
      *why = h ? "the loaded libgomp.so.1 lacks GOMP_parallel / omp_get_thread_num / omp_get_num_threads; use "
                 "team='pool'"
               : "no OpenMP runtime (libgomp.so.1) is loaded in this process; import torch (or what brings the "
                 "runtime) first, or use team='pool'";
    return nullptr;
  }
  const OmpTeam* none = nullptr;
  if (!g_host.compare_exchange_strong(none, t, std::memory_order_acq_rel)) {
    delete t;  // another thread resolved it first
    return none;
  }
  return t;
}

bool OmpTeam::run(Fn fn, void* ctx, int team, bool every_tid) const {
  OmpCall c{this, fn, ctx, team, every_tid};
  OMP_TEAM_RELEASE(&c);
  parallel_(&OmpCall::tramp, &c, (unsigned)team, 0);
  OMP_TEAM_ACQUIRE(&c);
  if (c.error) std::rethrow_exception(c.error);
  return c.prompt;
}

}  // namespace cpumoe_exec
