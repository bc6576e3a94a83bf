// The gpusync C ABI table (abi.h) over a backend's C++ objects, shared by
// gpusync-cuda and gpusync-hip so the table, the handle checks and the error
// messages exist once. C++ only, header-only, internal to the two backends
// (consumers use abi.h). Exceptions become return codes and a thread-local
// message, so C consumers (kernelio, engines) never see C++.
//
// Include it in the backend's capi.cpp AFTER the backend's own headers: it uses
// gpusync::Device, gpusync::Iob, gpusync::Error (.code, .what()),
// ProbeResult probe(Iob&, int, double) and const char* path_name(int).
// The backend supplies what differs as a traits class B:
//   using Stream, Module, Function;       the runtime's handle types
//   kName, kBuildInfo                     the table's backend / build_info strings
//   in_device_scope(dev, op, f)           runs f for a device service; dev() resolves
//                                         the handle (only if the backend needs it)
//   mem_free(Device&, uint64_t)           Device::free in the backend's pointer type
//   memcpy_async(Device&, dst, src, n, Stream)
#ifndef GPUSYNC_BACKEND_CAPI_H
#define GPUSYNC_BACKEND_CAPI_H
#ifndef __cplusplus
#error "gpusync/backend_capi.h is C++ only; C consumers include gpusync/abi.h"
#endif
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "gpusync/abi.h"

struct gpusync_device {
  std::shared_ptr<gpusync::Device> dev;
};
struct gpusync_iob {
  std::unique_ptr<gpusync::Iob> iob;
};

namespace gpusync {

template <class B>
struct BackendCapi {
  using Stream = typename B::Stream;
  static inline thread_local std::string err;

  template <class F>
  static int guarded(F&& f) {
    try {
      f();
      return 0;
    } catch (const Error& e) {
      err = e.what();
      return e.code ? e.code : GPUSYNC_E_INTERNAL;
    } catch (const std::exception& e) {
      err = e.what();
      return GPUSYNC_E_INTERNAL;
    }
  }

  static Stream S(uint64_t s) { return reinterpret_cast<Stream>(static_cast<uintptr_t>(s)); }
  // Handles come from C callers as integers: a NULL one is an error, not a crash.
  static Device& D(gpusync_device* d) {
    if (!d || !d->dev) throw Error(GPUSYNC_E_INVALID, "gpusync: NULL device handle");
    return *d->dev;
  }
  static Iob& Blk(gpusync_iob* b) {
    if (!b || !b->iob) throw Error(GPUSYNC_E_INVALID, "gpusync: NULL IO block handle");
    return *b->iob;
  }
  // Device services: the backend may wrap them (HIP: an error scope).
  template <class F>
  static int scoped(gpusync_device* d, const char* op, F&& f) {
    return guarded([&] { B::in_device_scope([&]() -> Device& { return D(d); }, op, f); });
  }

