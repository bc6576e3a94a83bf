#include "omp_team.h"

#include <dlfcn.h>

#include <atomic>

namespace cpumoe_exec {
namespace {
struct Call {
  OmpTeam::Fn fn;
  void* ctx;
  int (*tid)();
};
void tramp(void* p) {
  const auto* c = static_cast<const Call*>(p);
  c->fn(c->ctx, c->tid());
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

void OmpTeam::run(Fn fn, void* ctx, int team) const {
  Call c{fn, ctx, thread_num_};
  parallel_(&tramp, &c, (unsigned)team, 0);
}

}  // namespace cpumoe_exec
