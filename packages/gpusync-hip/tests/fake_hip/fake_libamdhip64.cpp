// A fake libamdhip64 for CPU-only tests of gpusync-hip's control logic
// (design.md principle 7). A CPU model of the parts of the HIP runtime that
// gpusync-hip touches: streams are worker threads that run their ops in order
// (copies, 64-bit memop writes and masked non-cyclic Gte waits, events, host
// functions, a fake kernel); capture builds a graph of nodes with dependency
// edges; instantiate orders it; launch replays it. "Device" memory is host
// memory. Every wait is bounded (stream destroy cancels it; 30 s at most).
//
// Behaviour is set by fakehip_configure("key=value;...") (exported, call it via
// ctypes; it also resets counters), or by FAKEHIP_CONFIG at load time:
//   capture=record|eager|drop   memops on a capturing stream: recorded as nodes
//                               (HIP >= 10), executed at once and not recorded
//                               (ROCm < 10), or silently dropped
//   batch=unordered             a batch-memop node runs its ops in reverse order
//   params=keep                 a batch-memop node keeps the caller's paramArray
//                               (no deep copy) and reads it at every replay
//   payload=late                device-to-host copies become visible to the host
//                               only at a system-release event, a host sync, or
//                               late_ms AFTER the next doorbell write (seed 003)
//   late_ms=N                   (default 50)
//   fail=api[@n][:code],...     the n-th call (default: every call) of api fails
//                               with code (default hipErrorInvalidValue)
//   sticky=code                 a pre-existing error on the calling thread
//   version=N, devices=N        hipRuntimeGetVersion, hipGetDeviceCount
// Missing entry points are compile-time variants: -DFAKEHIP_NO_HOSTFUNC,
// -DFAKEHIP_NO_BATCH_NODE, -DFAKEHIP_NO_RECORD_WITH_FLAGS (all three: Debian's
// 5.2.3), -DFAKEHIP_NO_STREAM_CREATE (a required one).
// fakehip_stats() returns JSON: live objects, node counts, end-capture log,
// call counts, the pending last error (without consuming it).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {
using E = int;
constexpr E OK = 0, INVALID = 1, NO_DEVICE = 100, INVALID_DEVICE = 101, NO_BINARY = 209, INVALID_HANDLE = 400,
            NOT_FOUND = 500, NOT_READY = 600, ALREADY = 712, NOT_REGISTERED = 713, CAPTURE_INVALIDATED = 901,
            CAPTURE_UNMATCHED = 903, CAPTURE_UNJOINED = 904, CAPTURE_IMPLICIT = 906;
constexpr int NODE_MEMCPY = 2, NODE_HOST = 4, NODE_KERNEL = 1, NODE_EVENT_RECORD = 8, NODE_BATCH_MEMOP = 100;
constexpr unsigned EV_RELEASE_TO_SYSTEM = 0x80000000u;

// ---- configuration and bookkeeping ----------------------------------------------------------
struct Fail {
  int nth = 0;  // 0: every call
  int code = INVALID;
};
struct Config {
  std::string capture = "record";
  bool unordered = false, keep_params = false, late = false;
  int late_ms = 50, version = 100100000, devices = 1;
  std::map<std::string, Fail> fail;
};
std::mutex g_mu;  // guards g_cfg, g_calls, graph bookkeeping
Config g_cfg;
std::map<std::string, int> g_calls;
thread_local int g_last = OK;  // CUDA-like (HIP 7.x): sticky until hipGetLastError
thread_local int g_device = 0;

struct EndCaptureLog {
  size_t nodes, memop_nodes, unjoined;
  int rc;
};
std::vector<EndCaptureLog> g_end_log;
std::atomic<long> g_live_streams{0}, g_live_graphs{0}, g_live_execs{0}, g_live_events{0}, g_signal_allocs{0},
    g_destroyed_nodes{0}, g_wait_timeouts{0}, g_late_flushes{0};

