// The doorbell on a CUDA stream (protocol v1, docs/protocol.md).
#include "iob.h"

#include <cstdio>
#include <cstdlib>

#include "gpusync/backend_common.h"

namespace gpusync {
namespace {
using common::hex;
const char* const kCopyNames[CopyFork::kBranches] = {"x", "ids", "w"};
}  // namespace

const char* path_name(int path) { return common::path_name(path); }

bool copy_fork_from_env() {
  const char* v = std::getenv("GPUSYNC_COPY_FORK");
  // Serial by default: on the H200 the forked graph replayed slower (memop path, no CPU route, batch 1: 23.6 us
  // forked vs 17.7 us serial, bench/device/gpu_memfork.sh); the fork stays an option for hosts where copies overlap.
  if (!v || !*v || std::string(v) == "0") return false;
  if (std::string(v) == "1") return true;
  throw Error(GPUSYNC_E_INVALID, std::string("GPUSYNC_COPY_FORK='") + v +
                                     "': expected 0 (the copy step's input copies one after another on the "
                                     "caller's stream; the default) or 1 (forked onto side streams), or unset");
}

CopyFork::CopyFork(const Device& dev, bool on) : dev_(dev), on_(on) {
  if (!on_) return;
  const Driver& d = dev_.drv();
  try {
    Device::Guard g(dev_);
    for (int i = 0; i < kBranches; ++i) {
      CUstream st = nullptr;  // assigned only on success: release() never sees a garbage handle
      d.check(d.cuStreamCreate(&st, STREAM_NON_BLOCKING),
              std::string("cuStreamCreate(copy side stream for ") + kCopyNames[i] + ", NON_BLOCKING)");
      side_[i] = st;
    }
    CUevent ev = nullptr;
    d.check(d.cuEventCreate(&ev, EVENT_DISABLE_TIMING), "cuEventCreate(copy fork event, DISABLE_TIMING)");
    fork_ = ev;
    for (int i = 0; i < kBranches; ++i) {
      ev = nullptr;
      d.check(d.cuEventCreate(&ev, EVENT_DISABLE_TIMING),
              std::string("cuEventCreate(copy join event for ") + kCopyNames[i] + ", DISABLE_TIMING)");
      join_[i] = ev;
    }
  } catch (...) {
    release();  // the destructor does not run for a constructor that throws
    throw;
  }
}

CopyFork::~CopyFork() { release(); }

void CopyFork::release() {
  if (!on_) return;
  try {
    Device::Guard g(dev_);
    const Driver& d = dev_.drv();
    // Work still queued on a side stream finishes first (the driver releases the stream after it).
    // A destructor cannot raise: a failure is reported on stderr and the other handles are released.
    auto warn = [&](CUresult rc, const std::string& what) {
      if (rc != SUCCESS)
        std::fprintf(stderr, "gpusync-cuda: %s failed at teardown: %s\n", what.c_str(), d.name(rc).c_str());
    };
    for (int i = 0; i < kBranches; ++i)
      if (join_[i]) {
        warn(d.cuEventDestroy(join_[i]), std::string("cuEventDestroy(copy join event for ") + kCopyNames[i] + ")");
        join_[i] = nullptr;
      }
    if (fork_) warn(d.cuEventDestroy(fork_), "cuEventDestroy(copy fork event)"), fork_ = nullptr;
    for (int i = 0; i < kBranches; ++i)
      if (side_[i]) {
        warn(d.cuStreamDestroy(side_[i]), std::string("cuStreamDestroy(copy side stream for ") + kCopyNames[i] + ")");
        side_[i] = nullptr;
      }
  } catch (...) {  // the context could not be made current: the process is tearing down
  }
}

Iob::Iob(std::shared_ptr<Device> dev, const cpumoe_executor_api* api, cpumoe_executor* exec)
    : dev_(std::move(dev)), api_(api), exec_(exec), fork_(*dev_, copy_fork_from_env()) {
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

std::string Iob::copy_mode() const {
  return fork_.on() ? "copies forked (GPUSYNC_COPY_FORK=1: x, ids, w on 3 side streams, done := 0 beside them)"
                    : "copies serial (GPUSYNC_COPY_FORK=0)";
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

void Iob::write_word(CUstream s, uint64_t off, uint64_t value, const std::string& what) const {
  const Driver& d = dev_->drv();
  const CUresult rc = d.cuStreamWriteValue64(s, dptr_off(off), value, STREAM_WRITE_VALUE_DEFAULT);
  if (rc != SUCCESS) d.fail(rc, "cuStreamWriteValue64(" + what + ")", dev_->capture_note(s));
}

void Iob::submit(int path, CUstream s, uint32_t layer, uint32_t T) {
  check_task(layer, T);
  if (path != GPUSYNC_PATH_MEMOP && path != GPUSYNC_PATH_HOSTFN)
    throw Error(GPUSYNC_E_INVALID, std::string("submit: path ") + path_name(path) + " has no doorbell of its own");
  Device::Guard g(*dev_);
  guard_capture(path, s, "submit");
  ring(path, s, layer, T, true);
}

void Iob::ring(int path, CUstream s, uint32_t layer, uint32_t T, bool reset_done) {
  const uint64_t task = CPUMOE_TASK(layer, T);
  const Driver& d = dev_->drv();
  if (path == GPUSYNC_PATH_MEMOP) {
    if (!dev_->memops64()) throw Error(GPUSYNC_E_UNSUPPORTED, "v2 64-bit stream memops are unavailable here");
    // done := 0 first, so this step's completion cannot be wiped; the default
    // write flag fences (system scope, stream order) before each write, so the
    // copies before it and done = 0 are visible before ready = task. (The forked
    // copy step writes done := 0 itself, beside its copies: reset_done = false.)
    if (reset_done) write_word(s, CPUMOE_IOB_DONE_OFF, CPUMOE_DONE_PENDING, "done := 0");
    write_word(s, CPUMOE_IOB_READY_OFF, task, "ready := " + hex(task));
  } else {
    if (!d.cuLaunchHostFunc) throw Error(GPUSYNC_E_UNSUPPORTED, "the CUDA driver lacks cuLaunchHostFunc");
    const CUresult rc = d.cuLaunchHostFunc(s, api_->hostfn_submit, hostfn_arg(layer, T));
    if (rc != SUCCESS) d.fail(rc, "cuLaunchHostFunc(hostfn_submit, task " + hex(task) + ")", dev_->capture_note(s));
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

void Iob::copy_in(const Copy& c, CUstream on, CUstream s) const {
  const Driver& d = dev_->drv();
  const CUresult rc = d.cuMemcpyDtoHAsync(host(c.off), c.src, c.bytes, on);
  if (rc != SUCCESS)
    d.fail(rc, std::string("cuMemcpyDtoHAsync(") + c.what + " -> IO block" + (on == s ? "" : ", side stream") + ")",
           dev_->capture_note(s));
}

void Iob::copies_forked(CUstream s, const Copy (&in)[CopyFork::kBranches], bool reset_done) {
  const Driver& d = dev_->drv();
  auto check = [&](CUresult rc, const std::string& op) {
    if (rc != SUCCESS) d.fail(rc, op, dev_->capture_note(s));
  };
  std::lock_guard<std::mutex> lock(fork_.mu());
  int forked = 0;  // side streams ordered after the fork (when capturing: joined to the capture)
  try {
    // Fork: the side streams start after everything already on s (the previous
    // step's y copy included). Under capture the wait pulls each side stream into
    // the capture; its copy becomes a node depending on s's last node.
    check(d.cuEventRecord(fork_.fork_event(), s), "cuEventRecord(copy fork, caller's stream)");
    for (; forked < CopyFork::kBranches; ++forked)
      check(d.cuStreamWaitEvent(fork_.side(forked), fork_.fork_event(), 0),
            std::string("cuStreamWaitEvent(side stream for ") + kCopyNames[forked] + " waits for the fork)");
    for (int i = 0; i < CopyFork::kBranches; ++i) copy_in(in[i], fork_.side(i), s);
    // done := 0 beside the copies: it only has to precede ready := task (same
    // stream, below) and follow the previous step's wait (it does: stream order).
    if (reset_done) write_word(s, CPUMOE_IOB_DONE_OFF, CPUMOE_DONE_PENDING, "done := 0");
    // Join: nothing after this on s (the doorbell first) starts before every
    // copy has landed, so the coordinator never sees ready before the payload.
    for (int i = 0; i < CopyFork::kBranches; ++i) {
      check(d.cuEventRecord(fork_.join_event(i), fork_.side(i)),
            std::string("cuEventRecord(copy join, side stream for ") + kCopyNames[i] + ")");
      check(d.cuStreamWaitEvent(s, fork_.join_event(i), 0),
            std::string("cuStreamWaitEvent(caller's stream waits for the ") + kCopyNames[i] + " copy)");
    }
  } catch (...) {
    // Join back every side stream that forked (best effort, codes ignored: the
    // first error is the one raised), so a capture is never left with unjoined
    // work and later eager work on s stays ordered after what was queued.
    for (int i = 0; i < forked; ++i)
      if (d.cuEventRecord(fork_.join_event(i), fork_.side(i)) == SUCCESS)
        d.cuStreamWaitEvent(s, fork_.join_event(i), 0);
    throw;
  }
}

void Iob::check_tokens(uint32_t T, const char* op) const {
  if (T < 1 || T > hdr_->max_tokens)
    throw Error(GPUSYNC_E_INVALID, std::string(op) + ": num_tokens=" + std::to_string(T) +
                                       ": need 1 <= num_tokens <= max_tokens=" + std::to_string(hdr_->max_tokens));
}

void Iob::check_copy_path(int path, CUstream s, const char* op) const {
  if (path != GPUSYNC_PATH_MEMOP && path != GPUSYNC_PATH_HOSTFN)
    throw Error(GPUSYNC_E_INVALID, std::string(op) + ": path " + path_name(path) + " is not a copy path");
  guard_capture(path, s, op);
  if (path == GPUSYNC_PATH_MEMOP && !dev_->memops64())
    throw Error(GPUSYNC_E_UNSUPPORTED, "v2 64-bit stream memops are unavailable here");
  if (path == GPUSYNC_PATH_HOSTFN && !dev_->drv().cuLaunchHostFunc)
    throw Error(GPUSYNC_E_UNSUPPORTED, "the CUDA driver lacks cuLaunchHostFunc");
}

void Iob::copy_submit(int path, CUstream s, uint32_t layer, uint32_t T, CUdeviceptr x, CUdeviceptr ids,
                      CUdeviceptr w) {
  const size_t H = hdr_->hidden, K = hdr_->top_k;
  const Copy in[CopyFork::kBranches] = {{hdr_->x_off, x, T * H * 2, kCopyNames[0]},
                                        {hdr_->ids_off, ids, T * K * 4, kCopyNames[1]},
                                        {hdr_->w_off, w, T * K * 4, kCopyNames[2]}};
  const bool memop = path == GPUSYNC_PATH_MEMOP;
  if (fork_.on()) {
    // x, ids, w (and done := 0) concurrently, then the doorbell: in a graph the
    // four are sibling nodes and ready := task depends on all of them.
    copies_forked(s, in, memop);
    ring(path, s, layer, T, false);
  } else {
    // Stream order makes the copies complete before the doorbell; the memop write
    // (or the host function, which runs after prior work) publishes them.
    for (const Copy& c : in) copy_in(c, s, s);
    ring(path, s, layer, T, true);
  }
}

void Iob::copy_finish(int path, CUstream s, uint32_t T, CUdeviceptr y) {
  const Driver& d = dev_->drv();
  wait(path, s);
  const CUresult rc = d.cuMemcpyHtoDAsync(y, host(hdr_->y_off), T * (size_t)hdr_->hidden * 2, s);
  if (rc != SUCCESS) d.fail(rc, "cuMemcpyHtoDAsync(IO block y -> y)", dev_->capture_note(s));
}

void Iob::step_submit(int path, CUstream s, uint32_t layer, uint32_t T, CUdeviceptr x, CUdeviceptr ids,
                      CUdeviceptr w) {
  check_task(layer, T);
  check_copy_path(path, s, "step_submit");
  Device::Guard g(*dev_);
  copy_submit(path, s, layer, T, x, ids, w);
}

void Iob::step_finish(int path, CUstream s, uint32_t T, CUdeviceptr y) {
  check_tokens(T, "step_finish");
  check_copy_path(path, s, "step_finish");
  Device::Guard g(*dev_);
  copy_finish(path, s, T, y);
}

void Iob::step(int path, CUstream s, uint32_t layer, uint32_t T, CUdeviceptr x, CUdeviceptr ids, CUdeviceptr w,
               CUdeviceptr y) {
  check_task(layer, T);
  check_copy_path(path, s, "step");
  Device::Guard g(*dev_);
  copy_submit(path, s, layer, T, x, ids, w);
  copy_finish(path, s, T, y);
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
