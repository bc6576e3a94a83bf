#include "omp_team.h"

#include <dlfcn.h>

#include <atomic>

namespace cpumoe_exec {
namespace {
struct Call {
  OmpTeam::Fn fn;
  void* ctx;
  int (*tid)();
  int team;
  std::atomic<int> entered{0};
  bool prompt = true;
};
void tramp(void* p) {
  auto* c = static_cast<Call*>(p);
  const int tid = c->tid();
  c->entered.fetch_add(1, std::memory_order_relaxed);
  c->fn(c->ctx, tid);
  // the caller's fn returns once y is complete: a thread not in yet did nothing, and the region's end waits for it
  if (tid == 0) c->prompt = c->entered.load(std::memory_order_relaxed) >= c->team;
}
std::atomic<const OmpTeam*> g_host{nullptr};
}  // namespace

const OmpTeam* OmpTeam::host() {
  if (const OmpTeam* t = g_host.load(std::memory_order_acquire)) return t;
  // RTLD_NOLOAD: only a runtime already in the process (a library of ours must not bring a second one in); the
  // handle stays open, so the runtime stays loaded while an executor may call it.
  void* h = dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (!h) return nullptr;
  auto* t = new OmpTeam;
  t->parallel_ = reinterpret_cast<decltype(t->parallel_)>(dlsym(h, "GOMP_parallel"));
  t->thread_num_ = reinterpret_cast<decltype(t->thread_num_)>(dlsym(h, "omp_get_thread_num"));
  if (!t->parallel_ || !t->thread_num_) {
    delete t;
    return nullptr;
  }
  const OmpTeam* none = nullptr;
  if (!g_host.compare_exchange_strong(none, t, std::memory_order_acq_rel)) {
    delete t;  // another thread resolved it first
    return none;
  }
  return t;
}

bool OmpTeam::run(Fn fn, void* ctx, int team) const {
  Call c{fn, ctx, thread_num_, team};
  parallel_(&tramp, &c, (unsigned)team, 0);
  return c.prompt;
}

}  // namespace cpumoe_exec
