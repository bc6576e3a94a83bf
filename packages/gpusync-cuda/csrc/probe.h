#pragma once
#include <string>

#include "iob.h"

namespace gpusync {
struct ProbeResult {
  bool safe = false;   // eager, capture and every replay matched the CPU bit for bit
  std::string report;  // what ran, or where and why it failed
};
// Needs the executor's coordinator running on the block's words.
ProbeResult probe(Iob& b, int path, double timeout_s);
}  // namespace gpusync
