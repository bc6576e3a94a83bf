// Batched decode step: routes grouped by expert, work items taken from atomic
// counters in three stages (prepare x; gate_up + activation, the thread that
// finishes an expert group's last row block preparing that group's g; down,
// one (expert group, output row block) per item, the thread that finishes a row
// block's last group summing its route terms into y).
// Stages are ordered by completion counters, not barriers: a thread waits only
// for the work it depends on, never for another thread to arrive, so a late
// worker (waking, preempted) delays nothing and finds no work left. A down item
// waits for its expert group's g only: it starts while the last groups' gate_up
// items still run. Route terms go to per-route slots and are summed per token in
// route order from 0, the order of one down call over all routes (the down
// contract; formats' test_down_route_split). Every item is computed by exactly
// one thread in a fixed order, so the output is bit-identical for any thread
// count and any team size.
// NUMA parts (executor.h): each part runs these stages over its I-slice with its own counters, on the threads of
// the groups that run it; the row block's down items of every part count down one counter, and the item that
// completes it sums the token's terms part by part (slices in I order), each part's in route order: with one part
// that is the single pool's sum, with several it is the same sum whatever the groups, threads or teams.
#include <stdexcept>
#include <algorithm>
#include <cstring>

#include "executor.h"

namespace cpumoe_exec {
namespace {
constexpr size_t kAlign = 64;
int bad_id(int r, int K, int64_t id, int E, std::string* err) {
  if (err)
    *err = "topk_ids[" + std::to_string(r / K) + ", " + std::to_string(r % K) + "] = " + std::to_string(id) +
           " is not in [-1, " + std::to_string(E) + ")";
  return CPUMOE_ERR_EXPERT_ID;
}
char* up64(void* p) { return (char*)(((uintptr_t)p + kAlign - 1) / kAlign * kAlign); }
// the lines of [p, p + n) toward this core (into L2 and L1: other cores wrote them)
void prefetch_span(const void* p, size_t n) {
  for (size_t o = 0; o < n; o += 64) __builtin_prefetch((const char*)p + o, 0, 3);
}
}  // namespace

// Trace: the time since the last mark goes to one of the slot's sums (no clock reads when off).
struct Executor::Clock {
  TraceSlot* tr;
  int64_t mark;
  void lap(int64_t& sum) {
    if (!tr) return;
    const int64_t now = mono_ns();
    sum += now - mark, mark = now;
  }
};

int Executor::run_routed(int layer, int T, const uint16_t* x, const void* ids, int ids_bytes, const void* w,
                         bool w_bf16, uint16_t* y, std::string* err) {
  const int K = cfg_.top_k, E = cfg_.params.num_experts;
  const bool sized = layer >= 0 && layer < cfg_.num_layers && T >= 1 && T <= cfg_.max_tokens;
  if (ids_bytes != 4 && ids_bytes != 8) {
    if (err) *err = "ids_bytes=" + std::to_string(ids_bytes) + ": expected 4 (int32) or 8 (int64)";
    return CPUMOE_ERR_INTERNAL;
  }
  if (!sized || (ids_bytes == 4 && !w_bf16))  // run() refuses a bad layer or T before it reads a route
    return run(layer, T, x, (const int32_t*)ids, (const float*)w, y, err);
  const int n = T * K;
  std::vector<int32_t> ids32;
  std::vector<float> w32;
  const int32_t* ip = (const int32_t*)ids;
  const float* wp = (const float*)w;
  if (ids_bytes == 8) {
    const int64_t* src = (const int64_t*)ids;
    ids32.resize(n);
    for (int r = 0; r < n; ++r) {
      if (src[r] < -1 || src[r] >= E) return bad_id(r, K, src[r], E, err);
      ids32[r] = (int32_t)src[r];
    }
    ip = ids32.data();
  }
  if (w_bf16) {
    const uint16_t* src = (const uint16_t*)w;
    w32.resize(n);
    for (int r = 0; r < n; ++r) {
      const uint32_t bits = (uint32_t)src[r] << 16;
      std::memcpy(&w32[r], &bits, sizeof bits);
    }
    wp = w32.data();
  }
  return run(layer, T, x, ip, wp, y, err);
}

int Executor::run(int layer, int T, const uint16_t* x, const int32_t* ids, const float* w, uint16_t* y,
                  std::string* err) {
  const auto& p = cfg_.params;
  const int K = cfg_.top_k, E = p.num_experts, H = p.hidden;
  if (forked()) {  // before any lock: a parent thread may have held it at the fork
    if (err) *err = state_error();
    return CPUMOE_ERR_INTERNAL;
  }
  if (layer < 0 || layer >= cfg_.num_layers) {
    if (err) *err = "layer " + std::to_string(layer) + " is not in [0, " + std::to_string(cfg_.num_layers) + ")";
    return CPUMOE_ERR_LAYER;
  }
  if (T < 1 || T > cfg_.max_tokens) {
    if (err) *err = "num_tokens " + std::to_string(T) + " is not in [1, max_tokens=" + std::to_string(cfg_.max_tokens) + "]";
    return CPUMOE_ERR_NUM_TOKENS;
  }
  for (int r = 0; r < T * K; ++r)
    if (ids[r] < -1 || ids[r] >= E) return bad_id(r, K, ids[r], E, err);
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) {
    if (err) *err = state_error();
    return CPUMOE_ERR_INTERNAL;
  }
  quiesce_all();  // stragglers of the last step are out of body(): the scratch may change
  if (fold_pending_) fold_tails();
  for (const auto& G : groups_)
    for (size_t slot = 0; slot < G->parts.size(); ++slot)
      if (!G->banks[slot][layer].set) {
        if (err)
          *err = "banks of layer " + std::to_string(layer) + " are not set" +
                 (groups_.size() > 1 || parts_.size() > 1
                      ? " (group " + std::to_string(G->index) + ", part " + std::to_string(G->parts[slot]) + ")"
                      : "");
        return CPUMOE_ERR_LAYER;
      }
  // Group routes by expert (counting sort, stable in (t, k)).
  std::fill(count_.begin(), count_.end(), 0);
  int nroutes = 0;
  for (int r = 0; r < T * K; ++r)
    if (ids[r] >= 0) ++count_[ids[r] + 1], ++nroutes;
  if (nroutes == 0) {  // skip: nothing routed here, the pool stays asleep
    std::memset(y, 0, (size_t)T * H * sizeof(uint16_t));
    return CPUMOE_ERR_NONE;
  }
  for (int e = 0; e < E; ++e) count_[e + 1] += count_[e];
  for (int r = 0; r < T * K; ++r)
    if (ids[r] >= 0) order_[count_[ids[r]]++] = r;
  int ngroups = 0;
  for (int j = 0; j < nroutes; ++j)
    if (j == 0 || ids[order_[j]] != ids[order_[j - 1]]) gstart_[ngroups] = j, gexpert_[ngroups++] = ids[order_[j]];
  gstart_[ngroups] = nroutes;
  const bool on_in = p.apply_router_weight_on_input != 0;
  for (int j = 0; j < nroutes; ++j) rwin_[j] = on_in ? w[order_[j]] : 1.0f;
  for (auto& P : parts_) {
    // this layer's two kernels: a pointer pick per step, the inner loops are a single format's
    P->kg = P->ks[cfg_.layer_kernels[layer][0]], P->kd = P->ks[cfg_.layer_kernels[layer][1]];
    char* xp = up64(P->xprep.data());
    uint16_t* gb = (uint16_t*)up64(P->g.data());
    char* gp = up64(P->gprep.data());
    const int I = P->i1 - P->i0;
    for (int j = 0; j < nroutes; ++j) {
      const int r = order_[j];
      P->rxp[j] = xp + P->xa * (r / K);
      P->rg[j] = gb + (size_t)j * I;
      P->routes[j] = {j, ids[r], on_in ? 1.0f : w[r], 0, gp + P->ga * j};  // token = j: the route's slot in terms
    }
  }
  // Each token's route slots in route order (j ascending), for the reductions.
  std::fill(tstart_.begin(), tstart_.begin() + T + 1, 0);
  for (int j = 0; j < nroutes; ++j) ++tstart_[order_[j] / K + 1];
  for (int t = 0; t < T; ++t) tstart_[t + 1] += tstart_[t];
  for (int j = 0, t; j < nroutes; ++j) t = order_[j] / K, troutes_[tstart_[t]++] = j;
  for (int t = T; t > 0; --t) tstart_[t] = tstart_[t - 1];
  tstart_[0] = 0;
  // Work items: whole multiples of the kernel's block_hint, as few as leave about kItemsPerThread items per thread
  // in each stage. Few threads get long items, so each weight stream runs long (the prefetchers ramp up once per
  // item, a down item starts one stream per expert group): q4_0 batch 1 880-924 us per step against 1105-1135 with
  // one block_hint per item (Zen 4, 2 threads). 16 threads keep about one block_hint per item.
  size_teams(layer, nroutes, ngroups, &teams_);
  // gate_up items in the gate_up kernel's block_hint, down items in the down kernel's
  const int blk = std::max(1, parts_[0]->kd->block_hint), nhb = (H + blk - 1) / blk;
  int team_h = 1;  // the largest team on one part: the output row blocks are common to every part
  for (auto& P : parts_) {
    int team = 0;  // the threads of the groups that run P
    for (const auto& G : groups_)
      if (teams_[G->index] > 0 && std::find(G->parts.begin(), G->parts.end(), &P - &parts_[0]) != G->parts.end())
        team += G->index == 0 ? teams_[0] : teams_[G->index] - 1;
    team = std::max(team, 1);
    team_h = std::max(team_h, team);
    const int I = P->i1 - P->i0, gblk = std::max(1, P->kg->block_hint), nib = (I + gblk - 1) / gblk;
    P->iblk = gblk * std::clamp(ngroups * nib / (team * kItemsPerThread), 1, nib);
    P->n_iblk = (I + P->iblk - 1) / P->iblk;
    P->c0 = 0, P->d0 = 0, P->c1 = 0, P->c3 = 0;
    for (int grp = 0; grp < ngroups; ++grp)
      P->left[grp].store(P->n_iblk, std::memory_order_relaxed), P->gready[grp].store(0, std::memory_order_relaxed),
          P->gnext[grp].store(0, std::memory_order_relaxed), P->gdone[grp].store(0, std::memory_order_relaxed);
  }
  const int hblk = blk * std::clamp(ngroups * nhb / (team_h * kItemsPerThread), 1, nhb);
  st_ = {layer, T, nroutes, ngroups, (H + hblk - 1) / hblk, hblk, x, y};
  d3_ = 0;
  for (int hb = 0; hb < st_.n_hblk; ++hb) hleft_[hb].store(ngroups * num_parts(), std::memory_order_relaxed);
  t0_ = mono_ns();
  busy_since_.store(t0_, std::memory_order_release);
  // The other groups first (they wake while the caller starts its own); the caller runs body() in group 0 and
  // waits for the last down item: y is complete on return, while workers may still be leaving body() (the next
  // step's quiesce_all() waits for them).
  for (size_t gi = 1; gi < groups_.size(); ++gi)
    if (teams_[gi] >= 2) groups_[gi]->pool->launch(&Executor::body_tramp, groups_[gi].get(), teams_[gi]);
  groups_[0]->pool->start(&Executor::body_tramp, groups_[0].get(), teams_[0]);
  wait_at_least(d3_, st_.n_hblk);
  work_ns_.fetch_add(mono_ns() - t0_, std::memory_order_relaxed);
  work_experts_.fetch_add(ngroups, std::memory_order_relaxed);
  if (tracing_) last_done_ = mono_ns() - t0_, ++trace_steps_, trace_ns_ += last_done_, fold_pending_ = true;
  pool_runs_.fetch_add(1, std::memory_order_acq_rel);
  busy_since_.store(0, std::memory_order_release);
  return CPUMOE_ERR_NONE;
}

