// A fake libamdhip64 for CPU-only tests of gpusync-hip's control logic
// (docs/architecture.md, rule 7). A CPU model of the parts of the HIP runtime that
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
// call counts, the pending last error (without consuming it). fakehip_trace()
// returns every stream operation accepted, in issue order, as a JSON array
// (fakehip_trace_clear() empties it; so does fakehip_configure).
#include "fake_model.h"

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

EXPORT const char* fakehip_trace() {
  static thread_local std::string out;
  std::lock_guard<std::mutex> l(g_trace_mu);
  out = "[";
  for (size_t i = 0; i < g_trace.size(); ++i) out += (i ? "," : "") + g_trace[i];
  out += "]";
  return out.c_str();
}
EXPORT void fakehip_trace_clear() {
  std::lock_guard<std::mutex> l(g_trace_mu);
  g_trace.clear();
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
  trace("{\"op\":\"copy\",\"kind\":" + std::to_string(kind) + ",\"dst\":" + ptr(dst) + ",\"src\":" + ptr(src) +
        ",\"n\":" + std::to_string(n) + ",\"stream\":" + ptr(st) + ",\"cap\":" + (st->capturing ? "1" : "0") + "}");
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
E memop(const char* api, void* s, void* ptr, uint64_t v, std::function<void(Stream&)> run) {
  FAIL_POINT(api);
  if (!is_signal(ptr)) return set_err(INVALID);  // only signal memory (and HIP-known memory) qualifies
  Stream* st = S(s);
  trace(std::string("{\"op\":\"") + (std::strstr(api, "Write") ? "write" : "wait") + "\",\"addr\":" +
        ::ptr(ptr) + ",\"value\":" + std::to_string(v) + ",\"stream\":" + ::ptr(st) +
        ",\"cap\":" + (st->capturing ? "1" : "0") + "}");
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
  return memop("hipStreamWriteValue64", s, ptr, v, [=](Stream& st) { run_write(st, (uint64_t*)ptr, v); });
}
EXPORT E hipStreamWaitValue64(void* s, void* ptr, uint64_t v, unsigned flags, uint64_t mask) {
  if (flags != 0) return set_err(INVALID);  // only Gte is modelled
  return memop("hipStreamWaitValue64", s, ptr, v, [=](Stream& st) { run_wait(st, (const uint64_t*)ptr, v, mask); });
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
  std::string ops;
  for (unsigned i = 0; i < count; ++i)
    ops += std::string(i ? "," : "") + "[" + std::to_string(p->paramArray[i].operation) + "," +
           ptr(p->paramArray[i].op.address) + "," + std::to_string(p->paramArray[i].op.value64) + "]";
  trace("{\"op\":\"batch\",\"ops\":[" + ops + "],\"cap\":1}");
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
  trace("{\"op\":\"launch\",\"exec\":" + ptr(e) + ",\"stream\":" + ptr(S(s)) + ",\"cap\":0}");
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
  trace("{\"op\":\"event\",\"event\":" + ptr(ev) + ",\"release\":" + (release ? "1" : "0") + ",\"flags\":" +
        std::to_string(flags) + ",\"stream\":" + ptr(st) + ",\"cap\":" + (st->capturing ? "1" : "0") + "}");
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
  trace("{\"op\":\"host\",\"fn\":" + ptr((const void*)fn) + ",\"arg\":" + ptr(ud) + ",\"stream\":" + ptr(S(s)) +
        ",\"cap\":" + (S(s)->capturing ? "1" : "0") + "}");
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
