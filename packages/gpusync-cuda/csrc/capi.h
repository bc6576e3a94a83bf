#pragma once
#include <memory>

#include "gpusync/abi.h"
#include "iob.h"

namespace gpusync {
const gpusync_api* api();
// The Python bindings hold the same objects the C ABI hands out, so a Python
// CudaSync and a C consumer (kernelio) share one device and one registration.
gpusync_device* wrap_device(std::shared_ptr<Device> d);
std::shared_ptr<Device> device_of(gpusync_device* d);
Iob* iob_of(gpusync_iob* b);
}  // namespace gpusync
