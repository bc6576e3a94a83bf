// A fake libcuda.so.1 for CPU-only tests of gpusync-cuda's control logic
// (docs/architecture.md, rule 7): streams are worker threads that run their ops in
// order (copies, 64-bit memop writes and GEQ waits, host functions, event
// records and event waits); capture records ops into a graph of nodes with
// dependencies (events recorded in a capture fork other streams into it and
// join them back, as in CUDA); a replay runs every node on its own thread once
// its dependencies are done, so a missing edge shows up as a race. "Device"
// pointers are host pointers. Only cuGetProcAddress_v2 and cuDriverGetVersion
// are exported as driver entry points, so the loader must resolve everything
// through the versioned query.
//
// FAKE_CUDA_FAULT selects a fault: drop_memops_in_capture (success, nothing
// recorded: the silent failure of notes E1), reject_memops_in_capture,
// no_memop_attr, no_hostfunc, no_device. Modules always fail to load
// (CUDA_ERROR_NO_BINARY_FOR_GPU), which exercises kernelio's fallback.
// FAKE_CUDA_COPY_DELAY_US makes every copy sleep first (a copy racing the
// doorbell then loses). Test hooks, reached with ctypes on this library (the
// same loaded instance): fake_cuda_fail(name, nth, code) makes the nth next
// call of an entry point return code; fake_cuda_state() and
// fake_cuda_last_graph() describe the live objects and the last captured graph
// as JSON.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {
using Res = int;
constexpr Res OK = 0, INVALID = 1, NO_DEVICE = 100, NO_BINARY = 209, NOT_READY = 600, ALREADY = 712,
              CAPTURE_MERGE = 902, CAPTURE_UNMATCHED = 903, CAPTURE_UNJOINED = 904, CAPTURE_ISOLATION = 905,
              CAPTURED_EVENT = 907, UNKNOWN = 999;

std::string fault() {
  const char* f = std::getenv("FAKE_CUDA_FAULT");
  return f ? f : "";
}

// ---- fault injection: the nth next call of one entry point fails ----
std::mutex g_fail_mu;
std::string g_fail_name;
int g_fail_nth = 0;
Res g_fail_code = UNKNOWN;
Res injected(const char* name) {
  std::lock_guard<std::mutex> l(g_fail_mu);
  if (g_fail_nth > 0 && g_fail_name == name && --g_fail_nth == 0) {
    g_fail_name.clear();
    return g_fail_code;
  }
  return OK;
}

using Run = std::function<void(const std::atomic<bool>&)>;
struct Node {
  int type;  // graph node type: 1 memcpy, 3 host, 12 memop
  Run run;
  std::vector<size_t> deps;
  std::string desc;  // JSON fields naming what the node does
};
struct Graph {
  std::vector<Node> nodes;
};

struct Stream;
// Capture bookkeeping (which stream captures into which graph, event capture
// points, live objects) under one lock; each stream's queue has its own.
std::mutex g_mu;
std::set<Stream*> g_streams;
std::set<Graph*> g_graphs;
size_t g_execs = 0;
std::string g_last_graph = "null";

struct Stream {
  std::mutex m;
  std::condition_variable cv;
  std::deque<Run> q;
  bool busy = false, stop = false;
  std::atomic<bool> cancel{false};
  // capture (g_mu): the graph this stream records into, the stream that began
  // it, this stream's last nodes (what its next node depends on), and for the
  // origin the streams forked into it.
  Graph* graph = nullptr;
  Stream* origin = nullptr;
  std::vector<size_t> tail;
  std::vector<Stream*> joined;
  std::thread t;
  Stream() {
    t = std::thread([this] {
      for (;;) {
        Run op;
        {
          std::unique_lock<std::mutex> l(m);
          cv.wait(l, [this] { return stop || !q.empty(); });
          if (stop && q.empty()) return;
          op = std::move(q.front());
          q.pop_front();
          busy = true;
        }
        op(cancel);
        std::lock_guard<std::mutex> l(m);
        busy = false;
      }
    });
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> l(m);
      stop = true;
      cancel = true;
    }
    cv.notify_all();
    t.join();
  }
  void enqueue(Run op) {
    std::lock_guard<std::mutex> l(m);
    q.push_back(std::move(op));
    cv.notify_all();
  }
  bool idle() {
    std::lock_guard<std::mutex> l(m);
    return q.empty() && !busy;
  }
};

