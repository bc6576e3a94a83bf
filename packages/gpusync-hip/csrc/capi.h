#pragma once
#include <memory>

#include "gpusync/abi.h"
#include "iob.h"

namespace gpusync {
const gpusync_api* api();
// The Python bindings hold the same objects the C ABI hands out, so a Python
// HipSync and a C consumer (kernelio) share one device and one registration.
std::shared_ptr<Device> device_of(gpusync_device* d);
Iob* iob_of(gpusync_iob* b);
}  // namespace gpusync