int Executor::size_teams(int layer, int nroutes, int ngroups, std::vector<int>* teams) const {
  const int64_t unit = team_unit_.load(std::memory_order_relaxed);
  const auto& p = cfg_.params;
  teams->assign(groups_.size(), 0);
  int total = 0;
  for (const auto& G : groups_) {
    int team = G->pool->size();
    bool shared = true;  // every part it runs is run by another group too (replicate)
    if (unit > 0) {
      // Work in bytes: the experts' weights read once per group, plus a fixed cost per row dot
      // (call, reduction, store) that dominates narrow experts; a part several groups run is shared among them.
      int64_t cost = 0;
      for (int q : G->parts) {
        const Part& P = *parts_[q];
        const int64_t dots = (int64_t)nroutes * (2 * (P.i1 - P.i0) + p.hidden);
        cost += ((int64_t)ngroups * P.expert_bytes[layer] + dots * kDotBytes) / P.sharers;
        shared = shared && P.sharers > 1;
      }
      team = (int)std::min<int64_t>(team, 1 + cost / unit);
    }
    if (G->index > 0 && team < 2) team = shared ? 0 : std::min(2, G->pool->size());  // slot 0 is nobody
    (*teams)[G->index] = team;
    total += G->index == 0 ? team : std::max(0, team - 1);
  }
  return total;
}

