// A fake libcuda.so.1 for CPU-only tests of gpusync-cuda's control logic
// (design.md principle 7): streams are worker threads that run their ops in
// order (copies, 64-bit memop writes and GEQ waits, host functions), capture
// records ops into a graph, graphs replay them. "Device" pointers are host
// pointers. Only cuGetProcAddress_v2 and cuDriverGetVersion are exported, so
// the loader must resolve everything through the versioned query.
//
// FAKE_CUDA_FAULT selects a fault: drop_memops_in_capture (success, nothing
// recorded: the silent failure of notes E1), reject_memops_in_capture,
// no_memop_attr, no_hostfunc, no_device. Modules always fail to load
// (CUDA_ERROR_NO_BINARY_FOR_GPU), which exercises kernelio's fallback.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {
using Res = int;
constexpr Res OK = 0, INVALID = 1, NO_DEVICE = 100, NO_BINARY = 209, NOT_READY = 600, ALREADY = 712;

std::string fault() {
  const char* f = std::getenv("FAKE_CUDA_FAULT");
  return f ? f : "";
}

struct Op {
  int type;  // graph node type: 1 memcpy, 3 host, 12 memop
  std::function<void(const std::atomic<bool>&)> run;
};

struct Stream {
  std::mutex m;
  std::condition_variable cv;
  std::deque<Op> q;
  bool busy = false, stop = false;
  std::atomic<bool> cancel{false};
  int capture = 0;  // 0 none, 1 active
  std::vector<Op>* graph = nullptr;
  std::thread t;
  Stream() {
    t = std::thread([this] {
      for (;;) {
        Op op;
        {
          std::unique_lock<std::mutex> l(m);
          cv.wait(l, [this] { return stop || !q.empty(); });
          if (stop && q.empty()) return;
          op = std::move(q.front());
          q.pop_front();
          busy = true;
        }
        op.run(cancel);
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
  Res add(Op op) {
    std::lock_guard<std::mutex> l(m);
    if (capture) {
      graph->push_back(std::move(op));
      return OK;
    }
    q.push_back(std::move(op));
    cv.notify_all();
    return OK;
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
std::mutex g_reg_mu;
std::set<void*> g_registered;
thread_local int g_ctx_depth = 0;
int g_ctx_token;

Res cuInit(unsigned) { return fault() == "no_device" ? NO_DEVICE : OK; }
Res fake_cuDriverGetVersion(int* v) { return *v = 13000, OK; }
Res cuGetErrorName(Res r, const char** s) {
  static thread_local std::string n;
  n = r == INVALID ? "CUDA_ERROR_INVALID_VALUE" : r == NO_BINARY ? "CUDA_ERROR_NO_BINARY_FOR_GPU"
      : r == NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_" + std::to_string(r);
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
  return S(s)->add({1, [=](const std::atomic<bool>&) { std::memcpy((void*)dst, (const void*)src, n); }});
}
Res cuMemcpyAsync(uint64_t d, uint64_t s, size_t n, void* st) { return copy(d, s, n, st); }
Res cuMemcpyDtoHAsync(void* d, uint64_t s, size_t n, void* st) { return copy((uint64_t)(uintptr_t)d, s, n, st); }
Res cuMemcpyHtoDAsync(uint64_t d, const void* s, size_t n, void* st) { return copy(d, (uint64_t)(uintptr_t)s, n, st); }
Res cuStreamCreate(void** s, unsigned) { return *s = new Stream, OK; }
Res cuStreamDestroy(void* s) { return delete static_cast<Stream*>(s), OK; }
Res cuStreamQuery(void* s) { return S(s)->idle() ? OK : NOT_READY; }
Res cuStreamSynchronize(void* s) {
  while (!S(s)->idle()) std::this_thread::yield();
  return OK;
}
Res cuStreamIsCapturing(void* s, int* st) { return *st = S(s)->capture, OK; }
Res memop(void* s, std::function<void(const std::atomic<bool>&)> f) {
  Stream* st = S(s);
  if (st->capture && fault() == "drop_memops_in_capture") return OK;
  if (st->capture && fault() == "reject_memops_in_capture") return INVALID;
  return st->add({12, std::move(f)});
}
Res cuStreamWriteValue64(void* s, uint64_t a, uint64_t v, unsigned fl) {
  if (fl) return INVALID;  // NO_MEMORY_BARRIER is rejected by the v2 API
  return memop(s, [=](const std::atomic<bool>&) { __atomic_store_n((uint64_t*)a, v, __ATOMIC_SEQ_CST); });
}
Res cuStreamWaitValue64(void* s, uint64_t a, uint64_t v, unsigned fl) {
  if (fl) return INVALID;
  return memop(s, [=](const std::atomic<bool>& cancel) {
    while ((int64_t)(__atomic_load_n((uint64_t*)a, __ATOMIC_ACQUIRE) - v) < 0 && !cancel) std::this_thread::yield();
  });
}
Res cuLaunchHostFunc(void* s, void (*fn)(void*), void* ud) {
  return S(s)->add({3, [=](const std::atomic<bool>&) { fn(ud); }});
}
Res cuStreamBeginCapture(void* s, int) {
  Stream* st = S(s);
  std::lock_guard<std::mutex> l(st->m);
  if (st->capture) return INVALID;
  st->capture = 1, st->graph = new std::vector<Op>;
  return OK;
}
Res cuStreamEndCapture(void* s, void** g) {
  Stream* st = S(s);
  std::lock_guard<std::mutex> l(st->m);
  if (!st->capture) return INVALID;
  *g = st->graph, st->capture = 0, st->graph = nullptr;
  return OK;
}
Res cuGraphInstantiateWithFlags(void** e, void* g, unsigned long long) {
  return *e = new std::vector<Op>(*static_cast<std::vector<Op>*>(g)), OK;
}
Res cuGraphLaunch(void* e, void* s) {
  for (const Op& op : *static_cast<std::vector<Op>*>(e)) S(s)->add(op);
  return OK;
}
Res cuGraphExecDestroy(void* e) { return delete static_cast<std::vector<Op>*>(e), OK; }
Res cuGraphDestroy(void* g) { return delete static_cast<std::vector<Op>*>(g), OK; }
Res cuGraphGetNodes(void* g, void** nodes, size_t* n) {
  auto* v = static_cast<std::vector<Op>*>(g);
  if (nodes)
    for (size_t i = 0; i < v->size() && i < *n; ++i) nodes[i] = &(*v)[i];
  *n = v->size();
  return OK;
}
Res cuGraphNodeGetType(void* node, int* t) { return *t = static_cast<Op*>(node)->type, OK; }
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
}