E set_err(E e) {
  if (e != OK) g_last = e;
  return e;
}
// Count the call; return the injected error for it, if any.
E inject(const char* api) {
  std::lock_guard<std::mutex> l(g_mu);
  const int n = ++g_calls[api];
  auto it = g_cfg.fail.find(api);
  if (it == g_cfg.fail.end()) return OK;
  return (it->second.nth == 0 || it->second.nth == n) ? it->second.code : OK;
}
#define FAIL_POINT(api)                   \
  do {                                    \
    if (E injected_ = inject(api)) return set_err(injected_); \
  } while (0)

Config cfg() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_cfg;
}

void configure(const std::string& spec) {
  Config c;
  std::stringstream ss(spec);
  std::string kv;
  while (std::getline(ss, kv, ';')) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
    if (k == "capture") c.capture = v;
    else if (k == "batch") c.unordered = v.find("unordered") != std::string::npos;
    else if (k == "params") c.keep_params = v == "keep";
    else if (k == "payload") c.late = v == "late";
    else if (k == "late_ms") c.late_ms = std::atoi(v.c_str());
    else if (k == "version") c.version = std::atoi(v.c_str());
    else if (k == "devices") c.devices = std::atoi(v.c_str());
    else if (k == "sticky") g_last = std::atoi(v.c_str());
    else if (k == "fail") {
      std::stringstream fs(v);
      std::string one;
      while (std::getline(fs, one, ',')) {
        Fail f;
        std::string api = one;
        const auto colon = api.find(':');
        if (colon != std::string::npos) f.code = std::atoi(api.substr(colon + 1).c_str()), api = api.substr(0, colon);
        const auto at = api.find('@');
        if (at != std::string::npos) f.nth = std::atoi(api.substr(at + 1).c_str()), api = api.substr(0, at);
        c.fail[api] = f;
      }
    }
  }
  std::lock_guard<std::mutex> l(g_mu);
  g_cfg = c;
  g_calls.clear();
  g_end_log.clear();
  g_destroyed_nodes = 0, g_wait_timeouts = 0, g_late_flushes = 0;
}

struct AutoConfig {
  AutoConfig() {
    if (const char* s = std::getenv("FAKEHIP_CONFIG")) configure(s);
  }
} g_auto;

// ---- memory ------------------------------------------------------------------------------------
std::mutex g_mem_mu;
std::map<uintptr_t, size_t> g_signal, g_device_mem, g_registered;

bool in(const std::map<uintptr_t, size_t>& m, const void* p, size_t n) {
  const uintptr_t a = (uintptr_t)p;
  auto it = m.upper_bound(a);
  if (it == m.begin()) return false;
  --it;
  return a >= it->first && a + n <= it->first + it->second;
}
bool is_signal(const void* p) {
  std::lock_guard<std::mutex> l(g_mem_mu);
  return in(g_signal, p, 8);
}

// ---- streams -------------------------------------------------------------------------------
struct Graph;
struct Node {
  int type;
  std::function<void(struct Stream&)> run;
  std::vector<Node*> deps;
  Graph* graph;
};
struct Graph {
  std::vector<Node*> nodes;
  ~Graph() {
    for (Node* n : nodes) delete n;
  }
};
struct Exec {
  std::vector<std::function<void(struct Stream&)>> ops;
};

struct Pending {
  void* dst;
  std::vector<char> data;
};

