// Start-up probe of a copy path (memop or host-func) against the executor's
// running coordinator: eager, then capture, instantiate and replay with changed
// inputs, each result compared bit for bit with the synchronous CPU result of
// the same inputs (run_task). A path is replay-safe only if all of it passed
// (docs/architecture.md, rule 4: fail closed). Every wait is bounded.
#include <cstring>
#include <vector>

#include "probe.h"

#include "gpusync/backend_common.h"

namespace gpusync {
namespace {
using Inputs = common::ProbeInputs;

struct Task {
  uint32_t layer, T;
  CUdeviceptr x, ids, w, y;
  Inputs in;
  std::vector<uint16_t> want;
};

std::string counts(const Driver& d, CUgraph g) {
  if (!d.cuGraphGetNodes || !d.cuGraphNodeGetType) return "node types not inspectable";
  size_t n = 0;
  d.cuGraphGetNodes(g, nullptr, &n);
  std::vector<CUgraphNode> nodes(n);
  d.cuGraphGetNodes(g, nodes.data(), &n);
  int memop = 0, host = 0, copy = 0, other = 0;
  for (auto* nd : nodes) {
    int t = -1;
    d.cuGraphNodeGetType(nd, &t);
    if (t == GRAPH_NODE_BATCH_MEM_OP) ++memop;
    else if (t == GRAPH_NODE_HOST) ++host;
    else if (t == GRAPH_NODE_MEMCPY) ++copy;
    else ++other;
  }
  return std::to_string(n) + " nodes (" + std::to_string(memop) + " memop, " + std::to_string(host) + " host, " +
         std::to_string(copy) + " memcpy, " + std::to_string(other) + " other)";
}
}  // namespace

ProbeResult probe(Iob& b, int path, double timeout_s) {
  ProbeResult res;
  const std::string name = path_name(path);
  Device& dev = b.dev();
  const Driver& d = dev.drv();
  if (path == GPUSYNC_PATH_MEMOP && !dev.memops64()) {
    res.report = "v2 64-bit stream memops unavailable (attribute 122 = 0 or entry points missing)";
    return res;
  }
  if (path == GPUSYNC_PATH_HOSTFN && !d.cuLaunchHostFunc) {
    res.report = "cuLaunchHostFunc missing from the driver";
    return res;
  }
  if (!d.has_graphs()) {
    res.report = "graph entry points missing from the driver: capture cannot be proven";
    return res;
  }
  const cpumoe_iob_header* h = b.hdr();
  const size_t H = h->hidden, K = h->top_k;
  const uint32_t L = h->num_layers, maxT = h->max_tokens;
  Device::Guard guard(dev);
  CUstream s = nullptr;
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  CUdeviceptr mem = 0;
  bool capturing = false;
  const bool was_safe = b.replay_safe(path);
  std::string stage = "setup";
  std::vector<Task> tasks = {{0, 1, 0, 0, 0, 0, {}, {}}, {L - 1, maxT < 3 ? maxT : 3, 0, 0, 0, 0, {}, {}}};
  try {
    d.check(d.cuStreamCreate(&s, STREAM_NON_BLOCKING), "cuStreamCreate");
    const size_t per = (maxT * H * 2 + 255) / 256 * 256 * 2 + (maxT * K * 4 + 255) / 256 * 256 * 2;
    mem = dev.alloc(per * tasks.size());
    for (size_t i = 0; i < tasks.size(); ++i) {
      CUdeviceptr p = mem + per * i;
      tasks[i].x = p, p += (maxT * H * 2 + 255) / 256 * 256;
      tasks[i].y = p, p += (maxT * H * 2 + 255) / 256 * 256;
      tasks[i].ids = p, p += (maxT * K * 4 + 255) / 256 * 256;
      tasks[i].w = p;
    }
    auto bounded = [&](const char* what) {
      if (!b.sync(s, timeout_s))
        throw Error(GPUSYNC_E_TIMEOUT, std::string(what) + ": no completion within " + std::to_string(timeout_s) +
                                           " s (is the coordinator running? the stream was released)");
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
        d.check(d.cuMemcpyHtoDAsync(t.x, t.in.x.data(), t.T * H * 2, s), "cuMemcpyHtoDAsync(x)");
        d.check(d.cuMemcpyHtoDAsync(t.ids, t.in.ids.data(), t.T * K * 4, s), "cuMemcpyHtoDAsync(ids)");
        d.check(d.cuMemcpyHtoDAsync(t.w, t.in.w.data(), t.T * K * 4, s), "cuMemcpyHtoDAsync(w)");
        d.check(d.cuMemcpyHtoDAsync(t.y, poison.data(), t.T * H * 2, s), "cuMemcpyHtoDAsync(y poison)");
      }
      std::memcpy(b.host(h->y_off), poison.data(), maxT * H * 2);
      bounded("input upload");
    };
    auto compare = [&](const char* when) {
      for (const Task& t : tasks) {
        std::vector<uint16_t> got(t.T * H);
        d.check(d.cuMemcpyDtoHAsync(got.data(), t.y, t.T * H * 2, s), "cuMemcpyDtoHAsync(y)");
        bounded("output download");
        for (size_t j = 0; j < got.size(); ++j)
          if (got[j] != t.want[j])
            throw Error(GPUSYNC_E_MISMATCH, std::string(when) + ": layer " + std::to_string(t.layer) + " T=" +
                                                std::to_string(t.T) + " element " + std::to_string(j) +
                                                " differs from the synchronous CPU result");
      }
    };
    auto enqueue = [&] {
      for (const Task& t : tasks) b.step(path, s, t.layer, t.T, t.x, t.ids, t.w, t.y);
    };

    stage = "eager";
    prepare(1);
    enqueue();
    bounded("eager step");
    compare("eager");

    stage = "capture";
    b.set_replay_safe(path, true);  // let step() record into this probe's capture
    d.check(d.cuStreamBeginCapture(s, CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
    capturing = true;
    enqueue();
    capturing = false;
    d.check(d.cuStreamEndCapture(s, &graph), "cuStreamEndCapture");
    b.set_replay_safe(path, was_safe);
    const std::string shape = counts(d, graph);
    d.check(d.cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiateWithFlags");

    stage = "replay";
    const int replays = 3;
    for (int r = 0; r < replays; ++r) {
      prepare(100 + r);  // changed inputs: a graph that kept stale data fails here
      const uint64_t served0 = __atomic_load_n(&b.hdr()->served, __ATOMIC_ACQUIRE);
      d.check(d.cuGraphLaunch(exec, s), "cuGraphLaunch");
      bounded("graph replay");
      compare("replay");
      const uint64_t served = __atomic_load_n(&b.hdr()->served, __ATOMIC_ACQUIRE) - served0;
      if (path == GPUSYNC_PATH_MEMOP && served != tasks.size())
        throw Error(GPUSYNC_E_MISMATCH, "replay served " + std::to_string(served) + " doorbells, expected " +
                                            std::to_string(tasks.size()));
    }
    res.safe = true;
    res.report = name + ": eager ok; captured " + shape + "; " + std::to_string(replays) +
                 " replays with changed inputs bit-identical to the synchronous CPU result; " + b.copy_mode();
  } catch (const std::exception& e) {
    if (capturing) {  // end the capture so the stream is usable again
      CUgraph g2 = nullptr;
      d.cuStreamEndCapture(s, &g2);
      if (g2) d.cuGraphDestroy(g2);
    }
    b.set_replay_safe(path, was_safe);
    res.safe = false;
    res.report = name + " failed at " + stage + ": " + e.what() + " (" + b.copy_mode() + ")";
  }
  if (exec) d.cuGraphExecDestroy(exec);
  if (graph) d.cuGraphDestroy(graph);
  if (s) {
    b.sync(s, timeout_s);
    d.cuStreamDestroy(s);
  }
  if (mem) dev.free(mem);
  b.set_replay_safe(path, res.safe);
  b.report(path) = res.report;
  return res;
}
}  // namespace gpusync
