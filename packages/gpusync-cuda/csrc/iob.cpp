// The doorbell on a CUDA stream (protocol v1, docs/protocol.md).
#include "iob.h"

#include <cstdio>

#include "gpusync/backend_common.h"

namespace gpusync {
namespace {
using common::hex;
}  // namespace

const char* path_name(int path) { return common::path_name(path); }

Iob::Iob(std::shared_ptr<Device> dev, const cpumoe_executor_api* api, cpumoe_executor* exec)
    : dev_(std::move(dev)), api_(api), exec_(exec) {
  hdr_ = common::checked_iob<Error>(api, exec, "gpusync-cuda");
  // The whole block, header words included: the GPU writes ready/done and the
  // arrays through one device mapping.
  dbase_ = dev_->host_register(hdr_, hdr_->total_bytes, &owned_);
}

Iob::~Iob() {
  if (owned_) {
    try {
      dev_->host_unregister(hdr_);
    } catch (...) {  // never throw from a destructor; the process may be tearing down
    }
  }
}

CUdeviceptr Iob::dptr(const void* host) const {
  const char* p = static_cast<const char*>(host);
  const char* b = reinterpret_cast<const char*>(hdr_);
  if (p < b || p >= b + hdr_->total_bytes) throw Error(GPUSYNC_E_INVALID, "address is outside the IO block");
  return dbase_ + (uint64_t)(p - b);
}

void Iob::set_replay_safe(int path, bool on) {
  if (path < 0 || path >= GPUSYNC_PATH_COUNT) throw Error(GPUSYNC_E_INVALID, "no such path");
  safe_ = on ? (safe_ | (1u << path)) : (safe_ & ~(1u << path));
}

void Iob::check_task(uint32_t layer, uint32_t T) const {
  if (layer >= hdr_->num_layers || T < 1 || T > hdr_->max_tokens)
    throw Error(GPUSYNC_E_INVALID, "task layer=" + std::to_string(layer) + " num_tokens=" + std::to_string(T) +
                                       ": need layer < " + std::to_string(hdr_->num_layers) +
                                       " and 1 <= num_tokens <= max_tokens=" + std::to_string(hdr_->max_tokens));
}

cpumoe_hostfn_arg* Iob::hostfn_arg(uint32_t layer, uint32_t T) const {
  check_task(layer, T);
  cpumoe_hostfn_arg* a = api_->hostfn_arg(exec_, layer, T);
  if (!a) throw Error(GPUSYNC_E_INVALID, "executor refused hostfn_arg");
  return a;
}

void Iob::guard_capture(int path, CUstream s, const char* op) const {
  const int st = dev_->capture_status(s);
  if (st == CAPTURE_STATUS_NONE) return;
  if (st == CAPTURE_STATUS_INVALIDATED)
    throw Error(GPUSYNC_E_CAPTURE_REFUSED, std::string(op) + ": the stream's capture is already invalidated");
  if (!replay_safe(path))
    throw Error(GPUSYNC_E_CAPTURE_REFUSED,
                std::string(op) + ": capture refused: the " + path_name(path) +
                    " handshake was not proven replay-safe on this machine (" +
                    (report_[path].empty() ? std::string("not probed") : report_[path]) +
                    "). Decode MoE layers eagerly: disable CUDA graphs for decode (e.g. --cuda-graph-max-bs 0 / "
                    "enforce_eager), or fix the cause above and restart so the start-up probe passes");
}

void Iob::submit(int path, CUstream s, uint32_t layer, uint32_t T) {
  check_task(layer, T);
  const uint64_t task = CPUMOE_TASK(layer, T);
  const Driver& d = dev_->drv();
  Device::Guard g(*dev_);
  if (path == GPUSYNC_PATH_MEMOP) {
    guard_capture(path, s, "submit");
    if (!dev_->memops64()) throw Error(GPUSYNC_E_UNSUPPORTED, "v2 64-bit stream memops are unavailable here");
    // done := 0 first, so this step's completion cannot be wiped; the default
    // write flag fences (system scope, stream order) before each write, so the
    // copies before it and done = 0 are visible before ready = task.
    CUresult rc = d.cuStreamWriteValue64(s, dptr_off(CPUMOE_IOB_DONE_OFF), CPUMOE_DONE_PENDING,
                                         STREAM_WRITE_VALUE_DEFAULT);
    if (rc != SUCCESS) d.fail(rc, "cuStreamWriteValue64(done := 0)", dev_->capture_note(s));
    rc = d.cuStreamWriteValue64(s, dptr_off(CPUMOE_IOB_READY_OFF), task, STREAM_WRITE_VALUE_DEFAULT);
    if (rc != SUCCESS) d.fail(rc, "cuStreamWriteValue64(ready := " + hex(task) + ")", dev_->capture_note(s));
  } else if (path == GPUSYNC_PATH_HOSTFN) {
    guard_capture(path, s, "submit");
    if (!d.cuLaunchHostFunc) throw Error(GPUSYNC_E_UNSUPPORTED, "the CUDA driver lacks cuLaunchHostFunc");
    const CUresult rc = d.cuLaunchHostFunc(s, api_->hostfn_submit, hostfn_arg(layer, T));
    if (rc != SUCCESS) d.fail(rc, "cuLaunchHostFunc(hostfn_submit, task " + hex(task) + ")", dev_->capture_note(s));
  } else {
    throw Error(GPUSYNC_E_INVALID, std::string("submit: path ") + path_name(path) + " has no doorbell of its own");
  }
}

void Iob::wait(int path, CUstream s) {
  const Driver& d = dev_->drv();
  Device::Guard g(*dev_);
  // The kernel path rings from its publish kernel and waits here with a memop.
  if (path == GPUSYNC_PATH_MEMOP || path == GPUSYNC_PATH_KERNEL) {
    guard_capture(path, s, "wait");
    if (!dev_->memops64()) throw Error(GPUSYNC_E_UNSUPPORTED, "v2 64-bit stream memops are unavailable here");
    // GEQ is a cyclic compare: (int64)(done - 1) >= 0; SHUTDOWN (2^63-1) releases too.
    const CUresult rc = d.cuStreamWaitValue64(s, dptr_off(CPUMOE_IOB_DONE_OFF), CPUMOE_DONE_COMPLETE,
                                              STREAM_WAIT_VALUE_GEQ);
    if (rc != SUCCESS) d.fail(rc, "cuStreamWaitValue64(done >= 1, GEQ)", dev_->capture_note(s));
  } else if (path == GPUSYNC_PATH_HOSTFN) {
    guard_capture(path, s, "wait");
    if (!d.cuLaunchHostFunc) throw Error(GPUSYNC_E_UNSUPPORTED, "the CUDA driver lacks cuLaunchHostFunc");
    const CUresult rc = d.cuLaunchHostFunc(s, api_->hostfn_wait, hostfn_arg(0, 1));
    if (rc != SUCCESS) d.fail(rc, "cuLaunchHostFunc(hostfn_wait)", dev_->capture_note(s));
  } else {
    throw Error(GPUSYNC_E_INVALID, std::string("wait: path ") + path_name(path) + " has no doorbell of its own");
  }
}

void Iob::step(int path, CUstream s, uint32_t layer, uint32_t T, CUdeviceptr x, CUdeviceptr ids, CUdeviceptr w,
               CUdeviceptr y) {
  check_task(layer, T);
  if (path != GPUSYNC_PATH_MEMOP && path != GPUSYNC_PATH_HOSTFN)
    throw Error(GPUSYNC_E_INVALID, std::string("step: path ") + path_name(path) + " is not a copy path");
  guard_capture(path, s, "step");
  const Driver& d = dev_->drv();
  Device::Guard g(*dev_);
  const size_t H = hdr_->hidden, K = hdr_->top_k;
  auto d2h = [&](uint64_t off, CUdeviceptr src, size_t n, const char* what) {
    const CUresult rc = d.cuMemcpyDtoHAsync(host(off), src, n, s);
    if (rc != SUCCESS) d.fail(rc, std::string("cuMemcpyDtoHAsync(") + what + " -> IO block)", dev_->capture_note(s));
  };
  d2h(hdr_->x_off, x, T * H * 2, "x");
  d2h(hdr_->ids_off, ids, T * K * 4, "ids");
  d2h(hdr_->w_off, w, T * K * 4, "w");
  // Stream order makes the copies complete before the doorbell; the memop write
  // (or the host function, which runs after prior work) publishes them.
  submit(path, s, layer, T);
  wait(path, s);
  const CUresult rc = d.cuMemcpyHtoDAsync(y, host(hdr_->y_off), T * H * 2, s);
  if (rc != SUCCESS) d.fail(rc, "cuMemcpyHtoDAsync(IO block y -> y)", dev_->capture_note(s));
}

bool Iob::sync(CUstream s, double timeout_s) {
  if (dev_->sync(s, timeout_s)) return true;
  // A wait that never completes would hang the process: release it the way the
  // coordinator's shutdown does (done >= 1), then give the stream a moment.
  __atomic_store_n(&hdr_->done, CPUMOE_DONE_SHUTDOWN, __ATOMIC_RELEASE);
  dev_->sync(s, 2.0);
  return false;
}
}  // namespace gpusync
