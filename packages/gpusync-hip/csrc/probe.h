#pragma once
#include <string>

#include "iob.h"

namespace gpusync {
struct ProbeResult {
  bool safe = false;   // replay-safe: eager, capture and every replay matched the CPU bit for bit
  bool eager = false;  // the eager step matched (host-func: the only thing it may do on ROCm)
  std::string report;  // what ran and what was decided, or where and why it failed
};

// Needs the executor's coordinator running on the block's words (ready_word/done_word).
// path MEMOP (or KERNEL: its wait): decides the mechanism by a real capture,
//   instantiate and replay, never by version: native if the runtime records
//   memops under capture, else spliced batch-memop nodes, else unavailable.
//   forced: MECH_NATIVE / MECH_SPLICE to try only that one (-1: decide).
// path HOSTFN: the eager step only; never replay-safe on ROCm.
// Raises Error (and leaves it pending) if the caller already had a HIP error;
// consumes every error the probe itself created.
ProbeResult probe(Iob& b, int path, double timeout_s, int forced = -1);
}  // namespace gpusync
