// Start-up probes (docs/architecture.md, rule 4: fail closed). Nothing is decided by
// the runtime's version number: a capture is made, instantiated and replayed.
//  1. native detection: one hipStreamWriteValue64 of a scratch signal word on a
//     capturing stream (never a wait: before HIP 10 it would block the real
//     queue). Word changed right after EndCapture => executed eagerly, not
//     recorded; unchanged and then set by a replay => recorded; neither => dropped.
//  2. the copy step under the chosen mechanism: eager, then capture,
//     instantiate and 3 replays with changed inputs against the running
//     coordinator, each compared bit for bit with the executor's synchronous
//     run_task of the same inputs, and the doorbells counted.
// Every wait is bounded; every resource is released on every exit; the errors
// the probe caused are consumed (ErrorScope), an earlier one is raised.
#include "probe.h"

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "gpusync/backend_common.h"

namespace gpusync {
namespace {
constexpr uint64_t kMagic = 0x5049484356545343ull;  // "CSTVCHIP": never a task or a done value

using Inputs = common::ProbeInputs;

struct Task {
  uint32_t layer, T;
  uint64_t x, ids, w, y;
  Inputs in;
  std::vector<uint16_t> want;
};

// Everything a probe stage creates, released on every exit.
struct Scratch {
  Iob& b;
  hipStream_t s = nullptr;
  hipGraph_t graph = nullptr;
  hipGraphExec_t exec = nullptr;
  uint64_t mem = 0;
  bool capturing = false;
  explicit Scratch(Iob& b_) : b(b_) {}
  const Runtime& rt() const { return b.rt(); }
  void end_capture() {
    if (!capturing) return;
    capturing = false;
    hipGraph_t g = nullptr;
    rt().hipStreamEndCapture(s, &g);  // its error (e.g. unjoined) is the stage's, consumed by the scope
    if (g) rt().hipGraphDestroy(g);
  }
  ~Scratch() {
    end_capture();
    if (exec) rt().hipGraphExecDestroy(exec);
    if (graph) rt().hipGraphDestroy(graph);
    if (s) {
      b.sync(s, 5.0);
      rt().hipStreamDestroy(s);
    }
    if (mem) b.dev().free((void*)(uintptr_t)mem);
    // Leave the words idle for the next stage: no doorbell pending, nothing to wait for.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (__atomic_load_n(b.ready_word(), __ATOMIC_ACQUIRE) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    uint64_t zero = CPUMOE_DONE_PENDING;
    __atomic_compare_exchange_n(b.done_word(), &zero, CPUMOE_DONE_COMPLETE, false, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
  }
  void stream() { rt().check(rt().hipStreamCreateWithFlags(&s, hipStreamNonBlocking), "hipStreamCreateWithFlags"); }
  void begin() {
    rt().check(rt().hipStreamBeginCapture(s, hipStreamCaptureModeThreadLocal), "hipStreamBeginCapture");
    capturing = true;
  }
  void end() {
    capturing = false;
    rt().check(rt().hipStreamEndCapture(s, &graph), "hipStreamEndCapture");
    if (!graph) throw Error(GPUSYNC_E_INTERNAL, "hipStreamEndCapture returned no graph");
  }
  void instantiate() {
    rt().check(rt().hipGraphInstantiate(&exec, graph, nullptr, nullptr, 0), "hipGraphInstantiate");
  }
  void bounded(const char* what, double timeout_s) {
    if (!b.sync(s, timeout_s))
      throw Error(GPUSYNC_E_TIMEOUT, std::string(what) + ": no completion within " + std::to_string(timeout_s) +
                                         " s (is the coordinator running on the signal words? the stream was "
                                         "released)");
  }
};

std::string node_summary(const Runtime& rt, hipGraph_t g) {
  if (!rt.hipGraphGetNodes || !rt.hipGraphNodeGetType) return "a graph (node types not inspectable)";
  size_t n = 0;
  if (rt.hipGraphGetNodes(g, nullptr, &n) != hipSuccess) return "a graph (node count unavailable)";
  std::vector<hipGraphNode_t> nodes(n);
  rt.hipGraphGetNodes(g, nodes.data(), &n);
  int counts[16] = {0};
  for (auto* nd : nodes) {
    hipGraphNodeType t = -1;
    rt.hipGraphNodeGetType(nd, &t);
    ++counts[(t >= 0 && t < 15) ? t : 15];
  }
  // AMD numbering: 2 memcpy, 4 host, 8 event record; batch memop nodes have a
  // runtime-specific number (15 = other here).
  return std::to_string(n) + " nodes (" + std::to_string(counts[hipGraphNodeTypeMemcpy]) + " memcpy, " +
         std::to_string(counts[hipGraphNodeTypeEventRecord]) + " event record, " +
         std::to_string(counts[hipGraphNodeTypeHost]) + " host, " +
         std::to_string(n - counts[hipGraphNodeTypeMemcpy] - counts[hipGraphNodeTypeEventRecord] -
                        counts[hipGraphNodeTypeHost]) +
         " memop/other)";
}

// 1. Does a stream memop on a capturing stream get recorded?
bool detect_native(Iob& b, double timeout_s, std::string* why) {
  const Runtime& rt = b.rt();
  Scratch sc(b);
  uint64_t* word = b.scratch_word();
  try {
    sc.stream();
    __atomic_store_n(word, 0, __ATOMIC_RELEASE);
    sc.begin();
    const hipError_t rc = rt.hipStreamWriteValue64(sc.s, word, kMagic, hipStreamWriteValueDefault);
    sc.end();
    sc.bounded("native detection", timeout_s);  // lets an eagerly executed write land
    if (rc != hipSuccess) {
      *why = "hipStreamWriteValue64 on a capturing stream failed: " + rt.name(rc);
      return false;
    }
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == kMagic) {
      *why = "stream memops run at once on a capturing stream and are not recorded (ROCm before HIP 10)";
      return false;
    }
    sc.instantiate();
    rt.check(rt.hipGraphLaunch(sc.exec, sc.s), "hipGraphLaunch");
    sc.bounded("native detection replay", timeout_s);
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != kMagic) {
      *why = "a stream memop on a capturing stream was neither executed nor replayed (silently dropped)";
      return false;
    }
    *why = "stream memops are recorded under capture";
    return true;
  } catch (const std::exception& e) {
    *why = std::string("native detection failed: ") + e.what();
    return false;
  }
}

// 2. The copy step under the Iob's current mechanism.
ProbeResult probe_copy(Iob& b, int path, double timeout_s, bool eager_only) {
  ProbeResult res;
  const Runtime& rt = b.rt();
  const cpumoe_iob_header* h = b.hdr();
  const size_t H = h->hidden, K = h->top_k;
  const uint32_t L = h->num_layers, maxT = h->max_tokens;
  Scratch sc(b);
  std::string stage = "setup";
  std::vector<Task> tasks = {{0, 1, 0, 0, 0, 0, {}, {}}, {L - 1, maxT < 3 ? maxT : 3, 0, 0, 0, 0, {}, {}}};
  const bool was_safe = b.replay_safe(path);
  try {
    sc.stream();
    const size_t xb = (maxT * H * 2 + 255) / 256 * 256, rb = (maxT * K * 4 + 255) / 256 * 256;
    const size_t per = 2 * xb + 2 * rb;
    sc.mem = b.dev().alloc(per * tasks.size());
    for (size_t i = 0; i < tasks.size(); ++i) {
      const uint64_t p = sc.mem + per * i;
      tasks[i].x = p, tasks[i].y = p + xb, tasks[i].ids = p + 2 * xb, tasks[i].w = p + 2 * xb + rb;
    }
    auto h2d = [&](uint64_t dst, const void* src, size_t n, const char* what) {
      rt.check(rt.hipMemcpyAsync((void*)(uintptr_t)dst, src, n, hipMemcpyHostToDevice, sc.s), what);
    };
    // Fresh inputs on the device, the CPU's synchronous answer, poisoned outputs.
    auto prepare = [&](uint32_t seed) {
      const std::vector<uint16_t> poison(maxT * H, 0x7FC1);  // quiet NaN: never a CPU result
      for (size_t i = 0; i < tasks.size(); ++i) {
        Task& t = tasks[i];
        t.in = common::make_probe_inputs(seed * 7 + (uint32_t)i, t.T, H, K);
        std::memcpy(b.host(h->x_off), t.in.x.data(), t.T * H * 2);
        std::memcpy(b.host(h->ids_off), t.in.ids.data(), t.T * K * 4);
        std::memcpy(b.host(h->w_off), t.in.w.data(), t.T * K * 4);
        const int32_t rc = b.exec_api()->run_task(b.exec(), CPUMOE_TASK(t.layer, t.T));
        if (rc) throw Error(GPUSYNC_E_INTERNAL, "executor run_task failed with code " + std::to_string(rc));
        t.want.assign((uint16_t*)b.host(h->y_off), (uint16_t*)b.host(h->y_off) + t.T * H);
        h2d(t.x, t.in.x.data(), t.T * H * 2, "hipMemcpyAsync(x)");
        h2d(t.ids, t.in.ids.data(), t.T * K * 4, "hipMemcpyAsync(ids)");
        h2d(t.w, t.in.w.data(), t.T * K * 4, "hipMemcpyAsync(w)");
        h2d(t.y, poison.data(), t.T * H * 2, "hipMemcpyAsync(y poison)");
      }
      // Stale block contents must not pass for a result either.
      std::memcpy(b.host(h->x_off), poison.data(), maxT * H * 2);
      std::memcpy(b.host(h->y_off), poison.data(), maxT * H * 2);
      sc.bounded("input upload", timeout_s);
    };
    auto compare = [&](const char* when) {
      for (const Task& t : tasks) {
        std::vector<uint16_t> got(t.T * H);
        rt.check(rt.hipMemcpyAsync(got.data(), (const void*)(uintptr_t)t.y, t.T * H * 2, hipMemcpyDeviceToHost,
                                   sc.s),
                 "hipMemcpyAsync(y)");
        sc.bounded("output download", timeout_s);
        for (size_t j = 0; j < got.size(); ++j)
          if (got[j] != t.want[j])
            throw Error(GPUSYNC_E_MISMATCH, std::string(when) + ": layer " + std::to_string(t.layer) + " T=" +
                                                std::to_string(t.T) + " element " + std::to_string(j) +
                                                " differs from the synchronous CPU result");
      }
    };
    auto enqueue = [&] {
      for (const Task& t : tasks) b.step(path, sc.s, t.layer, t.T, t.x, t.ids, t.w, t.y);
    };

    stage = "eager";
    prepare(1);
    enqueue();
    sc.bounded("eager step", timeout_s);
    compare("eager");
    res.eager = true;
    if (eager_only) {
      res.report = "eager ok";
      return res;
    }
    stage = "capture";
    b.set_replay_safe(path, true);  // lets step() record into this probe's capture
    sc.begin();
    enqueue();
    sc.end();
    b.set_replay_safe(path, was_safe);
    const std::string shape = node_summary(rt, sc.graph);
    stage = "instantiate";
    sc.instantiate();
    stage = "replay";
    const int replays = 3;
    for (int r = 0; r < replays; ++r) {
      prepare(100 + r);  // changed inputs: a graph that kept stale data fails here
      const uint64_t served0 = __atomic_load_n(&b.hdr()->served, __ATOMIC_ACQUIRE);
      rt.check(rt.hipGraphLaunch(sc.exec, sc.s), "hipGraphLaunch");
      sc.bounded("graph replay", timeout_s);
      compare("replay");
      const uint64_t served = __atomic_load_n(&b.hdr()->served, __ATOMIC_ACQUIRE) - served0;
      if (served != tasks.size())
        throw Error(GPUSYNC_E_MISMATCH, "replay served " + std::to_string(served) + " doorbells, expected " +
                                            std::to_string(tasks.size()));
    }
    res.safe = true;
    res.report = "eager ok; captured " + shape + "; " + std::to_string(replays) +
                 " replays with changed inputs bit-identical to the synchronous CPU result";
  } catch (const std::exception& e) {
    b.set_replay_safe(path, was_safe);
    res.safe = false;
    res.report = "failed at " + stage + ": " + e.what();
  }
  return res;
}
}  // namespace