Stream* legacy() {
  static Stream* s = new Stream;  // leaked: lives as long as the process
  return s;
}
Stream* S(void* h) { return h ? static_cast<Stream*>(h) : legacy(); }

// Eager: queue the op. Capturing: a node depending on the stream's last nodes.
Res add(void* s, int type, Run run, std::string desc) {
  Stream* st = S(s);
  {
    std::lock_guard<std::mutex> l(g_mu);
    if (st->graph) {
      st->graph->nodes.push_back({type, std::move(run), st->tail, std::move(desc)});
      st->tail = {st->graph->nodes.size() - 1};
      return OK;
    }
  }
  st->enqueue(std::move(run));
  return OK;
}

// An event: eager records bump `recorded` and complete in stream order; a
// record under capture remembers the capturing stream's last nodes instead.
struct Event {
  uint64_t recorded = 0;  // g_mu
  std::shared_ptr<std::atomic<uint64_t>> completed = std::make_shared<std::atomic<uint64_t>>(0);
  Graph* graph = nullptr;  // recorded in this capture (g_mu)
  Stream* origin = nullptr;
  std::vector<size_t> tail;
  bool stale = false;  // recorded in a capture that has ended
};
std::set<Event*> g_events;

std::mutex g_reg_mu;
std::set<void*> g_registered;
thread_local int g_ctx_depth = 0;
int g_ctx_token;