int Executor::team_size(int layer, int nroutes, int ngroups) const {
  std::vector<int> teams;
  return size_teams(layer, nroutes, ngroups, &teams);
}

void Executor::body(const Group& G, int tid) {
  TraceSlot* tr = tracing_ ? &trace_[G.first + (G.index == 0 ? tid : tid - 1)].s : nullptr;
  Clock c{tr, tr ? mono_ns() : 0};
  if (tr) ++tr->steps, tr->enter += c.mark - t0_;
  for (size_t slot = 0; slot < G.parts.size(); ++slot)
    part_body(*parts_[G.parts[slot]], G.banks[slot][st_.layer], c);
  if (tr) tr->exit += c.mark - t0_, tr->last_exit = c.mark - t0_;
}

void Executor::part_body(Part& P, const LayerBanks& lb, Clock& c) {
  const int H = cfg_.params.hidden, I = P.i1 - P.i0, np = num_parts();
  const Step& s = st_;
  char* xp = up64(P.xprep.data());
  TraceSlot* tr = c.tr;
  // stage 0: prepare each token's x
  for (int t; (t = P.c0.fetch_add(1, std::memory_order_relaxed)) < s.T;) {
    P.kg->prep_act(P.kg, s.x + (size_t)t * H, H, xp + P.xa * t);
    P.d0.fetch_add(1, std::memory_order_release);
  }
  wait_at_least(P.d0, s.T);  // every item is claimed: their threads finish them without waiting
  if (tr) c.lap(tr->prep);
  // stage 1: gate_up + activation, one (expert group, row block) per item; the thread that
  // completes a group's last block opens the group's route preps (g rows -> the down pass's records) and takes
  // them one by one; the down items waiting for the group take the others (8 tokens sharing an expert: 8 preps,
  // which one thread ran alone while the others waited)
  for (int it; (it = P.c1.fetch_add(1, std::memory_order_relaxed)) < s.ngroups * P.n_iblk;) {
    const int grp = it / P.n_iblk, i0 = (it % P.n_iblk) * P.iblk, a = gstart_[grp], b = gstart_[grp + 1];
    P.kg->gate_up(P.kg, lb.gu.data(), gexpert_[grp], i0, std::min(I, i0 + P.iblk), b - a, &P.rxp[a], &rwin_[a], &P.rg[a]);
    if (P.n_iblk > 1 && P.left[grp].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
    P.gready[grp].store(1, std::memory_order_release);
    prep_routes(P, grp);
  }
  if (tr) c.lap(tr->gate_up);
  // stage 2: down, one (expert group, output row block) per item, group-major (the first groups' g is ready
  // first): the group's route terms into their slots. The item that completes a row block's last group (of every
  // part) sums each token's terms in route order from 0, as one down call over all routes would (0 + term is the
  // term: the same bits), part after part, then bf16 y. Every gate_up item is claimed by now, so the group waited
  // for is being finished by a thread that never waits. Items of one expert each: the last items of a step are
  // 1 / ngroups of a row block over every route, so threads finish together (H200 host, 16 threads, batch 1:
  // 6-36 us tails before).
  for (int it; (it = P.c3.fetch_add(1, std::memory_order_relaxed)) < s.ngroups * s.n_hblk;) {
    const int grp = it / s.n_hblk, hb = it % s.n_hblk, h0 = hb * s.hblk, h1 = std::min(H, h0 + s.hblk);
    const int a = gstart_[grp], b = gstart_[grp + 1];
    for (int j = a; j < b; ++j) std::fill(&P.terms[(size_t)j * H + h0], &P.terms[(size_t)j * H + h1], 0.0f);
    if (tr) c.lap(tr->down);
    for (unsigned i = 0; !P.gready[grp].load(std::memory_order_acquire); ++i) spin_pause(i);
    prep_routes(P, grp);
    for (unsigned i = 0; P.gdone[grp].load(std::memory_order_acquire) < b - a; ++i) spin_pause(i);
    if (tr) c.lap(tr->down_wait);
    P.kd->down(P.kd, lb.dn.data(), h0, h1, &P.routes[a], b - a, P.terms.data() + h0, H);
    if (hleft_[hb].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
    // Each token's slots in route order: 0 + t1 (the slot's value) is t1 (never -0), then + t2, + t3, ...; with
    // several parts, part 0's slots, then part 1's, ...; the next token's slots are fetched while this one's are
    // summed (other threads wrote them).
    const float* terms[kMaxTopK * kMaxParts];
    for (int t = 0; t < s.T; ++t) {
      uint16_t* yt = s.y + (size_t)t * H;
      const int n = tstart_[t + 1] - tstart_[t];
      if (t + 1 < s.T)
        for (int q = 0; q < np; ++q)
          for (int r = tstart_[t + 1]; r < tstart_[t + 2]; ++r)
            prefetch_span(&parts_[q]->terms[(size_t)troutes_[r] * H + h0], (size_t)(h1 - h0) * sizeof(float));
      if (n == 0) {  // every route of the token is -1
        std::fill(yt + h0, yt + h1, (uint16_t)0);
        continue;
      }
      for (int q = 0, m = 0; q < np; ++q)
        for (int r = 0; r < n; ++r) terms[m++] = &parts_[q]->terms[(size_t)troutes_[tstart_[t] + r] * H];
      rsum_.fn(terms, n * np, h0, h1, yt);
    }
    d3_.fetch_add(1, std::memory_order_release);
  }
  if (tr) c.lap(tr->down);
}

void Executor::prep_routes(Part& P, int grp) {
  const int a = gstart_[grp], b = gstart_[grp + 1], I = P.i1 - P.i0;
  for (int j; (j = a + P.gnext[grp].fetch_add(1, std::memory_order_relaxed)) < b;) {
    P.kd->prep_act(P.kd, P.rg[j], I, const_cast<void*>(P.routes[j].act));
    P.gdone[grp].fetch_add(1, std::memory_order_release);
  }
}

void Executor::fold_tails() {
  for (int i = 0; i < nthreads_; ++i) {
    TraceSlot& s = trace_[i].s;
    if (s.last_exit >= 0) s.tail += std::max<int64_t>(0, last_done_ - s.last_exit), s.last_exit = -1;
  }
  fold_pending_ = false;
}

void Executor::set_trace(bool on) {
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  quiesce_all();
  if (fold_pending_) fold_tails();
  if (on) {
    for (int i = 0; i < nthreads_; ++i) trace_[i].s = {}, trace_[i].s.last_exit = -1;
    trace_steps_ = trace_ns_ = 0;
  }
  tracing_ = on;
}

Executor::Trace Executor::trace() {
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  quiesce_all();  // the last step's workers have added their sums
  if (fold_pending_) fold_tails();
  Trace t{trace_steps_, trace_ns_, {}};
  for (int i = 0; i < nthreads_; ++i) t.threads.push_back(trace_[i].s);
  return t;
}
}  // namespace cpumoe_exec