struct Stream {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void(Stream&)>> q;
  bool busy = false, stop = false;
  std::atomic<bool> cancel{false};
  // capture
  bool capturing = false;
  Graph* graph = nullptr;
  std::vector<Node*> deps;
  unsigned long long capture_id = 0;
  // late payload: D2H copies not yet visible to the host (worker thread only, plus host sync)
  std::mutex pend_mu;
  std::vector<Pending> pending;
  std::thread t;
  Stream() {
    ++g_live_streams;
    t = std::thread([this] {
      for (;;) {
        std::function<void(Stream&)> op;
        {
          std::unique_lock<std::mutex> l(m);
          cv.wait(l, [this] { return stop || !q.empty(); });
          if (stop && q.empty()) return;
          op = std::move(q.front());
          q.pop_front();
          busy = true;
        }
        op(*this);
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
    flush();
    --g_live_streams;
  }
  void enqueue(std::function<void(Stream&)> op) {
    std::lock_guard<std::mutex> l(m);
    q.push_back(std::move(op));
    cv.notify_all();
  }
  // Under capture: a node after the current dependencies, which it then replaces.
  Node* record(int type, std::function<void(Stream&)> op) {
    std::lock_guard<std::mutex> l(g_mu);
    Node* n = new Node{type, std::move(op), deps, graph};
    graph->nodes.push_back(n);
    deps.assign(1, n);
    return n;
  }
  void add(int type, std::function<void(Stream&)> op) {
    if (capturing) record(type, std::move(op));
    else enqueue(std::move(op));
  }
  bool idle() {
    std::lock_guard<std::mutex> l(m);
    return q.empty() && !busy;
  }
  void flush() {
    std::lock_guard<std::mutex> l(pend_mu);
    for (Pending& p : pending) std::memcpy(p.dst, p.data.data(), p.data.size());
    if (!pending.empty()) ++g_late_flushes;
    pending.clear();
  }
};

Stream* legacy() {
  static Stream* s = new Stream;  // leaked: lives as long as the process
  return s;
}
Stream* S(void* h) { return h ? static_cast<Stream*>(h) : legacy(); }

void run_write(Stream& st, uint64_t* a, uint64_t v) {
  __atomic_store_n(a, v, __ATOMIC_SEQ_CST);
  // Seed 003: the host may see the doorbell before the payload copied earlier on
  // the stream; it appears late_ms later unless a release flushed it first.
  bool late;
  {
    std::lock_guard<std::mutex> l(st.pend_mu);
    late = !st.pending.empty();
  }
  if (late) {
    std::this_thread::sleep_for(std::chrono::milliseconds(cfg().late_ms));
    st.flush();
  }
}
void run_wait(Stream& st, const uint64_t* a, uint64_t v, uint64_t mask) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  // ROCm: masked and non-cyclic ((*a & mask) >= v, unsigned).
  while ((__atomic_load_n(a, __ATOMIC_ACQUIRE) & mask) < v) {
    if (st.cancel || std::chrono::steady_clock::now() > until) {
      ++g_wait_timeouts;
      return;
    }
    std::this_thread::yield();
  }
}

struct Event {
  unsigned flags;
};

struct BatchOp {
  int operation;
  void* address;
  uint64_t value64;
  unsigned flags;
  void* alias;
};
struct BatchParams {  // hipStreamBatchMemOpParams: 48 bytes
  union {
    int operation;
    BatchOp op;
    uint64_t pad[6];
  };
};
struct NodeParams {
  void* ctx;
  unsigned count;
  BatchParams* paramArray;
  unsigned flags;
};
static_assert(sizeof(BatchParams) == 48 && sizeof(NodeParams) == 32, "batch memop layout");

void run_batch(Stream& st, const BatchParams* p, unsigned count, bool unordered) {
  for (unsigned i = 0; i < count; ++i) {
    const BatchOp& op = p[unordered ? count - 1 - i : i].op;
    if (op.operation == 5) run_write(st, (uint64_t*)op.address, op.value64);
    else if (op.operation == 4) run_wait(st, (const uint64_t*)op.address, op.value64, ~0ull);
  }
}

const char* err_name(E e) {
  switch (e) {
    case OK: return "hipSuccess";
    case INVALID: return "hipErrorInvalidValue";
    case 2: return "hipErrorOutOfMemory";
    case NO_DEVICE: return "hipErrorNoDevice";
    case INVALID_DEVICE: return "hipErrorInvalidDevice";
    case NO_BINARY: return "hipErrorNoBinaryForGpu";
    case INVALID_HANDLE: return "hipErrorInvalidHandle";
    case NOT_FOUND: return "hipErrorNotFound";
    case NOT_READY: return "hipErrorNotReady";
    case 700: return "hipErrorIllegalAddress";
    case ALREADY: return "hipErrorHostMemoryAlreadyRegistered";
    case NOT_REGISTERED: return "hipErrorHostMemoryNotRegistered";
    case 801: return "hipErrorNotSupported";
    case 900: return "hipErrorStreamCaptureUnsupported";
    case CAPTURE_INVALIDATED: return "hipErrorStreamCaptureInvalidated";
    case CAPTURE_UNMATCHED: return "hipErrorStreamCaptureUnmatched";
    case CAPTURE_UNJOINED: return "hipErrorStreamCaptureUnjoined";
    case CAPTURE_IMPLICIT: return "hipErrorStreamCaptureImplicit";
    case 999: return "hipErrorUnknown";
    default: return "hipErrorFakeUnnamed";
  }
}

// Fake modules: an image starting with this tag loads; it has one kernel,
// fill_u32(uint32_t* dst, uint32_t value, uint32_t n).
constexpr char kModuleTag[] = "FAKEHIP-MODULE";
int g_fill_kernel;
}  // namespace

// ---- control (for tests) --------------------------------------------------------------------
EXPORT int fakehip_configure(const char* spec) {
  configure(spec ? spec : "");
  return 0;
}
EXPORT const char* fakehip_stats() {
  static thread_local std::string out;
  std::lock_guard<std::mutex> l(g_mu);
  std::ostringstream o;
  o << "{\"live_streams\":" << g_live_streams << ",\"live_graphs\":" << g_live_graphs
    << ",\"live_execs\":" << g_live_execs << ",\"live_events\":" << g_live_events
    << ",\"signal_allocs\":" << g_signal_allocs << ",\"destroyed_nodes\":" << g_destroyed_nodes
    << ",\"wait_timeouts\":" << g_wait_timeouts << ",\"late_flushes\":" << g_late_flushes
    << ",\"last_error\":" << g_last << ",\"end_captures\":[";
  for (size_t i = 0; i < g_end_log.size(); ++i)
    o << (i ? "," : "") << "{\"nodes\":" << g_end_log[i].nodes << ",\"memop_nodes\":" << g_end_log[i].memop_nodes
      << ",\"unjoined\":" << g_end_log[i].unjoined << ",\"rc\":" << g_end_log[i].rc << "}";
  o << "],\"calls\":{";
  bool first = true;
  for (auto& kv : g_calls) o << (first ? "" : ",") << "\"" << kv.first << "\":" << kv.second, first = false;
  o << "}}";
  out = o.str();
  return out.c_str();
}

// ---- device, version, errors ----------------------------------------------------------------------
EXPORT E hipGetDeviceCount(int* n) {
  FAIL_POINT("hipGetDeviceCount");
  *n = cfg().devices;
  return *n > 0 ? OK : set_err(NO_DEVICE);
}
EXPORT E hipSetDevice(int d) {
  FAIL_POINT("hipSetDevice");
  if (d < 0 || d >= cfg().devices) return set_err(INVALID_DEVICE);
  g_device = d;
  return OK;
}
EXPORT E hipGetDevice(int* d) { return *d = g_device, OK; }
EXPORT E hipDeviceGetAttribute(int* v, int attr, int) {
  *v = attr == 10013 ? 1 : 0;  // hipDeviceAttributeCanUseStreamWaitValue
  return OK;
}
EXPORT E hipRuntimeGetVersion(int* v) { return *v = cfg().version, OK; }
EXPORT E hipDriverGetVersion(int* v) { return *v = cfg().version, OK; }
EXPORT E hipGetLastError() {
  const E e = g_last;
  g_last = OK;
  return e;
}
EXPORT E hipPeekAtLastError() { return g_last; }
EXPORT const char* hipGetErrorName(E e) { return err_name(e); }
EXPORT const char* hipGetErrorString(E e) { return err_name(e); }

// ---- memory ----------------------------------------------------------------------------------------
EXPORT E hipExtMallocWithFlags(void** p, size_t n, unsigned flags) {
  FAIL_POINT("hipExtMallocWithFlags");
  if (flags == 0x2 && n != 8) return set_err(INVALID);  // signal memory is one 64-bit word
  *p = std::aligned_alloc(64, (n + 63) / 64 * 64);
  std::memset(*p, 0, n);
  std::lock_guard<std::mutex> l(g_mem_mu);
  (flags == 0x2 ? g_signal : g_device_mem)[(uintptr_t)*p] = n;
  if (flags == 0x2) ++g_signal_allocs;
  return OK;
}
EXPORT E hipMalloc(void** p, size_t n) {
  FAIL_POINT("hipMalloc");
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256);
  std::lock_guard<std::mutex> l(g_mem_mu);
  g_device_mem[(uintptr_t)*p] = n;
  return OK;
}
EXPORT E hipFree(void* p) {
  if (!p) return OK;
  {
    std::lock_guard<std::mutex> l(g_mem_mu);
    if (g_signal.erase((uintptr_t)p)) --g_signal_allocs;
    else if (!g_device_mem.erase((uintptr_t)p)) return set_err(INVALID);
  }
  std::free(p);
  return OK;
}
EXPORT E hipHostRegister(void* p, size_t n, unsigned) {
  FAIL_POINT("hipHostRegister");
  std::lock_guard<std::mutex> l(g_mem_mu);
  if (g_registered.count((uintptr_t)p)) return set_err(ALREADY);
  g_registered[(uintptr_t)p] = n;
  return OK;
}
EXPORT E hipHostUnregister(void* p) {
  std::lock_guard<std::mutex> l(g_mem_mu);
  return g_registered.erase((uintptr_t)p) ? OK : set_err(NOT_REGISTERED);
}
EXPORT E hipHostGetDevicePointer(void** d, void* h, unsigned) {
  std::lock_guard<std::mutex> l(g_mem_mu);
  if (!in(g_registered, h, 1)) return set_err(INVALID);
  return *d = h, OK;
}
EXPORT E hipMemcpyAsync(void* dst, const void* src, size_t n, int kind, void* s) {
  FAIL_POINT("hipMemcpyAsync");
  Stream* st = S(s);
  const bool d2h = kind == 2;
  st->add(NODE_MEMCPY, [=](Stream& run) {
    if (d2h && cfg().late) {  // not visible to the host yet
      std::lock_guard<std::mutex> l(run.pend_mu);
      run.pending.push_back({dst, std::vector<char>((const char*)src, (const char*)src + n)});
    } else {
      std::memcpy(dst, src, n);
    }
  });
  return OK;
}

