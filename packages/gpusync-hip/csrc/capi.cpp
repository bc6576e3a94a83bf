// The exported C ABI table (gpusync/abi.h, backend "hip"): exceptions become
// return codes and a thread-local message, so C consumers never see C++.
#include "capi.h"

#include <cstdio>
#include <cstring>

#include "probe.h"

struct gpusync_device {
  std::shared_ptr<gpusync::Device> dev;
};
struct gpusync_iob {
  std::unique_ptr<gpusync::Iob> iob;
};

namespace gpusync {
namespace {
thread_local std::string g_err;

template <class F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const Error& e) {
    g_err = e.what();
    return e.code ? e.code : GPUSYNC_E_INTERNAL;
  } catch (const std::exception& e) {
    g_err = e.what();
    return GPUSYNC_E_INTERNAL;
  }
}

hipStream_t S(uint64_t s) { return reinterpret_cast<hipStream_t>(static_cast<uintptr_t>(s)); }
Device& D(gpusync_device* d) {
  if (!d || !d->dev) throw Error(GPUSYNC_E_INVALID, "gpusync: NULL device handle");
  return *d->dev;
}
Iob& B(gpusync_iob* b) {
  if (!b || !b->iob) throw Error(GPUSYNC_E_INVALID, "gpusync: NULL IO block handle");
  return *b->iob;
}
// Device services run in the error scope too: a caller's pending error is
// raised, the errors they cause are consumed after being reported.
template <class F>
int scoped(gpusync_device* d, const char* op, F&& f) {
  return guarded([&] {
    ErrorScope scope(D(d).rt(), op);
    f();
  });
}

const char* c_last_error() { return g_err.c_str(); }
int c_device_open(int ordinal, gpusync_device** out) {
  return guarded([&] { *out = new gpusync_device{std::make_shared<Device>(ordinal)}; });
}
void c_device_close(gpusync_device* d) { delete d; }
int c_iob_register(gpusync_device* d, const cpumoe_executor_api* api, cpumoe_executor* e, gpusync_iob** out) {
  return guarded([&] {
    D(d);
    *out = new gpusync_iob{std::make_unique<Iob>(d->dev, api, e)};
  });
}
void c_iob_release(gpusync_iob* b) { delete b; }
int c_iob_device_ptr(gpusync_iob* b, const void* host, uint64_t* dptr) {
  return guarded([&] { *dptr = B(b).dptr(host); });
}
int c_probe(gpusync_iob* b, int path, double timeout_s, int* safe, char* report, size_t n) {
  return guarded([&] {
    const ProbeResult r = probe(B(b), path, timeout_s);
    *safe = r.safe;
    if (report && n) std::snprintf(report, n, "%s", r.report.c_str());
  });
}
int c_set_replay_safe(gpusync_iob* b, int path, int safe) {
  return guarded([&] { B(b).set_replay_safe(path, safe != 0); });
}
int c_submit(gpusync_iob* b, int path, uint64_t s, uint32_t layer, uint32_t T) {
  return guarded([&] { B(b).submit(path, S(s), layer, T); });
}
int c_wait(gpusync_iob* b, int path, uint64_t s) {
  return guarded([&] { B(b).wait(path, S(s)); });
}
int c_step(gpusync_iob* b, int path, uint64_t s, uint32_t layer, uint32_t T, uint64_t x, uint64_t ids, uint64_t w,
           uint64_t y) {
  return guarded([&] { B(b).step(path, S(s), layer, T, x, ids, w, y); });
}
const char* c_path_name(int path) { return path_name(path); }
int c_capture_status(gpusync_device* d, uint64_t s, int* st) {
  return scoped(d, "capture status", [&] { *st = D(d).capture_status(S(s)); });
}
int c_stream_sync(gpusync_device* d, gpusync_iob* b, uint64_t s, double timeout_s) {
  bool ok = true;
  const int rc = scoped(d, "stream sync", [&] { ok = b ? B(b).sync(S(s), timeout_s) : D(d).sync(S(s), timeout_s); });
  if (rc) return rc;
  if (!ok) {
    g_err = "stream did not complete within " + std::to_string(timeout_s) + " s" + (b ? " (released)" : "");
    return GPUSYNC_E_TIMEOUT;
  }
  return 0;
}
int c_module_load(gpusync_device* d, const void* image, void** m) {
  return scoped(d, "module load", [&] { *m = D(d).module_load(image); });
}
int c_module_unload(gpusync_device* d, void* m) {
  return scoped(d, "module unload", [&] { D(d).module_unload(static_cast<hipModule_t>(m)); });
}
int c_module_function(gpusync_device* d, void* m, const char* name, void** fn) {
  return scoped(d, "module function", [&] { *fn = D(d).function(static_cast<hipModule_t>(m), name); });
}
int c_launch(gpusync_device* d, void* fn, const uint32_t grid[3], const uint32_t block[3], uint32_t smem, uint64_t s,
             void** args) {
  return scoped(d, "launch", [&] { D(d).launch(static_cast<hipFunction_t>(fn), grid, block, smem, S(s), args); });
}
int c_mem_alloc(gpusync_device* d, size_t n, uint64_t* p) {
  return scoped(d, "mem alloc", [&] { *p = D(d).alloc(n); });
}
int c_mem_free(gpusync_device* d, uint64_t p) {
  return scoped(d, "mem free", [&] { D(d).free((void*)(uintptr_t)p); });
}
int c_host_register(gpusync_device* d, void* host, size_t n, uint64_t* dptr) {
  return scoped(d, "host register", [&] {
    bool owned = false;
    *dptr = D(d).host_register(host, n, &owned);
  });
}
int c_host_unregister(gpusync_device* d, void* host) {
  return scoped(d, "host unregister", [&] { D(d).host_unregister(host); });
}
int c_memcpy_async(gpusync_device* d, uint64_t dst, uint64_t src, size_t n, uint64_t s) {
  return scoped(d, "memcpy", [&] { D(d).memcpy_async(dst, src, n, hipMemcpyDefault, S(s)); });
}

#ifndef GPUSYNC_BUILD_INFO
#define GPUSYNC_BUILD_INFO "gpusync-hip unknown build"
#endif
const gpusync_api kApi = {
    GPUSYNC_ABI_MAJOR, GPUSYNC_ABI_MINOR, sizeof(gpusync_api), CPUMOE_PROTOCOL_VERSION, GPUSYNC_BUILD_INFO, "hip",
    &c_last_error, &c_device_open, &c_device_close, &c_iob_register, &c_iob_release, &c_iob_device_ptr, &c_probe,
    &c_set_replay_safe, &c_submit, &c_wait, &c_step, &c_path_name, &c_capture_status, &c_stream_sync,
    &c_module_load, &c_module_unload, &c_module_function, &c_launch, &c_mem_alloc, &c_mem_free, &c_host_register,
    &c_host_unregister, &c_memcpy_async};
}  // namespace

const gpusync_api* api() { return &kApi; }
std::shared_ptr<Device> device_of(gpusync_device* d) { return d->dev; }
Iob* iob_of(gpusync_iob* b) { return b->iob.get(); }
}  // namespace gpusync
