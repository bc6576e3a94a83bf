// Python-side holders of the C ABI's handles, shared by gpusync-cuda's and
// gpusync-hip's pybind11 modules: a Python Device / Iob and a C consumer
// (kernelio) share one device and one registration. C++ and pybind11 only,
// internal to the two backends.
//
// Include it in the backend's bindings.cpp AFTER the backend's capi.h: it uses
// gpusync::api(), device_of(), iob_of(), Device, Iob and Error.
#ifndef GPUSYNC_PY_OBJECTS_H
#define GPUSYNC_PY_OBJECTS_H
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cpumoe_executor/abi.h"
#include "gpusync/abi.h"

namespace gpusync {
// Unnamed: both backends' modules load into one process and pybind11 keys its
// registry by C++ type; types in an unnamed namespace stay distinct per module
// (a named gpusync::PyDevice would make the second import fail with
// 'type "Device" is already registered').
namespace {

struct PyDevice {
  gpusync_device* h;
  explicit PyDevice(int ordinal) {
    if (const int rc = api()->device_open(ordinal, &h)) throw Error(rc, api()->last_error());
  }
  ~PyDevice() { api()->device_close(h); }
  Device& d() const { return *device_of(h); }
};

// The executor's table from its capsule, refused (naming both versions) unless
// this build can bind it.
const cpumoe_executor_api* executor_api_of(pybind11::capsule cap) {
  const char* name = cap.name();
  if (!name || std::string(name) != CPUMOE_EXECUTOR_CAPSULE_NAME)
    throw Error(GPUSYNC_E_INVALID, std::string("expected the capsule ") + CPUMOE_EXECUTOR_CAPSULE_NAME + ", got " +
                                       (name ? name : "an unnamed capsule") +
                                       "; install a cpumoe-executor with ABI major " +
                                       std::to_string(CPUMOE_EXECUTOR_ABI_MAJOR));
  auto* a = static_cast<const cpumoe_executor_api*>(cap.get_pointer());
  char err[512];
  if (cpumoe_executor_check_api(a, err, sizeof err)) throw Error(GPUSYNC_E_INVALID, err);
  return a;
}

struct PyIob {
  std::shared_ptr<PyDevice> dev;  // keeps the device open while the block is registered
  pybind11::object exec_ref;      // keeps the executor alive
  gpusync_iob* h = nullptr;
  PyIob(std::shared_ptr<PyDevice> d, pybind11::capsule cap, uint64_t handle, pybind11::object keep)
      : dev(std::move(d)), exec_ref(std::move(keep)) {
    const cpumoe_executor_api* a = executor_api_of(cap);
    if (const int rc = api()->iob_register(dev->h, a, reinterpret_cast<cpumoe_executor*>(handle), &h))
      throw Error(rc, api()->last_error());
  }
  ~PyIob() { api()->iob_release(h); }
  Iob& b() const { return *iob_of(h); }
};

}  // namespace
}  // namespace gpusync
#endif  // GPUSYNC_PY_OBJECTS_H