// ---- streams -----------------------------------------------------------------------------------------
#ifndef FAKEHIP_NO_STREAM_CREATE
EXPORT E hipStreamCreateWithFlags(void** s, unsigned) {
  FAIL_POINT("hipStreamCreateWithFlags");
  return *s = new Stream, OK;
}
#endif
EXPORT E hipStreamDestroy(void* s) {
  if (!s) return set_err(INVALID_HANDLE);
  return delete static_cast<Stream*>(s), OK;
}
EXPORT E hipStreamQuery(void* s) {
  Stream* st = S(s);
  if (!st->idle()) return NOT_READY;  // not an error: never sets the last error
  st->flush();                        // a host synchronisation point makes copies visible
  return OK;
}
EXPORT E hipStreamSynchronize(void* s) {
  Stream* st = S(s);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!st->idle() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  st->flush();
  return OK;
}
EXPORT E hipStreamIsCapturing(void* s, int* st) {
  if (!s) return *st = 0, OK;
  return *st = S(s)->capturing ? 1 : 0, OK;
}

// Memops: recorded, executed at once, or dropped while the stream captures.
E memop(const char* api, void* s, void* ptr, std::function<void(Stream&)> run) {
  FAIL_POINT(api);
  if (!is_signal(ptr)) return set_err(INVALID);  // only signal memory (and HIP-known memory) qualifies
  Stream* st = S(s);
  if (st->capturing) {
    const std::string mode = cfg().capture;
    if (mode == "drop") return OK;
    if (mode == "eager") return st->enqueue(std::move(run)), OK;  // runs now, nothing recorded
    st->record(NODE_BATCH_MEMOP, std::move(run));
    return OK;
  }
  st->enqueue(std::move(run));
  return OK;
}
EXPORT E hipStreamWriteValue64(void* s, void* ptr, uint64_t v, unsigned) {
  return memop("hipStreamWriteValue64", s, ptr, [=](Stream& st) { run_write(st, (uint64_t*)ptr, v); });
}
EXPORT E hipStreamWaitValue64(void* s, void* ptr, uint64_t v, unsigned flags, uint64_t mask) {
  if (flags != 0) return set_err(INVALID);  // only Gte is modelled
  return memop("hipStreamWaitValue64", s, ptr, [=](Stream& st) { run_wait(st, (const uint64_t*)ptr, v, mask); });
}

