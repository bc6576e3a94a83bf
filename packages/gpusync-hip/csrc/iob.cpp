// The doorbell on a HIP stream (protocol v1, docs/protocol.md): signal-memory
// words, memops routed by the capture state and the proven mechanism, the copy
// step with its system-release event.
#include "iob.h"

#include <cstdio>

#include "gpusync/backend_common.h"

namespace gpusync {
namespace {
using common::hex;
}  // namespace

const char* path_name(int path) { return common::path_name(path); }

const char* mechanism_name(int m) {
  switch (m) {
    case MECH_NATIVE: return "native";
    case MECH_SPLICE: return "splice";
    default: return "none";
  }
}

Iob::Iob(std::shared_ptr<Device> dev, const cpumoe_executor_api* api, cpumoe_executor* exec)
    : dev_(std::move(dev)), api_(api), exec_(exec) {
  hdr_ = common::checked_iob<Error>(api, exec, "gpusync-hip");
  ErrorScope scope(rt(), "register the IO block");
  dbase_ = dev_->host_register(hdr_, hdr_->total_bytes, &owned_);
  try {
    ready_ = dev_->signal_alloc();
    done_ = dev_->signal_alloc();
    scratch_ = dev_->signal_alloc();
    __atomic_store_n(done_, CPUMOE_DONE_COMPLETE, __ATOMIC_RELEASE);  // nothing pending
    signal_ = true;
  } catch (const Error& e) {
    for (uint64_t* w : {ready_, done_, scratch_}) dev_->free(w);
    ready_ = &hdr_->ready, done_ = &hdr_->done, scratch_ = nullptr;
    signal_note_ = std::string("no signal memory, so no stream memops (ROCm waits only on signal memory): ") +
                   e.what();
  }
}

Iob::~Iob() {
  try {
    const bool clean_before = rt().hipPeekAtLastError() == hipSuccess;  // never consume a caller's error
    {
      std::lock_guard<std::mutex> g(ev_mu_);
      for (auto& kv : events_) rt().hipEventDestroy(kv.second);
    }
    // The coordinator must have been stopped or moved off these words first (HipSync.close does).
    if (signal_)
      for (uint64_t* w : {ready_, done_, scratch_}) dev_->free(w);
    if (owned_) dev_->host_unregister(hdr_);
    if (clean_before) rt().hipGetLastError();  // a teardown failure must not surface in the caller's next call
  } catch (...) {  // never throw from a destructor; the process may be tearing down
  }
}

uint64_t Iob::dptr(const void* host) const {
  if (signal_ && (host == ready_ || host == done_ || host == scratch_))
    return (uint64_t)(uintptr_t)host;  // signal memory: one address for host and device
  const char* p = static_cast<const char*>(host);
  const char* b = reinterpret_cast<const char*>(hdr_);
  if (p < b || p >= b + hdr_->total_bytes)
    throw Error(GPUSYNC_E_INVALID, "address is neither inside the IO block nor one of its signal words");
  return dbase_ + (uint64_t)(p - b);
}

void Iob::set_replay_safe(int path, bool on) {
  if (path < 0 || path >= GPUSYNC_PATH_COUNT) throw Error(GPUSYNC_E_INVALID, "no such path");
  if (on && path == GPUSYNC_PATH_HOSTFN)
    throw Error(GPUSYNC_E_INVALID, "host-func is never replay-safe on ROCm (host-function nodes decode silently "
                                   "wrong under HIP graph replay: seed 001); it is an eager-only path here");
  safe_ = on ? (safe_ | (1u << path)) : (safe_ & ~(1u << path));
}

size_t Iob::event_count() const {
  std::lock_guard<std::mutex> g(ev_mu_);
  return events_.size();
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

void Iob::guard_capture(int path, hipStream_t s, const char* op) const {
  const int st = dev_->capture_status(s);
  if (st == hipStreamCaptureStatusNone) return;
  const std::string todo =
      ". Decode MoE layers eagerly: disable HIP graphs for decode (e.g. --cuda-graph-max-bs 0 / enforce_eager), "
      "or fix the cause above and restart so the start-up probe passes";
  if (st == hipStreamCaptureStatusInvalidated)
    throw Error(GPUSYNC_E_CAPTURE_REFUSED, std::string(op) + ": the stream's capture is already invalidated");
  if (path == GPUSYNC_PATH_HOSTFN)
    throw Error(GPUSYNC_E_CAPTURE_REFUSED,
                std::string(op) + ": capture refused: host-function nodes are never used under HIP graph capture "
                                  "(they decode silently wrong under replay on ROCm: seed 001)" + todo);
  if (!replay_safe(path))
    throw Error(GPUSYNC_E_CAPTURE_REFUSED,
                std::string(op) + ": capture refused: the " + path_name(path) +
                    " handshake was not proven replay-safe on this machine (" +
                    (report_[path].empty() ? std::string("not probed") : report_[path]) + ")" + todo);
}

void Iob::write64(hipStream_t s, uint64_t* word, uint64_t v, const char* what) {
  const Runtime& r = rt();
  if (!signal_) throw Error(GPUSYNC_E_UNSUPPORTED, signal_note_);
  if (!r.has_memops()) throw Error(GPUSYNC_E_UNSUPPORTED, "the HIP runtime lacks hipStreamWriteValue64/WaitValue64");
  const int st = dev_->capture_status(s);
  if (st == hipStreamCaptureStatusActive && mech_ == MECH_SPLICE)
    return splice_memop(r, s, params_.write64(word, v), what);
  if (st != hipStreamCaptureStatusNone && mech_ != MECH_NATIVE)
    throw Error(GPUSYNC_E_CAPTURE_REFUSED,
                std::string(what) + ": capture refused: no probe showed that this runtime records stream memops "
                                    "under capture (before HIP 10 they run at once and are not recorded)");
  const hipError_t rc = r.hipStreamWriteValue64(s, word, v, hipStreamWriteValueDefault);
  if (rc != hipSuccess) r.fail(rc, std::string("hipStreamWriteValue64(") + what + ")", dev_->capture_note(s));
}

void Iob::wait_gte(hipStream_t s, uint64_t* word, uint64_t v, const char* what) {
  const Runtime& r = rt();
  if (!signal_) throw Error(GPUSYNC_E_UNSUPPORTED, signal_note_);
  if (!r.has_memops()) throw Error(GPUSYNC_E_UNSUPPORTED, "the HIP runtime lacks hipStreamWriteValue64/WaitValue64");
  const int st = dev_->capture_status(s);
  if (st == hipStreamCaptureStatusActive && mech_ == MECH_SPLICE)
    return splice_memop(r, s, params_.wait_gte64(word, v), what);
  if (st != hipStreamCaptureStatusNone && mech_ != MECH_NATIVE)
    throw Error(GPUSYNC_E_CAPTURE_REFUSED,
                std::string(what) + ": capture refused: a stream wait issued while capturing would block the real "
                                    "queue on a runtime that does not record memops (before HIP 10)");
  // Gte is masked and NON-cyclic on ROCm: (done & ~0) >= 1 holds for COMPLETE and SHUTDOWN alike.
  const hipError_t rc = r.hipStreamWaitValue64(s, word, v, hipStreamWaitValueGte, ~0ull);
  if (rc != hipSuccess) r.fail(rc, std::string("hipStreamWaitValue64(") + what + ")", dev_->capture_note(s));
}

void Iob::release(hipStream_t s, uint32_t layer, uint32_t T) {
  const Runtime& r = rt();
  if (!r.has_release_event())
    throw Error(GPUSYNC_E_UNSUPPORTED, "the HIP runtime lacks hipEventCreateWithFlags/hipEventRecord: no "
                                       "system-release event can order the copied payload before the doorbell");
  const uint64_t task = CPUMOE_TASK(layer, T);
  hipEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> g(ev_mu_);
    auto it = events_.find(task);
    if (it == events_.end()) {
      r.check(r.hipEventCreateWithFlags(&ev, hipEventReleaseToSystem | hipEventDisableTiming),
              "hipEventCreateWithFlags(hipEventReleaseToSystem | hipEventDisableTiming)");
      events_[task] = ev;
    } else {
      ev = it->second;
    }
  }
  const int st = dev_->capture_status(s);
  if (st == hipStreamCaptureStatusNone) {
    r.check(r.hipEventRecord(ev, s), "hipEventRecord(system-release event)");
    return;
  }
  // Under capture a plain hipEventRecord is only a dependency edge: the release
  // would be missing from every replay. External makes it an event-record node.
  if (!r.hipEventRecordWithFlags)
    throw Error(GPUSYNC_E_CAPTURE_REFUSED,
                "capture refused: the HIP runtime lacks hipEventRecordWithFlags (HIP < 6.4.2), so the system-release "
                "event between the copies and the doorbell cannot be captured as a replayed node");
  const hipError_t rc = r.hipEventRecordWithFlags(ev, s, hipEventRecordExternal);
  if (rc != hipSuccess)
    r.fail(rc, "hipEventRecordWithFlags(system-release event, hipEventRecordExternal)", dev_->capture_note(s));
}

void Iob::submit(int path, hipStream_t s, uint32_t layer, uint32_t T) {
  check_task(layer, T);
  const uint64_t task = CPUMOE_TASK(layer, T);
  ErrorScope scope(rt(), "submit");
  Device::Guard g(*dev_);
  if (path == GPUSYNC_PATH_MEMOP) {
    guard_capture(path, s, "submit");
    // done := 0 first, so this step's completion cannot be wiped; then ready := task.
    write64(s, done_, CPUMOE_DONE_PENDING, "done := 0");
    write64(s, ready_, task, ("ready := " + hex(task)).c_str());
  } else if (path == GPUSYNC_PATH_HOSTFN) {
    guard_capture(path, s, "submit");
    if (!rt().hipLaunchHostFunc) throw Error(GPUSYNC_E_UNSUPPORTED, "the HIP runtime lacks hipLaunchHostFunc");
    const hipError_t rc = rt().hipLaunchHostFunc(s, api_->hostfn_submit, hostfn_arg(layer, T));
    if (rc != hipSuccess) rt().fail(rc, "hipLaunchHostFunc(hostfn_submit, task " + hex(task) + ")");
  } else {
    throw Error(GPUSYNC_E_INVALID, std::string("submit: path ") + path_name(path) + " has no doorbell of its own");
  }
}

void Iob::wait(int path, hipStream_t s) {
  ErrorScope scope(rt(), "wait");
  Device::Guard g(*dev_);
  if (path == GPUSYNC_PATH_MEMOP || path == GPUSYNC_PATH_KERNEL) {
    guard_capture(path, s, "wait");
    wait_gte(s, done_, CPUMOE_DONE_COMPLETE, "done >= 1, Gte");
  } else if (path == GPUSYNC_PATH_HOSTFN) {
    guard_capture(path, s, "wait");
    if (!rt().hipLaunchHostFunc) throw Error(GPUSYNC_E_UNSUPPORTED, "the HIP runtime lacks hipLaunchHostFunc");
    const hipError_t rc = rt().hipLaunchHostFunc(s, api_->hostfn_wait, hostfn_arg(0, 1));
    if (rc != hipSuccess) rt().fail(rc, "hipLaunchHostFunc(hostfn_wait)");
  } else {
    throw Error(GPUSYNC_E_INVALID, std::string("wait: path ") + path_name(path) + " has no doorbell of its own");
  }
}

void Iob::check_copy_path(int path, const char* op) const {
  if (path != GPUSYNC_PATH_MEMOP && path != GPUSYNC_PATH_HOSTFN)
    throw Error(GPUSYNC_E_INVALID, std::string(op) + ": path " + path_name(path) + " is not a copy path");
}

void Iob::check_tokens(uint32_t T, const char* op) const {
  if (T < 1 || T > hdr_->max_tokens)
    throw Error(GPUSYNC_E_INVALID, std::string(op) + ": num_tokens=" + std::to_string(T) +
                                       ": need 1 <= num_tokens <= max_tokens=" + std::to_string(hdr_->max_tokens));
}

void Iob::copy_async(hipStream_t s, void* dst, uint64_t src, size_t n, hipMemcpyKind kind, const char* what) const {
  const Runtime& r = rt();
  const hipError_t rc = r.hipMemcpyAsync(dst, (const void*)(uintptr_t)src, n, kind, s);
  if (rc != hipSuccess) r.fail(rc, std::string("hipMemcpyAsync(") + what + ")", dev_->capture_note(s));
}

void Iob::copy_submit(int path, hipStream_t s, uint32_t layer, uint32_t T, uint64_t x, uint64_t ids, uint64_t w) {
  const size_t H = hdr_->hidden, K = hdr_->top_k;
  copy_async(s, host(hdr_->x_off), x, T * H * 2, hipMemcpyDeviceToHost, "x -> IO block");
  copy_async(s, host(hdr_->ids_off), ids, T * K * 4, hipMemcpyDeviceToHost, "ids -> IO block");
  copy_async(s, host(hdr_->w_off), w, T * K * 4, hipMemcpyDeviceToHost, "w -> IO block");
  // Stream order alone does not make the copies visible to the host before the
  // doorbell on ROCm (seed 003): a system-scope release sits between them.
  release(s, layer, T);
  submit(path, s, layer, T);
}

void Iob::copy_finish(int path, hipStream_t s, uint32_t T, uint64_t y) {
  wait(path, s);
  copy_async(s, (void*)(uintptr_t)y, (uint64_t)(uintptr_t)host(hdr_->y_off), T * (size_t)hdr_->hidden * 2,
             hipMemcpyHostToDevice, "IO block y -> y");
}

void Iob::step_submit(int path, hipStream_t s, uint32_t layer, uint32_t T, uint64_t x, uint64_t ids, uint64_t w) {
  check_task(layer, T);
  check_copy_path(path, "step_submit");
  ErrorScope scope(rt(), "step_submit");
  guard_capture(path, s, "step_submit");
  Device::Guard g(*dev_);
  copy_submit(path, s, layer, T, x, ids, w);
}

void Iob::step_finish(int path, hipStream_t s, uint32_t T, uint64_t y) {
  check_tokens(T, "step_finish");
  check_copy_path(path, "step_finish");
  ErrorScope scope(rt(), "step_finish");
  guard_capture(path, s, "step_finish");
  Device::Guard g(*dev_);
  copy_finish(path, s, T, y);
}

void Iob::step(int path, hipStream_t s, uint32_t layer, uint32_t T, uint64_t x, uint64_t ids, uint64_t w,
               uint64_t y) {
  check_task(layer, T);
  check_copy_path(path, "step");
  ErrorScope scope(rt(), "step");
  guard_capture(path, s, "step");
  Device::Guard g(*dev_);
  copy_submit(path, s, layer, T, x, ids, w);
  copy_finish(path, s, T, y);
}

bool Iob::sync(hipStream_t s, double timeout_s) {
  if (dev_->sync(s, timeout_s)) return true;
  // A wait that never completes would hang the process: release it the way the
  // coordinator's shutdown does (done >= 1), then give the stream a moment.
  __atomic_store_n(done_, CPUMOE_DONE_SHUTDOWN, __ATOMIC_RELEASE);
  dev_->sync(s, 2.0);
  return false;
}
}  // namespace gpusync
