// Executor::linear: the formats library's dense bf16 linear (ABI 1.9) on group 0's threads. The rows are cut into
// blocks that the threads claim from one counter, so a thread that comes late (its core taken) finds the work
// done by the others instead of holding the call up; the kernel's results depend only on (row, token), so any
// team and any claim order give the same bits.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "executor.h"

namespace cpumoe_exec {

namespace {
constexpr int kBlocksPerThread = 4;  // work items per thread: enough to balance a late start, few claims
constexpr int kMinBlock = 16;        // rows
}  // namespace

void Executor::linear_body(void* job, int) {
  auto* J = static_cast<LinearJob*>(job);
  for (;;) {
    const int b = J->next.fetch_add(1, std::memory_order_relaxed);
    if (b >= J->nblk) return;
    const int32_t r0 = b * J->blk, r1 = std::min(J->M, r0 + J->blk);
    J->k->rows(J->k, J->w, J->ws, J->K, r0, r1, J->n, J->x, J->xs, J->bias, J->y, J->ys, J->fp32);
    J->done.fetch_add(1, std::memory_order_release);
  }
}

void Executor::linear(const void* w, int64_t w_stride, int32_t M, int32_t K, int32_t n, const uint16_t* x,
                      int64_t x_stride, const uint16_t* bias, void* y, int64_t y_stride, bool y_fp32) {
  if (M < 1 || K < 1 || n < 1)
    throw std::invalid_argument("linear: M=" + std::to_string(M) + ", K=" + std::to_string(K) + ", n=" +
                                std::to_string(n) + ": each must be >= 1");
  const int64_t yrow = (int64_t)M * (y_fp32 ? 4 : 2);
  if (w_stride < 2 * (int64_t)K || (n > 1 && (x_stride < 2 * (int64_t)K || y_stride < yrow)))
    throw std::invalid_argument("linear: a row stride is shorter than its row (w_stride=" + std::to_string(w_stride) +
                                ", x_stride=" + std::to_string(x_stride) + ", y_stride=" + std::to_string(y_stride) +
                                " bytes for K=" + std::to_string(K) + ", M=" + std::to_string(M) + ")");
  if (!w || !x || !y) throw std::invalid_argument("linear: w, x and y must not be null");
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  quiesce_all();  // stragglers of the last step or linear are out: lin_job_ and lin_x_ may change
  const cpumoe_linear* k = lin_;
  LinearJob& J = lin_job_;
  J.k = k, J.w = w, J.ws = w_stride, J.K = K, J.M = M, J.n = n, J.bias = bias, J.y = y, J.ys = y_stride;
  J.fp32 = y_fp32 ? 1 : 0;
  const size_t xb = k->x_bytes(k, K);
  if (xb) {  // the tier reads prepared rows: widened once here, read by every thread
    const size_t row = (xb + 63) / 64 * 64;
    if (lin_x_.size() < row * n + 64) lin_x_.resize(row * n + 64);
    char* d = lin_x_.data() + (64 - (uintptr_t)lin_x_.data() % 64) % 64;
    for (int t = 0; t < n; ++t) k->prep_x(k, (const uint16_t*)((const char*)x + (int64_t)t * x_stride), K, d + row * t);
    J.x = d, J.xs = (int64_t)row;
  } else {
    J.x = x, J.xs = x_stride;
  }
  Pool& pool = *groups_[0]->pool;
  const int64_t unit = team_unit_.load(std::memory_order_relaxed);
  const int64_t bytes = (int64_t)M * K * 2;
  int team = pool.size();
  if (unit > 0) team = (int)std::min<int64_t>(team, 1 + bytes / unit);
  // blocks: kBlocksPerThread a thread, at least kMinBlock rows, at most the kernel's row_block, multiples of 16
  int blk = (int)(((int64_t)M + team * kBlocksPerThread - 1) / (team * kBlocksPerThread));
  blk = std::max(kMinBlock, std::min(k->row_block, (blk + 15) / 16 * 16));
  J.blk = blk, J.nblk = (int)((M + (int64_t)blk - 1) / blk);
  J.next.store(0, std::memory_order_relaxed);
  J.done.store(0, std::memory_order_relaxed);
  pool.start(&linear_body, &J, std::min(team, J.nblk));
  wait_at_least(J.done, J.nblk);  // the workers' blocks (start() returned when the caller's claims ran out)
  linear_runs_.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace cpumoe_exec