Res cuInit(unsigned) { return fault() == "no_device" ? NO_DEVICE : OK; }
Res fake_cuDriverGetVersion(int* v) { return *v = 13000, OK; }
Res cuGetErrorName(Res r, const char** s) {
  static thread_local std::string n;
  n = r == INVALID                ? "CUDA_ERROR_INVALID_VALUE"
      : r == NO_BINARY            ? "CUDA_ERROR_NO_BINARY_FOR_GPU"
      : r == NO_DEVICE            ? "CUDA_ERROR_NO_DEVICE"
      : r == CAPTURE_UNJOINED     ? "CUDA_ERROR_STREAM_CAPTURE_UNJOINED"
      : r == CAPTURE_ISOLATION    ? "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"
      : r == UNKNOWN              ? "CUDA_ERROR_UNKNOWN"
                                  : "CUDA_ERROR_" + std::to_string(r);
  return *s = n.c_str(), OK;
}
Res cuGetErrorString(Res, const char** s) { return *s = "fake", OK; }
Res cuDeviceGetCount(int* n) { return *n = 1, OK; }
Res cuDeviceGet(int* d, int o) { return o == 0 ? (*d = 0, OK) : INVALID; }
Res cuDeviceGetName(char* b, int n, int) { return std::snprintf(b, n, "Fake GPU"), OK; }
Res cuDeviceGetAttribute(int* v, int a, int) {
  *v = a == 75 ? 9 : a == 76 ? 0 : a == 122 ? (fault() == "no_memop_attr" ? 0 : 1) : 1;
  return OK;
}
Res cuDevicePrimaryCtxRetain(void** c, int) { return *c = &g_ctx_token, OK; }
Res cuDevicePrimaryCtxRelease(int) { return OK; }
Res cuCtxGetCurrent(void** c) { return *c = g_ctx_depth ? &g_ctx_token : nullptr, OK; }
Res cuCtxPushCurrent(void*) { return ++g_ctx_depth, OK; }
Res cuCtxPopCurrent(void** c) { return --g_ctx_depth, *c = &g_ctx_token, OK; }
Res cuMemHostRegister(void* p, size_t, unsigned) {
  std::lock_guard<std::mutex> l(g_reg_mu);
  return g_registered.insert(p).second ? OK : ALREADY;
}
Res cuMemHostUnregister(void* p) {
  std::lock_guard<std::mutex> l(g_reg_mu);
  return g_registered.erase(p) ? OK : INVALID;
}
Res cuMemHostGetDevicePointer(uint64_t* d, void* p, unsigned) { return *d = (uint64_t)(uintptr_t)p, OK; }
Res cuMemAlloc(uint64_t* d, size_t n) { return *d = (uint64_t)(uintptr_t)std::aligned_alloc(256, (n + 255) / 256 * 256), OK; }
Res cuMemFree(uint64_t d) { return std::free((void*)(uintptr_t)d), OK; }
Res copy(uint64_t dst, uint64_t src, size_t n, void* s) {
  static const long delay_us = [] {
    const char* e = std::getenv("FAKE_CUDA_COPY_DELAY_US");
    return e ? std::atol(e) : 0L;
  }();
  return add(s, 1, [=](const std::atomic<bool>&) {
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    std::memcpy((void*)dst, (const void*)src, n);
  }, "\"op\": \"copy\", \"dst\": " + std::to_string(dst) + ", \"src\": " + std::to_string(src) + ", \"bytes\": " +
         std::to_string(n));
}
Res cuMemcpyAsync(uint64_t d, uint64_t s, size_t n, void* st) {
  if (Res r = injected("cuMemcpyAsync")) return r;
  return copy(d, s, n, st);
}
Res cuMemcpyDtoHAsync(void* d, uint64_t s, size_t n, void* st) {
  if (Res r = injected("cuMemcpyDtoHAsync")) return r;
  return copy((uint64_t)(uintptr_t)d, s, n, st);
}
Res cuMemcpyHtoDAsync(uint64_t d, const void* s, size_t n, void* st) {
  if (Res r = injected("cuMemcpyHtoDAsync")) return r;
  return copy(d, (uint64_t)(uintptr_t)s, n, st);
}
Res cuStreamCreate(void** s, unsigned) {
  if (Res r = injected("cuStreamCreate")) return r;
  auto* st = new Stream;
  std::lock_guard<std::mutex> l(g_mu);
  g_streams.insert(st);
  return *s = st, OK;
}
Res cuStreamDestroy(void* s) {
  if (Res r = injected("cuStreamDestroy")) return r;
  auto* st = static_cast<Stream*>(s);
  {
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_streams.erase(st)) return INVALID;
    if (st->origin && st->origin != st) {  // leave the capture it was forked into
      auto& j = st->origin->joined;
      for (size_t i = 0; i < j.size(); ++i)
        if (j[i] == st) j.erase(j.begin() + (long)i), --i;
    }
  }
  delete st;
  return OK;
}
Res cuStreamQuery(void* s) { return S(s)->idle() ? OK : NOT_READY; }
Res cuStreamSynchronize(void* s) {
  while (!S(s)->idle()) std::this_thread::yield();
  return OK;
}
Res cuStreamIsCapturing(void* s, int* st) {
  std::lock_guard<std::mutex> l(g_mu);
  return *st = S(s)->graph ? 1 : 0, OK;
}
Res cuEventCreate(void** e, unsigned) {
  if (Res r = injected("cuEventCreate")) return r;
  auto* ev = new Event;
  std::lock_guard<std::mutex> l(g_mu);
  g_events.insert(ev);
  return *e = ev, OK;
}
Res cuEventDestroy(void* e) {
  if (Res r = injected("cuEventDestroy")) return r;
  auto* ev = static_cast<Event*>(e);
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_events.erase(ev)) return INVALID;
  delete ev;  // ops still queued hold `completed` (shared), as the driver defers the release
  return OK;
}
Res cuEventRecord(void* e, void* s) {
  if (Res r = injected("cuEventRecord")) return r;
  auto* ev = static_cast<Event*>(e);
  Stream* st = S(s);
  std::unique_lock<std::mutex> l(g_mu);
  if (!g_events.count(ev)) return INVALID;
  if (st->graph) {  // no node: the event stands for the stream's current last nodes
    ev->graph = st->graph, ev->origin = st->origin, ev->tail = st->tail, ev->stale = false;
    return OK;
  }
  ev->graph = nullptr, ev->stale = false;
  const uint64_t gen = ++ev->recorded;
  auto done = ev->completed;
  l.unlock();
  st->enqueue([done, gen](const std::atomic<bool>&) {
    uint64_t c = done->load();
    while (c < gen && !done->compare_exchange_weak(c, gen)) {
    }
  });
  return OK;
}
Res cuStreamWaitEvent(void* s, void* e, unsigned flags) {
  if (Res r = injected("cuStreamWaitEvent")) return r;
  if (flags) return INVALID;
  auto* ev = static_cast<Event*>(e);
  Stream* st = S(s);
  std::unique_lock<std::mutex> l(g_mu);
  if (!g_events.count(ev)) return INVALID;
  if (ev->stale) return CAPTURED_EVENT;  // recorded in a capture that has ended
  if (ev->graph) {
    if (st->graph == ev->graph) {  // join: the stream's next node depends on both
      for (size_t n : ev->tail) st->tail.push_back(n);
      return OK;
    }
    if (st->graph) return CAPTURE_MERGE;  // two different captures
    if (st == legacy()) return CAPTURE_ISOLATION;
    // fork: this stream joins the capture, its next node depends on the event's nodes
    st->graph = ev->graph, st->origin = ev->origin, st->tail = ev->tail;
    ev->origin->joined.push_back(st);
    return OK;
  }
  if (st->graph) return CAPTURE_ISOLATION;  // a capture may not depend on work outside it
  const uint64_t target = ev->recorded;
  auto done = ev->completed;
  l.unlock();
  if (target == 0) return OK;  // never recorded: nothing to wait for
  st->enqueue([done, target](const std::atomic<bool>& cancel) {
    while (done->load() < target && !cancel) std::this_thread::yield();
  });
  return OK;
}
Res memop(void* s, Run f, std::string desc) {
  Stream* st = S(s);
  bool capturing;
  {
    std::lock_guard<std::mutex> l(g_mu);
    capturing = st->graph != nullptr;
  }
  if (capturing && fault() == "drop_memops_in_capture") return OK;
  if (capturing && fault() == "reject_memops_in_capture") return INVALID;
  return add(s, 12, std::move(f), std::move(desc));
}
Res cuStreamWriteValue64(void* s, uint64_t a, uint64_t v, unsigned fl) {
  if (Res r = injected("cuStreamWriteValue64")) return r;
  if (fl) return INVALID;  // NO_MEMORY_BARRIER is rejected by the v2 API
  return memop(s, [=](const std::atomic<bool>&) { __atomic_store_n((uint64_t*)a, v, __ATOMIC_SEQ_CST); },
               "\"op\": \"write\", \"addr\": " + std::to_string(a) + ", \"value\": " + std::to_string(v));
}
Res cuStreamWaitValue64(void* s, uint64_t a, uint64_t v, unsigned fl) {
  if (Res r = injected("cuStreamWaitValue64")) return r;
  if (fl) return INVALID;
  return memop(s, [=](const std::atomic<bool>& cancel) {
    while ((int64_t)(__atomic_load_n((uint64_t*)a, __ATOMIC_ACQUIRE) - v) < 0 && !cancel) std::this_thread::yield();
  }, "\"op\": \"wait\", \"addr\": " + std::to_string(a) + ", \"value\": " + std::to_string(v));
}
Res cuLaunchHostFunc(void* s, void (*fn)(void*), void* ud) {
  if (Res r = injected("cuLaunchHostFunc")) return r;
  return add(s, 3, [=](const std::atomic<bool>&) { fn(ud); },
             "\"op\": \"host\", \"fn\": " + std::to_string((uintptr_t)fn) + ", \"arg\": " +
                 std::to_string((uintptr_t)ud));
}
Res cuStreamBeginCapture(void* s, int) {
  Stream* st = S(s);
  std::lock_guard<std::mutex> l(g_mu);
  if (st->graph) return INVALID;
  st->graph = new Graph, st->origin = st, st->tail.clear(), st->joined.clear();
  g_graphs.insert(st->graph);
  return OK;
}
std::string describe(const Graph& g) {
  std::string out = "[";
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    out += std::string(i ? ", " : "") + "{\"type\": " + std::to_string(n.type) + ", " + n.desc + ", \"deps\": [";
    for (size_t j = 0; j < n.deps.size(); ++j) out += (j ? ", " : "") + std::to_string(n.deps[j]);
    out += "]}";
  }
  return out + "]";
}
Res cuStreamEndCapture(void* s, void** g) {
  Stream* st = S(s);
  std::lock_guard<std::mutex> l(g_mu);
  *g = nullptr;
  if (!st->graph) return INVALID;
  if (st->origin != st) return CAPTURE_UNMATCHED;  // not the stream that began it
  Graph* gr = st->graph;
  // Every stream forked into the capture must have been joined back: its last
  // nodes are among the origin's last nodes or their ancestors.
  std::vector<char> reach(gr->nodes.size(), 0);
  std::vector<size_t> todo(st->tail);
  while (!todo.empty()) {
    const size_t n = todo.back();
    todo.pop_back();
    if (reach[n]) continue;
    reach[n] = 1;
    for (size_t d : gr->nodes[n].deps) todo.push_back(d);
  }
  bool unjoined = false;
  for (Stream* j : st->joined)
    for (size_t n : j->tail) unjoined |= !reach[n];
  // The capture ends for every stream in it either way (as in CUDA).
  for (Stream* j : st->joined) j->graph = nullptr, j->origin = nullptr, j->tail.clear();
  st->graph = nullptr, st->origin = nullptr, st->tail.clear(), st->joined.clear();
  for (Event* ev : g_events)
    if (ev->graph == gr) ev->graph = nullptr, ev->stale = true;
  if (unjoined) {
    g_graphs.erase(gr);
    delete gr;
    return CAPTURE_UNJOINED;
  }
  g_last_graph = describe(*gr);
  *g = gr;
  return OK;
}
// A replay: every node on its own thread, started once its dependencies are done.
void run_graph(const Graph& g, const std::atomic<bool>& cancel) {
  std::mutex m;
  std::condition_variable cv;
  std::vector<char> done(g.nodes.size(), 0);
  std::vector<std::thread> ts;
  for (size_t i = 0; i < g.nodes.size(); ++i)
    ts.emplace_back([&, i] {
      {
        std::unique_lock<std::mutex> l(m);
        for (size_t d : g.nodes[i].deps)
          while (!done[d] && !cancel) cv.wait_for(l, std::chrono::milliseconds(1));
      }
      g.nodes[i].run(cancel);
      std::lock_guard<std::mutex> l(m);
      done[i] = 1;
      cv.notify_all();
    });
  for (auto& t : ts) t.join();
}
using Exec = std::shared_ptr<const Graph>;
Res cuGraphInstantiateWithFlags(void** e, void* g, unsigned long long) {
  std::lock_guard<std::mutex> l(g_mu);
  ++g_execs;
  return *e = new Exec(std::make_shared<const Graph>(*static_cast<Graph*>(g))), OK;
}
Res cuGraphLaunch(void* e, void* s) {
  Exec g = *static_cast<Exec*>(e);
  S(s)->enqueue([g](const std::atomic<bool>& cancel) { run_graph(*g, cancel); });
  return OK;
}
Res cuGraphExecDestroy(void* e) {
  std::lock_guard<std::mutex> l(g_mu);
  --g_execs;
  return delete static_cast<Exec*>(e), OK;
}
Res cuGraphDestroy(void* g) {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_graphs.erase(static_cast<Graph*>(g))) return INVALID;
  return delete static_cast<Graph*>(g), OK;
}
Res cuGraphGetNodes(void* g, void** nodes, size_t* n) {
  auto* gr = static_cast<Graph*>(g);
  if (nodes)
    for (size_t i = 0; i < gr->nodes.size() && i < *n; ++i) nodes[i] = &gr->nodes[i];
  *n = gr->nodes.size();
  return OK;
}
Res cuGraphNodeGetType(void* node, int* t) { return *t = static_cast<Node*>(node)->type, OK; }
Res cuModuleLoadData(void**, const void*) { return NO_BINARY; }
Res cuModuleUnload(void*) { return OK; }
Res cuModuleGetFunction(void**, void*, const char*) { return INVALID; }
Res cuLaunchKernel(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                   void**) {
  return INVALID;
}