// ---- capture and graphs ---------------------------------------------------------------------------------
EXPORT E hipStreamBeginCapture(void* s, int) {
  FAIL_POINT("hipStreamBeginCapture");
  if (!s) return set_err(CAPTURE_IMPLICIT);
  Stream* st = S(s);
  if (st->capturing) return set_err(INVALID);
  static std::atomic<unsigned long long> ids{0};
  st->capturing = true, st->graph = new Graph, st->deps.clear(), st->capture_id = ++ids;
  ++g_live_graphs;
  return OK;
}
EXPORT E hipStreamGetCaptureInfo_v2(void* s, int* status, unsigned long long* id, void** graph, const void*** deps,
                                    size_t* ndeps) {
  FAIL_POINT("hipStreamGetCaptureInfo_v2");
  Stream* st = S(s);
  if (status) *status = st->capturing ? 1 : 0;
  if (id) *id = st->capture_id;
  if (graph) *graph = st->capturing ? st->graph : nullptr;
  if (deps) *deps = st->capturing ? (const void**)st->deps.data() : nullptr;
  if (ndeps) *ndeps = st->capturing ? st->deps.size() : 0;
  return OK;
}
EXPORT E hipStreamUpdateCaptureDependencies(void* s, void** nodes, size_t n, unsigned flags) {
  FAIL_POINT("hipStreamUpdateCaptureDependencies");
  Stream* st = S(s);
  if (!st->capturing) return set_err(CAPTURE_INVALIDATED);
  std::vector<Node*> add((Node**)nodes, (Node**)nodes + n);
  if (flags == 1) st->deps = add;  // Set
  else st->deps.insert(st->deps.end(), add.begin(), add.end());
  return OK;
}
EXPORT E hipStreamEndCapture(void* s, void** g) {
  Stream* st = S(s);
  if (!st->capturing) return set_err(CAPTURE_UNMATCHED);
  Graph* graph = st->graph;
  st->capturing = false, st->graph = nullptr;
  *g = nullptr;
  // Unjoined: a node nothing depends on that is not among the final dependencies.
  std::set<Node*> has_dependent;
  size_t memop_nodes = 0;
  for (Node* n : graph->nodes) {
    for (Node* d : n->deps) has_dependent.insert(d);
    memop_nodes += n->type == NODE_BATCH_MEMOP;
  }
  size_t unjoined = 0;
  for (Node* n : graph->nodes)
    if (!has_dependent.count(n) && std::find(st->deps.begin(), st->deps.end(), n) == st->deps.end()) ++unjoined;
  E rc = unjoined ? CAPTURE_UNJOINED : OK;
  if (E injected = inject("hipStreamEndCapture")) rc = injected;  // counted here: the capture ends either way
  {
    std::lock_guard<std::mutex> l(g_mu);
    g_end_log.push_back({graph->nodes.size(), memop_nodes, unjoined, rc});
  }
  st->deps.clear();
  if (rc != OK) {
    delete graph;
    --g_live_graphs;
    return set_err(rc);
  }
  *g = graph;
  return OK;
}
EXPORT E hipGraphCreate(void** g, unsigned) {
  ++g_live_graphs;
  return *g = new Graph, OK;
}
EXPORT E hipGraphDestroy(void* g) {
  if (!g) return set_err(INVALID);
  --g_live_graphs;
  return delete static_cast<Graph*>(g), OK;
}
EXPORT E hipGraphGetNodes(void* g, void** nodes, size_t* n) {
  auto* gr = static_cast<Graph*>(g);
  if (nodes)
    for (size_t i = 0; i < gr->nodes.size() && i < *n; ++i) nodes[i] = gr->nodes[i];
  *n = gr->nodes.size();
  return OK;
}
EXPORT E hipGraphNodeGetType(void* node, int* t) { return *t = static_cast<Node*>(node)->type, OK; }
EXPORT E hipGraphDestroyNode(void* node) {
  FAIL_POINT("hipGraphDestroyNode");
  auto* n = static_cast<Node*>(node);
  std::lock_guard<std::mutex> l(g_mu);
  auto& v = n->graph->nodes;
  v.erase(std::remove(v.begin(), v.end(), n), v.end());
  for (Node* o : v) o->deps.erase(std::remove(o->deps.begin(), o->deps.end(), n), o->deps.end());
  delete n;
  ++g_destroyed_nodes;
  return OK;
}
#ifndef FAKEHIP_NO_BATCH_NODE
EXPORT E hipGraphAddBatchMemOpNode(void** out, void* g, void* const* deps, size_t ndeps, const NodeParams* p) {
  FAIL_POINT("hipGraphAddBatchMemOpNode");
  if (!p || p->count < 1 || p->count > 256 || !p->paramArray || p->flags) return set_err(INVALID);
  for (unsigned i = 0; i < p->count; ++i) {
    const int op = p->paramArray[i].operation;
    if ((op != 4 && op != 5) || !is_signal(p->paramArray[i].op.address)) return set_err(INVALID);
  }
  const Config c = cfg();
  std::function<void(Stream&)> run;
  const unsigned count = p->count;
  if (c.keep_params) {  // before HIP 10: the node reads the caller's array at every replay
    const BatchParams* arr = p->paramArray;
    run = [arr, count, c](Stream& st) { run_batch(st, arr, count, c.unordered); };
  } else {
    std::vector<BatchParams> copy(p->paramArray, p->paramArray + count);
    run = [copy, count, c](Stream& st) { run_batch(st, copy.data(), count, c.unordered); };
  }
  auto* graph = static_cast<Graph*>(g);
  std::lock_guard<std::mutex> l(g_mu);
  Node* n = new Node{NODE_BATCH_MEMOP, std::move(run), std::vector<Node*>((Node**)deps, (Node**)deps + ndeps), graph};
  graph->nodes.push_back(n);
  *out = n;
  return OK;
}
#endif
EXPORT E hipGraphInstantiate(void** e, void* g, void**, char*, size_t) {
  FAIL_POINT("hipGraphInstantiate");
  auto* gr = static_cast<Graph*>(g);
  // Kahn's order over the dependency edges; among ready nodes, capture order.
  auto* ex = new Exec;
  std::set<Node*> done;
  std::vector<Node*> left = gr->nodes;
  while (!left.empty()) {
    auto it = std::find_if(left.begin(), left.end(), [&](Node* n) {
      return std::all_of(n->deps.begin(), n->deps.end(), [&](Node* d) { return done.count(d) > 0; });
    });
    if (it == left.end()) {
      delete ex;
      return set_err(INVALID);  // a cycle or a dependency outside the graph
    }
    ex->ops.push_back((*it)->run);
    done.insert(*it);
    left.erase(it);
  }
  ++g_live_execs;
  return *e = ex, OK;
}
EXPORT E hipGraphLaunch(void* e, void* s) {
  FAIL_POINT("hipGraphLaunch");
  for (auto& op : static_cast<Exec*>(e)->ops) S(s)->enqueue(op);
  return OK;
}
EXPORT E hipGraphExecDestroy(void* e) {
  --g_live_execs;
  return delete static_cast<Exec*>(e), OK;
}