ProbeResult probe(Iob& b, int path, double timeout_s, int forced) {
  const Runtime& rt = b.rt();
  ErrorScope scope(rt, "probe");  // raises a caller's pending error; consumes ours on exit
  Device::Guard guard(b.dev());
  ProbeResult res;
  if (path == GPUSYNC_PATH_HOSTFN) {
    if (!rt.hipLaunchHostFunc) {
      res.report = "hipLaunchHostFunc missing from the HIP runtime (e.g. Debian's 5.2.3)";
    } else {
      res = probe_copy(b, path, timeout_s, /*eager_only=*/true);
      res.report = res.report + "; eager only: host-function nodes are never used under HIP graph "
                   "replay (seed 001)";
    }
    res.safe = false;
    b.report(path) = res.report;
    return res;
  }
  if (path != GPUSYNC_PATH_MEMOP && path != GPUSYNC_PATH_KERNEL)
    throw Error(GPUSYNC_E_INVALID, std::string("probe: path ") + path_name(path) + " has nothing to probe");
  std::string missing;
  if (!b.signal_words()) missing = b.signal_note();
  else if (!rt.has_memops()) missing = "hipStreamWriteValue64/hipStreamWaitValue64 missing from the HIP runtime";
  else if (!rt.has_graphs()) missing = "graph entry points missing from the HIP runtime: capture cannot be proven";
  else if (!rt.has_captured_release_event())
    missing = "hipEventRecordWithFlags missing (HIP < 6.4.2): the system-release event cannot be captured";
  if (!missing.empty()) {
    b.set_mechanism(MECH_NONE);
    b.set_replay_safe(GPUSYNC_PATH_MEMOP, false);
    res.report = "memop: " + missing;
    // Eager memops still work where the entries exist (no capture involved).
    if (b.signal_words() && rt.has_memops() && rt.has_release_event()) {
      const ProbeResult e = probe_copy(b, GPUSYNC_PATH_MEMOP, timeout_s, true);
      res.eager = e.eager;
      res.report += "; eager " + std::string(e.eager ? "ok" : e.report);
    }
    b.report(GPUSYNC_PATH_MEMOP) = res.report;
    return res;
  }
  std::string notes;
  std::vector<Mechanism> order;
  if (forced == MECH_SPLICE) {
    order.push_back(MECH_SPLICE);
    notes = "forced splice";
  } else if (forced == MECH_NATIVE) {
    // Even when forced, native memops are used under capture only where capture
    // records them: elsewhere a captured wait would block the real queue now.
    std::string why;
    if (detect_native(b, timeout_s, &why)) order.push_back(MECH_NATIVE);
    notes = "forced native: " + why;
  } else {
    std::string why;
    if (detect_native(b, timeout_s, &why)) order.push_back(MECH_NATIVE);
    notes = "native: " + why;
    if (rt.has_splice()) order.push_back(MECH_SPLICE);
    else notes += "; splice: hipGraphAddBatchMemOpNode (HIP 6.4+) or the capture-dependency entry points missing";
  }
  for (Mechanism m : order) {
    b.set_mechanism(m);
    ProbeResult r = probe_copy(b, GPUSYNC_PATH_MEMOP, timeout_s, false);
    res.eager = res.eager || r.eager;
    notes += std::string("; ") + mechanism_name(m) + ": " + r.report;
    if (r.safe) {
      res.safe = true;
      break;
    }
  }
  if (!res.safe) b.set_mechanism(MECH_NONE);
  b.set_replay_safe(GPUSYNC_PATH_MEMOP, res.safe);
  res.report = std::string("memop (") + mechanism_name(b.mechanism()) + "): " + notes;
  b.report(GPUSYNC_PATH_MEMOP) = res.report;
  if (path == GPUSYNC_PATH_KERNEL) b.report(path) = res.report;
  return res;
}
}  // namespace gpusync
