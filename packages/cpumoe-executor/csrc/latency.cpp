// Latency probes for the doorbell bench (python -m cpumoe_executor.bench --doorbell):
// a native thread plays the GPU's part of protocol v1 and times each ring; a pure
// two-thread ping-pong gives this machine's floor in the same run; run_task is
// timed natively so "round trip minus task" carries no Python overhead.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "executor.h"
#include "gil.h"
#include "topology.h"

namespace py = pybind11;

namespace cpumoe_exec {
namespace {
uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// Rings n + warmup doorbells back to back (ring i: ids plan i % nplans copied into ids_dst,
// then done = 0, ready = tasks[i % ntasks], spin until done >= 1); returns the n timed round
// trips in ns, from the store of ready to the load that sees done. A ring not answered within
// timeout_s raises (never hangs).
std::vector<int64_t> ring_loop(uint64_t ready_a, uint64_t done_a, const std::vector<uint64_t>& tasks,
                               uint64_t ids_dst, uint64_t ids_plans, int nplans, int plan_ints, int n, int warmup,
                               double timeout_s, int core) {
  if (tasks.empty() || n < 1 || warmup < 0 || nplans < 0 || plan_ints < 0)
    throw std::invalid_argument("ring_loop: need tasks, n >= 1, warmup >= 0, nplans >= 0, plan_ints >= 0");
  auto* ready = (uint64_t*)(uintptr_t)ready_a;
  auto* done = (uint64_t*)(uintptr_t)done_a;
  std::vector<int64_t> out((size_t)n);
  bool timed_out = false;
  without_gil([&] {
    std::thread ringer([&] {  // its own thread, so it can be pinned apart from the caller
      if (core >= 0) pin_current_thread(core);
      const int64_t limit = (int64_t)(timeout_s * 1e9);
      for (int i = 0; i < n + warmup && !timed_out; ++i) {
        if (nplans > 0)
          std::memcpy((void*)(uintptr_t)ids_dst, (const int32_t*)(uintptr_t)ids_plans + (size_t)(i % nplans) * plan_ints,
                      (size_t)plan_ints * sizeof(int32_t));
        store(done, 0);
        const int64_t t0 = mono_ns();
        store(ready, tasks[(size_t)i % tasks.size()]);
        unsigned s = 0;
        while (load(done) < 1) {
          if ((++s & 4095) == 0 && mono_ns() - t0 > limit) {
            timed_out = true;
            break;
          }
          spin_pause(s);
        }
        if (i >= warmup) out[(size_t)(i - warmup)] = mono_ns() - t0;
      }
    });
    ringer.join();
  });
  if (timed_out) throw std::runtime_error("ring_loop: a doorbell was not answered within timeout_s");
  return out;
}

// Pure CPU ping-pong: thread A stores ping = i, thread B (pinned to echo_core when >= 0)
// spins until it sees i and stores pong = i; A times ping -> pong. The floor of any
// cross-thread handshake on these cores.
std::vector<int64_t> ping_pong(int n, int ring_core, int echo_core) {
  if (n < 1) throw std::invalid_argument("ping_pong: n >= 1");
  alignas(64) static uint64_t ping, pong;  // one line each (statics: aligned, zeroed)
  alignas(64) static char pad[64];
  (void)pad;
  store(&ping, 0), store(&pong, 0);
  std::vector<int64_t> out((size_t)n);
  without_gil([&] {
    const uint64_t stop = ~0ull;
    std::thread echo([&] {
      if (echo_core >= 0) pin_current_thread(echo_core);
      uint64_t seen = 0;
      for (unsigned s = 0;; ++s) {
        const uint64_t v = load(&ping);
        if (v == stop) return;
        if (v != seen) seen = v, store(&pong, v), s = 0;
        else spin_pause(s);
      }
    });
    std::thread ringer([&] {
      if (ring_core >= 0) pin_current_thread(ring_core);
      for (int i = 0; i < n + 100; ++i) {
        const uint64_t v = (uint64_t)i + 1;
        const int64_t t0 = mono_ns();
        store(&ping, v);
        for (unsigned s = 0; load(&pong) != v; ++s) spin_pause(s);
        if (i >= 100) out[(size_t)(i - 100)] = mono_ns() - t0;
      }
      store(&ping, stop);
    });
    ringer.join();
    echo.join();
  });
  return out;
}

// The same sequence of tasks and id plans as ring_loop, run with run_task on a thread pinned
// to `core` (the coordinator's, when >= 0) with no doorbell: the CPU task alone, ns each, with
// the same weights touched in the same order (so the same cache behaviour) and no Python.
// spin_core >= 0: meanwhile a thread spins there as ring_loop's ringer does (on a VM whose
// vCPUs share physical cores, a spinning neighbour slows the task; this keeps that out of
// "round trip - task alone").
std::vector<int64_t> task_loop(uint64_t handle, const std::vector<uint64_t>& tasks, uint64_t ids_dst,
                               uint64_t ids_plans, int nplans, int plan_ints, int n, int warmup, int core,
                               int spin_core) {
  if (!handle || tasks.empty() || n < 1 || warmup < 0 || nplans < 0 || plan_ints < 0)
    throw std::invalid_argument("task_loop: need an executor handle, tasks, n >= 1, warmup >= 0");
  auto* ex = (Executor*)(uintptr_t)handle;
  std::vector<int64_t> out((size_t)n);
  without_gil([&] {
    std::atomic<bool> stop{false};
    std::thread spinner([&] {
      if (spin_core < 0) return;
      pin_current_thread(spin_core);
      for (unsigned s = 0; !stop.load(std::memory_order_relaxed); ++s) spin_pause(s);
    });
    std::thread t([&] {
      if (core >= 0) pin_current_thread(core);
      for (int i = 0; i < n + warmup; ++i) {
        if (nplans > 0)
          std::memcpy((void*)(uintptr_t)ids_dst, (const int32_t*)(uintptr_t)ids_plans + (size_t)(i % nplans) * plan_ints,
                      (size_t)plan_ints * sizeof(int32_t));
        const int64_t t0 = mono_ns();
        ex->run_task(tasks[(size_t)i % tasks.size()]);
        if (i >= warmup) out[(size_t)(i - warmup)] = mono_ns() - t0;
      }
    });
    t.join();
    stop.store(true);
    spinner.join();
  });
  return out;
}
}  // namespace

void register_latency(py::module& m) {
  m.def("ring_loop", &ring_loop, py::arg("ready"), py::arg("done"), py::arg("tasks"), py::arg("ids_dst"),
        py::arg("ids_plans"), py::arg("nplans"), py::arg("plan_ints"), py::arg("n"), py::arg("warmup"),
        py::arg("timeout_s"), py::arg("core") = -1);
  m.def("ping_pong", &ping_pong, py::arg("n"), py::arg("ring_core") = -1, py::arg("echo_core") = -1);
  m.def("task_loop", &task_loop, py::arg("handle"), py::arg("tasks"), py::arg("ids_dst"), py::arg("ids_plans"),
        py::arg("nplans"), py::arg("plan_ints"), py::arg("n"), py::arg("warmup"), py::arg("core") = -1,
        py::arg("spin_core") = -1);
  // Team sizing knobs (Executor::set_team_unit): benches and tests, on an executor's handle.
  m.def("set_team_unit", [](uint64_t h, int64_t bytes) { ((Executor*)(uintptr_t)h)->set_team_unit(bytes); });
  m.def("team_unit", [](uint64_t h) { return ((Executor*)(uintptr_t)h)->team_unit(); });
  m.def("pool_sleepers", [](uint64_t h) { return ((Executor*)(uintptr_t)h)->pool_sleepers(); });
  m.def("team_size", [](uint64_t h, int layer, int nroutes, int ngroups) {
    auto* ex = (Executor*)(uintptr_t)h;
    if (layer < 0 || layer >= ex->config().num_layers) throw py::value_error("layer out of range");
    return ex->team_size(layer, nroutes, ngroups);
  });
}
}  // namespace cpumoe_exec
