#include "splice.h"

#include "gpusync/abi.h"

namespace gpusync {

hipStreamBatchMemOpParams* ParamStore::get(int op, void* addr, uint64_t value, unsigned flags) {
  std::lock_guard<std::mutex> g(mu_);
  const auto key = std::make_tuple(op, addr, value, flags);
  auto it = index_.find(key);
  if (it != index_.end()) return it->second;
  hipStreamBatchMemOpParams p{};
  if (op == hipStreamMemOpWriteValue64) {
    p.writeValue.operation = op, p.writeValue.address = addr, p.writeValue.value64 = value;
    p.writeValue.flags = flags;
  } else {
    p.waitValue.operation = op, p.waitValue.address = addr, p.waitValue.value64 = value;
    p.waitValue.flags = flags;
  }
  items_.push_back(p);
  return index_[key] = &items_.back();
}

hipStreamBatchMemOpParams* ParamStore::write64(void* addr, uint64_t value) {
  return get(hipStreamMemOpWriteValue64, addr, value, hipStreamWriteValueDefault);
}

hipStreamBatchMemOpParams* ParamStore::wait_gte64(void* addr, uint64_t value) {
  return get(hipStreamMemOpWaitValue64, addr, value, hipStreamWaitValueGte);
}

size_t ParamStore::size() const {
  std::lock_guard<std::mutex> g(mu_);
  return items_.size();
}

void splice_memop(const Runtime& rt, hipStream_t s, hipStreamBatchMemOpParams* op, const char* what) {
  if (!rt.has_splice())
    throw Error(GPUSYNC_E_UNSUPPORTED, std::string(what) + ": explicit batch-memop nodes need hipStreamGetCaptureInfo_v2, "
                                       "hipGraphAddBatchMemOpNode (HIP 6.4+), hipStreamUpdateCaptureDependencies and "
                                       "hipGraphDestroyNode; the runtime lacks some");
  hipStreamCaptureStatus st = hipStreamCaptureStatusNone;
  unsigned long long id = 0;
  hipGraph_t graph = nullptr;
  const hipGraphNode_t* deps = nullptr;
  size_t ndeps = 0;
  hipError_t rc = rt.hipStreamGetCaptureInfo_v2(s, &st, &id, &graph, &deps, &ndeps);
  if (rc != hipSuccess) rt.fail(rc, std::string("hipStreamGetCaptureInfo_v2 (splicing ") + what + ")");
  if (st != hipStreamCaptureStatusActive || !graph)
    throw Error(GPUSYNC_E_CAPTURE_REFUSED, std::string(what) + ": the stream is not capturing (status " +
                                               std::to_string(st) + "): nothing to splice into");
  const hipBatchMemOpNodeParams params{nullptr, 1, op, 0};  // ctx: the current device's
  hipGraphNode_t node = nullptr;
  rc = rt.hipGraphAddBatchMemOpNode(&node, graph, deps, ndeps, &params);
  if (rc != hipSuccess) rt.fail(rc, std::string("hipGraphAddBatchMemOpNode(") + what + ")");
  rc = rt.hipStreamUpdateCaptureDependencies(s, &node, 1, hipStreamSetCaptureDependencies);
  if (rc != hipSuccess) {
    rt.hipGraphDestroyNode(node);  // rollback: never leave an unjoined node in the capture
    rt.fail(rc, std::string("hipStreamUpdateCaptureDependencies(") + what + " node)",
            " [the node was removed again; the capture is intact but lacks it, so it must be abandoned]");
  }
}
}  // namespace gpusync