struct Sym {
  const char* name;
  void* fn;
};
#define E(f) {#f, (void*)&f}
const Sym kSyms[] = {E(cuInit), {"cuDriverGetVersion", (void*)&fake_cuDriverGetVersion}, E(cuGetErrorName), E(cuGetErrorString), E(cuDeviceGetCount),
                     E(cuDeviceGet), E(cuDeviceGetName), E(cuDeviceGetAttribute), E(cuDevicePrimaryCtxRetain),
                     E(cuDevicePrimaryCtxRelease), E(cuCtxGetCurrent), E(cuCtxPushCurrent), E(cuCtxPopCurrent),
                     E(cuMemHostRegister), E(cuMemHostUnregister), E(cuMemHostGetDevicePointer), E(cuMemAlloc),
                     E(cuMemFree), E(cuMemcpyAsync), E(cuMemcpyDtoHAsync), E(cuMemcpyHtoDAsync), E(cuStreamCreate),
                     E(cuStreamDestroy), E(cuStreamQuery), E(cuStreamSynchronize), E(cuStreamIsCapturing),
                     E(cuEventCreate), E(cuEventDestroy), E(cuEventRecord), E(cuStreamWaitEvent),
                     E(cuStreamWriteValue64), E(cuStreamWaitValue64), E(cuLaunchHostFunc), E(cuStreamBeginCapture),
                     E(cuStreamEndCapture), E(cuGraphInstantiateWithFlags), E(cuGraphLaunch), E(cuGraphExecDestroy),
                     E(cuGraphDestroy), E(cuGraphGetNodes), E(cuGraphNodeGetType), E(cuModuleLoadData),
                     E(cuModuleUnload), E(cuModuleGetFunction), E(cuLaunchKernel)};
}  // namespace

