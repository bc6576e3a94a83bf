// Explicit batch-memop graph nodes spliced into a running stream capture: the
// way to record a stream memop on ROCm before HIP 10, whose runtime executes
// hipStreamWrite/WaitValue64 at once on a capturing stream and records nothing
// (notes 2.3). One op per node (before HIP 10 the ops of one node may run in
// parallel), chained by the capture's own dependency set; the parameter array
// lives in a ParamStore (before HIP 10 the node keeps the caller's pointer).
#pragma once
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>

#include "runtime.h"

namespace gpusync {

// Stable, deduplicated storage for batch-memop parameters: an entry is never
// moved or freed while the store lives (it is owned by the IO block, which
// outlives every graph that uses it), and the same op gets the same address in
// every capture and rebuild.
class ParamStore {
 public:
  hipStreamBatchMemOpParams* write64(void* addr, uint64_t value);
  hipStreamBatchMemOpParams* wait_gte64(void* addr, uint64_t value);
  size_t size() const;

 private:
  hipStreamBatchMemOpParams* get(int op, void* addr, uint64_t value, unsigned flags);
  mutable std::mutex mu_;
  std::deque<hipStreamBatchMemOpParams> items_;  // deque: push_back never moves existing entries
  std::map<std::tuple<int, void*, uint64_t, unsigned>, hipStreamBatchMemOpParams*> index_;
};

// Append ONE batch-memop node after the capture's current dependencies and make
// it the only dependency (so the next captured op, or the next splice, follows
// it). Seed 000's rollback: if the dependency update fails, the node just added
// is destroyed (else it dangles unjoined and EndCapture fails with
// hipErrorStreamCaptureUnjoined) and the ORIGINAL error is returned.
// `what` names the op in errors; throws Error on failure.
void splice_memop(const Runtime& rt, hipStream_t s, hipStreamBatchMemOpParams* op, const char* what);
}  // namespace gpusync