// ---- events ---------------------------------------------------------------------------------------------
EXPORT E hipEventCreateWithFlags(void** ev, unsigned flags) {
  FAIL_POINT("hipEventCreateWithFlags");
  ++g_live_events;
  return *ev = new Event{flags}, OK;
}
EXPORT E hipEventDestroy(void* ev) {
  --g_live_events;
  return delete static_cast<Event*>(ev), OK;
}
EXPORT E hipEventSynchronize(void*) { return OK; }
E record(const char* api, void* ev, void* s, unsigned flags) {
  FAIL_POINT(api);
  if (!ev) return set_err(INVALID_HANDLE);
  if (flags > 1) return set_err(INVALID);
  Stream* st = S(s);
  const bool release = static_cast<Event*>(ev)->flags & EV_RELEASE_TO_SYSTEM;
  auto run = [release](Stream& r) {
    if (release) r.flush();  // system-scope release: earlier copies become host-visible
  };
  if (st->capturing) {
    // A plain record under capture only marks a dependency: no node, nothing replayed.
    if (flags == 1) st->record(NODE_EVENT_RECORD, run);
    return OK;
  }
  st->enqueue(run);
  return OK;
}
EXPORT E hipEventRecord(void* ev, void* s) { return record("hipEventRecord", ev, s, 0); }
#ifndef FAKEHIP_NO_RECORD_WITH_FLAGS
EXPORT E hipEventRecordWithFlags(void* ev, void* s, unsigned flags) {
  return record("hipEventRecordWithFlags", ev, s, flags);
}
#endif