extern "C" {
__attribute__((visibility("default"))) int cuDriverGetVersion(int* v) { return fake_cuDriverGetVersion(v); }
__attribute__((visibility("default"))) int cuGetProcAddress_v2(const char* name, void** pfn, int version,
                                                               uint64_t, int* status) {
  *pfn = nullptr;
  if (version != 12000) return INVALID;  // the loader must ask for the ABI it was written against
  if (fault() == "no_hostfunc" && std::string(name) == "cuLaunchHostFunc") return *status = 1, OK;
  for (const Sym& s : kSyms)
    if (std::string(name) == s.name) return *pfn = s.fn, *status = 0, OK;
  return *status = 1, OK;  // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
}

// ---- test hooks (ctypes) ----
// The nth next call (1 = the next one) of entry point `name` returns `code`
// and does nothing; nth = 0 disarms.
__attribute__((visibility("default"))) void fake_cuda_fail(const char* name, int nth, int code) {
  std::lock_guard<std::mutex> l(g_fail_mu);
  g_fail_name = name ? name : "", g_fail_nth = nth, g_fail_code = code;
}
// {"streams", "events", "graphs", "execs": live counts, "capturing": streams in a capture,
//  "registered": host ranges registered, "fail_armed": a failure still pending}
__attribute__((visibility("default"))) const char* fake_cuda_state() {
  static thread_local std::string out;
  size_t capturing = 0, armed;
  {
    std::lock_guard<std::mutex> l(g_fail_mu);
    armed = g_fail_nth > 0;
  }
  std::lock_guard<std::mutex> l(g_mu);
  for (Stream* st : g_streams) capturing += st->graph != nullptr;
  capturing += legacy()->graph != nullptr;
  size_t reg;
  {
    std::lock_guard<std::mutex> r(g_reg_mu);
    reg = g_registered.size();
  }
  out = "{\"streams\": " + std::to_string(g_streams.size()) + ", \"events\": " + std::to_string(g_events.size()) +
        ", \"graphs\": " + std::to_string(g_graphs.size()) + ", \"execs\": " + std::to_string(g_execs) +
        ", \"capturing\": " + std::to_string(capturing) + ", \"registered\": " + std::to_string(reg) +
        ", \"fail_armed\": " + (armed ? "true" : "false") + "}";
  return out.c_str();
}
// The last graph a capture ended with: [{"type", "op", addresses/values, "deps": [node indices]}, ...]
__attribute__((visibility("default"))) const char* fake_cuda_last_graph() {
  static thread_local std::string out;
  std::lock_guard<std::mutex> l(g_mu);
  out = g_last_graph;
  return out.c_str();
}
}
