// Executor::attention: the formats library's decode attention (ABI 1.11) on group 0's threads. A work item is one
// (query token, kv head); the threads claim items from one counter, each with a scratch of its own. The kernel's
// result for a (token, head) depends only on that token and head, so any team and claim order give the same bits.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "executor.h"

namespace cpumoe_exec {

void Executor::attention_body(void* job, int tid) {
  auto* J = static_cast<AttentionJob*>(job);
  void* scratch = J->scratch + (size_t)tid * J->sstride;
  for (;;) {
    const int i = J->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= J->nitems) return;
    const int32_t t = i / J->Hkv, g = i % J->Hkv;
    cpumoe_attention_args a = J->a;
    a.n = 1;
    a.q += t * a.q_tok;
    a.o += t * a.o_tok;
    if (a.mask) a.mask += t * a.mask_tok;
    J->k->heads(J->k, &a, g, g + 1, scratch);
    J->done.fetch_add(1, std::memory_order_release);
  }
}

void Executor::attention(const cpumoe_attention_args& a, int32_t Hkv) {
  if (a.n < 1 || a.group < 1 || a.D < 1 || a.L < 1 || Hkv < 1)
    throw std::invalid_argument("attention: n=" + std::to_string(a.n) + ", group=" + std::to_string(a.group) +
                                ", D=" + std::to_string(a.D) + ", L=" + std::to_string(a.L) + ", Hkv=" +
                                std::to_string(Hkv) + ": each must be >= 1");
  if (a.q_tok < 0 || a.q_head < 0 || a.k_head < 0 || a.k_pos < 0 || a.v_head < 0 || a.v_pos < 0 || a.mask_tok < 0 ||
      a.o_tok < 0 || a.o_head < 0)
    throw std::invalid_argument("attention: strides must be >= 0");
  if (!a.q || !a.k || !a.v || !a.o) throw std::invalid_argument("attention: q, k, v and o must not be null");
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  quiesce_all();  // stragglers of the last task are out: att_job_ and att_scratch_ may change
  const cpumoe_attention* k = att_;
  AttentionJob& J = att_job_;
  Pool& pool = *groups_[0]->pool;
  J.k = k, J.a = a, J.Hkv = Hkv, J.nitems = a.n * Hkv;
  // team: as a step's, 1 + bytes / unit threads, where bytes are the cache rows the tokens' heads read: the
  // positions the mask lets through (a static cache of 4096 holding 40 is 40 rows a head, not 4096), every one
  // without a mask. Counting them reads n * L mask bytes, ~4 KB for one token on a 4096 cache.
  const int64_t unit = team_unit_.load(std::memory_order_relaxed);
  int64_t rows = (int64_t)a.n * a.L;
  if (a.mask) {
    rows = 0;
    for (int32_t t = 0; t < a.n; t++)
      for (int64_t j = 0; j < a.L; j++) rows += a.mask[t * a.mask_tok + j] != 0;
  }
  const int64_t bytes = rows * Hkv * a.D * 4;
  int team = std::min(pool.size(), J.nitems);
  if (unit > 0) team = (int)std::min<int64_t>(team, 1 + bytes / unit);
  J.sstride = (k->scratch_bytes(k, a.group, a.D, a.L) + 63) / 64 * 64;
  if (att_scratch_.size() < J.sstride * pool.size() + 64) att_scratch_.resize(J.sstride * pool.size() + 64);
  J.scratch = att_scratch_.data() + (64 - (uintptr_t)att_scratch_.data() % 64) % 64;
  J.next.store(0, std::memory_order_relaxed);
  J.done.store(0, std::memory_order_relaxed);
  pool.start(&attention_body, &J, team);
  wait_at_least(J.done, J.nitems);
  attention_runs_.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace cpumoe_exec