// ---- host functions ------------------------------------------------------------------------------------
#ifndef FAKEHIP_NO_HOSTFUNC
EXPORT E hipLaunchHostFunc(void* s, void (*fn)(void*), void* ud) {
  FAIL_POINT("hipLaunchHostFunc");
  S(s)->add(NODE_HOST, [=](Stream&) { fn(ud); });
  return OK;
}
#endif
EXPORT E hipGraphAddHostNode(void** out, void* g, void* const* deps, size_t ndeps, const void* params) {
  struct P {
    void (*fn)(void*);
    void* ud;
  };
  const P p = *static_cast<const P*>(params);
  auto* graph = static_cast<Graph*>(g);
  std::lock_guard<std::mutex> l(g_mu);
  Node* n = new Node{NODE_HOST, [p](Stream&) { p.fn(p.ud); }, std::vector<Node*>((Node**)deps, (Node**)deps + ndeps),
                     graph};
  graph->nodes.push_back(n);
  *out = n;
  return OK;
}

// ---- modules ---------------------------------------------------------------------------------------------
EXPORT E hipModuleLoadData(void** m, const void* image) {
  FAIL_POINT("hipModuleLoadData");
  if (!image || std::memcmp(image, kModuleTag, sizeof kModuleTag - 1) != 0) return set_err(NO_BINARY);
  return *m = (void*)&g_fill_kernel, OK;
}
EXPORT E hipModuleUnload(void*) { return OK; }
EXPORT E hipModuleGetFunction(void** f, void* m, const char* name) {
  if (m != &g_fill_kernel || std::string(name) != "fill_u32") return set_err(NOT_FOUND);
  return *f = (void*)&g_fill_kernel, OK;
}
EXPORT E hipModuleLaunchKernel(void* f, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               void* s, void** args, void**) {
  FAIL_POINT("hipModuleLaunchKernel");
  if (f != &g_fill_kernel || !args) return set_err(INVALID);
  uint32_t* dst = *static_cast<uint32_t**>(args[0]);
  const uint32_t value = *static_cast<uint32_t*>(args[1]), n = *static_cast<uint32_t*>(args[2]);
  S(s)->add(NODE_KERNEL, [=](Stream&) {
    for (uint32_t i = 0; i < n; ++i) dst[i] = value;
  });
  return OK;
}