  static const char* c_last_error() { return err.c_str(); }
  static int c_device_open(int ordinal, gpusync_device** out) {
    return guarded([&] { *out = new gpusync_device{std::make_shared<Device>(ordinal)}; });
  }
  static void c_device_close(gpusync_device* d) { delete d; }
  static int c_iob_register(gpusync_device* d, const cpumoe_executor_api* api, cpumoe_executor* e,
                            gpusync_iob** out) {
    return guarded([&] {
      D(d);
      *out = new gpusync_iob{std::make_unique<Iob>(d->dev, api, e)};
    });
  }
  static void c_iob_release(gpusync_iob* b) { delete b; }
  static int c_iob_device_ptr(gpusync_iob* b, const void* host, uint64_t* dptr) {
    return guarded([&] { *dptr = Blk(b).dptr(host); });
  }
  static int c_probe(gpusync_iob* b, int path, double timeout_s, int* safe, char* report, size_t n) {
    return guarded([&] {
      const ProbeResult r = probe(Blk(b), path, timeout_s);
      *safe = r.safe;
      if (report && n) std::snprintf(report, n, "%s", r.report.c_str());
    });
  }
  static int c_set_replay_safe(gpusync_iob* b, int path, int safe) {
    return guarded([&] { Blk(b).set_replay_safe(path, safe != 0); });
  }
  static int c_submit(gpusync_iob* b, int path, uint64_t s, uint32_t layer, uint32_t T) {
    return guarded([&] { Blk(b).submit(path, S(s), layer, T); });
  }
  static int c_wait(gpusync_iob* b, int path, uint64_t s) {
    return guarded([&] { Blk(b).wait(path, S(s)); });
  }
  static int c_step(gpusync_iob* b, int path, uint64_t s, uint32_t layer, uint32_t T, uint64_t x, uint64_t ids,
                    uint64_t w, uint64_t y) {
    return guarded([&] { Blk(b).step(path, S(s), layer, T, x, ids, w, y); });
  }
  static int c_step_submit(gpusync_iob* b, int path, uint64_t s, uint32_t layer, uint32_t T, uint64_t x,
                           uint64_t ids, uint64_t w) {
    return guarded([&] { Blk(b).step_submit(path, S(s), layer, T, x, ids, w); });
  }
  static int c_step_finish(gpusync_iob* b, int path, uint64_t s, uint32_t T, uint64_t y) {
    return guarded([&] { Blk(b).step_finish(path, S(s), T, y); });
  }
  static const char* c_path_name(int path) { return path_name(path); }
  static int c_capture_status(gpusync_device* d, uint64_t s, int* st) {
    return scoped(d, "capture status", [&] { *st = D(d).capture_status(S(s)); });
  }
  static int c_stream_sync(gpusync_device* d, gpusync_iob* b, uint64_t s, double timeout_s) {
    bool ok = true;
    const int rc = scoped(d, "stream sync", [&] { ok = b ? Blk(b).sync(S(s), timeout_s) : D(d).sync(S(s), timeout_s); });
    if (rc) return rc;
    if (!ok) {
      err = "stream did not complete within " + std::to_string(timeout_s) + " s" + (b ? " (released)" : "");
      return GPUSYNC_E_TIMEOUT;
    }
    return 0;
  }
  static int c_module_load(gpusync_device* d, const void* image, void** m) {
    return scoped(d, "module load", [&] { *m = D(d).module_load(image); });
  }
  static int c_module_unload(gpusync_device* d, void* m) {
    return scoped(d, "module unload", [&] { D(d).module_unload(static_cast<typename B::Module>(m)); });
  }
  static int c_module_function(gpusync_device* d, void* m, const char* name, void** fn) {
    return scoped(d, "module function", [&] { *fn = D(d).function(static_cast<typename B::Module>(m), name); });
  }
  static int c_launch(gpusync_device* d, void* fn, const uint32_t grid[3], const uint32_t block[3], uint32_t smem,
                      uint64_t s, void** args) {
    return scoped(d, "launch", [&] {
      D(d).launch(static_cast<typename B::Function>(fn), grid, block, smem, S(s), args);
    });
  }
  static int c_mem_alloc(gpusync_device* d, size_t n, uint64_t* p) {
    return scoped(d, "mem alloc", [&] { *p = D(d).alloc(n); });
  }
  static int c_mem_free(gpusync_device* d, uint64_t p) {
    return scoped(d, "mem free", [&] { B::mem_free(D(d), p); });
  }
  static int c_host_register(gpusync_device* d, void* host, size_t n, uint64_t* dptr) {
    return scoped(d, "host register", [&] {
      bool owned = false;
      *dptr = D(d).host_register(host, n, &owned);
    });
  }
  static int c_host_unregister(gpusync_device* d, void* host) {
    return scoped(d, "host unregister", [&] { D(d).host_unregister(host); });
  }
  static int c_memcpy_async(gpusync_device* d, uint64_t dst, uint64_t src, size_t n, uint64_t s) {
    return scoped(d, "memcpy", [&] { B::memcpy_async(D(d), dst, src, n, S(s)); });
  }

  // Field order is abi.h's; appended entries go at the end (minor bump).
  static constexpr gpusync_api kTable = {
      GPUSYNC_ABI_MAJOR, GPUSYNC_ABI_MINOR, sizeof(gpusync_api), CPUMOE_PROTOCOL_VERSION, B::kBuildInfo, B::kName,
      &c_last_error, &c_device_open, &c_device_close, &c_iob_register, &c_iob_release, &c_iob_device_ptr, &c_probe,
      &c_set_replay_safe, &c_submit, &c_wait, &c_step, &c_path_name, &c_capture_status, &c_stream_sync,
      &c_module_load, &c_module_unload, &c_module_function, &c_launch, &c_mem_alloc, &c_mem_free, &c_host_register,
      &c_host_unregister, &c_memcpy_async,
      // ABI 1.1
      &c_step_submit, &c_step_finish};
};

}  // namespace gpusync
#endif  // GPUSYNC_BACKEND_CAPI_H
