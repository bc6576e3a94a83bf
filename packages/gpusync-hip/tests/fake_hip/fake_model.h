// The fake HIP runtime's CPU model (private to fake_libamdhip64.cpp, which exports the HIP entry points
// over it): configuration and fault injection, memory, streams as worker threads, graphs, events, batch
// memop parameters. See fake_libamdhip64.cpp for the modes.
#pragma once
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

// The trace (fakehip_trace): every stream operation accepted, in issue order, one JSON object each: copies,
// memop writes and waits, event records, host functions, batch-memop nodes, graph launches. "cap": the stream
// was capturing when it was issued. Cleared by configure() and fakehip_trace_clear().
std::mutex g_trace_mu;
std::vector<std::string> g_trace;
void trace(const std::string& entry) {
  std::lock_guard<std::mutex> l(g_trace_mu);
  g_trace.push_back(entry);
}
std::string ptr(const void* p) { return std::to_string((uintptr_t)p); }

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
  {
    std::lock_guard<std::mutex> l(g_trace_mu);
    g_trace.clear();
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
