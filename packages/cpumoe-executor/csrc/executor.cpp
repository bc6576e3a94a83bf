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
#include "executor.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

namespace cpumoe_exec {
namespace {
constexpr size_t kAlign = 64;
size_t up(size_t n, size_t a = kAlign) { return (n + a - 1) / a * a; }
// the lines of [p, p + n) toward this core (into L2 and L1: other cores wrote them)
void prefetch_span(const void* p, size_t n) {
  for (size_t o = 0; o < n; o += 64) __builtin_prefetch((const char*)p + o, 0, 3);
}
// Forks of this process so far: the child handler only bumps a lock-free counter (what a handler that runs
// between fork and exec may do), and an executor compares it with its own at each entry (one relaxed load).
std::atomic<uint64_t> g_fork_gen{0};
void on_fork_child() { g_fork_gen.fetch_add(1, std::memory_order_relaxed); }
uint64_t fork_generation() {
  static const int registered = pthread_atfork(nullptr, nullptr, &on_fork_child);
  (void)registered;
  return g_fork_gen.load(std::memory_order_relaxed);
}
template <class T>
void release(std::vector<T>& v) {
  std::vector<T>().swap(v);
}
}  // namespace

IoMem::IoMem(size_t bytes) : n(bytes) {
  p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("cannot allocate the IO block (" + std::to_string(bytes) + " bytes)");
}

IoMem::~IoMem() { munmap(p, n); }

int capped_tier(const cpumoe_formats_api* api, int tier_cap) {
  const int cap = tier_cap >= 0 ? tier_cap : api->tier_cap();
  return cap >= 0 ? std::min(api->detected_tier(), cap) : api->detected_tier();
}

int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Executor::Executor(const cpumoe_formats_api* api, const Config& cfg)
    : api_(api), cfg_(cfg), pool_(cfg.cores, cfg.pin, cfg.spin_us), fork_gen_(fork_generation()), pid_(getpid()) {
  if (cfg_.top_k < 1 || cfg_.top_k > kMaxTopK)
    throw std::invalid_argument("top_k " + std::to_string(cfg_.top_k) + " outside [1, " + std::to_string(kMaxTopK) + "]");
  char err[512] = {0};
  if (api_->kernel_create(&cfg_.params, cfg_.tier_cap, &k_, err, sizeof err) != 0) throw std::invalid_argument(err);
  kernel_name_ = k_->name;
  rsum_ = route_sum_for(capped_tier(api_, cfg_.tier_cap));
  const auto& p = cfg_.params;
  const size_t T = cfg_.max_tokens, R = T * cfg_.top_k;
  banks_.assign(cfg_.num_layers, {});
  xa_ = up(k_->act_bytes(k_, p.hidden));
  ga_ = up(k_->act_bytes(k_, p.inter));
  xprep_.resize(xa_ * T + kAlign);
  g_.resize(R * p.inter * sizeof(uint16_t) + kAlign);
  gprep_.resize(ga_ * R + kAlign);
  part_.resize(R * p.hidden);
  tstart_.resize(T + 1);
  troutes_.resize(R);
  order_.resize(R);
  gstart_.resize(R + 1);
  gexpert_.resize(R);
  count_.resize(p.num_experts + 1);
  rxp_.resize(R);
  rwin_.resize(R);
  rg_.resize(R);
  routes_.resize(R);
  left_.reset(new std::atomic<int>[R]);
  gready_.reset(new std::atomic<int>[R]);
  gnext_.reset(new std::atomic<int>[R]);
  gdone_.reset(new std::atomic<int>[R]);
  hleft_.reset(new std::atomic<int>[p.hidden]);
  expert_bytes_.assign(cfg_.num_layers, 0);
  trace_.reset(new Slot[pool_.size()]());

  // IO block (protocol v1): page-aligned, header then 64-byte aligned arrays.
  const size_t H = p.hidden, K = cfg_.top_k;
  size_t off = sizeof(cpumoe_iob_header);
  const size_t x_off = up(off), ids_off = up(x_off + T * H * 2), w_off = up(ids_off + T * K * 4),
               y_off = up(w_off + T * K * 4), total = up(y_off + T * H * 2, 4096);
  iom_ = std::make_shared<IoMem>(total);
  iob_ = static_cast<cpumoe_iob_header*>(iom_->p);
  iob_->magic = CPUMOE_IOB_MAGIC;
  iob_->version = CPUMOE_PROTOCOL_VERSION;
  iob_->header_bytes = sizeof(cpumoe_iob_header);
  iob_->hidden = (uint32_t)H;
  iob_->top_k = (uint32_t)K;
  iob_->max_tokens = (uint32_t)T;
  iob_->num_layers = (uint32_t)cfg_.num_layers;
  iob_->x_off = x_off, iob_->ids_off = ids_off, iob_->w_off = w_off, iob_->y_off = y_off, iob_->total_bytes = total;
  ready_ = &iob_->ready, done_ = &iob_->done, error_ = &iob_->error;
}

Executor::~Executor() {
  close();
  for (auto* a : args_) delete a;  // the hostfn arguments live as long as the object (graphs captured them)
}

bool Executor::forked() const { return fork_gen_ != g_fork_gen.load(std::memory_order_relaxed); }

std::string Executor::state_error() const {
  if (forked())
    return cfg_.label + " was created in process " + std::to_string(pid_) + " and this is a forked child (pid " +
           std::to_string(getpid()) + "): its worker threads exist only in the parent. Create a new executor in "
           "the child (or start child processes with multiprocessing's 'spawn' or 'forkserver' method)";
  if (closed()) return cfg_.label + " is closed (close() joined its threads and freed its buffers): create a new one";
  return {};
}

void Executor::abandon_threads() {
  pool_.abandon();
  if (coord_.joinable()) (void)new std::thread(std::move(coord_));  // leaked: the parent's coordinator
  coord_running_.store(false, std::memory_order_release);
}

void Executor::close() {
  if (forked()) {  // no lock: a parent thread may have held one at the fork, and nothing else runs here
    if (closed_.exchange(true)) return;
    abandon_threads();
  } else {
    std::lock_guard<std::mutex> c(coord_mu_);
    stop_coordinator_locked();
    std::lock_guard<std::mutex> g(run_mu_);  // the step in flight ends first
    if (closed_.exchange(true, std::memory_order_acq_rel)) return;
    pool_.stop();
  }
  if (k_) api_->kernel_destroy(k_), k_ = nullptr;
  release(xprep_), release(g_), release(gprep_), release(part_), release(tstart_), release(troutes_);
  release(order_), release(gstart_), release(gexpert_), release(count_), release(rxp_), release(rwin_);
  release(rg_), release(routes_), release(banks_);
  left_.reset(), gready_.reset(), gnext_.reset(), gdone_.reset(), hleft_.reset();
}

void Executor::set_banks(int layer, const std::vector<cpumoe_bank>& banks) {
  if (layer < 0 || layer >= cfg_.num_layers) throw std::out_of_range("layer out of range");
  if (banks.size() > CPUMOE_MAX_BANKS) throw std::invalid_argument("too many banks");
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  pool_.quiesce();
  banks_[layer] = {};
  std::copy(banks.begin(), banks.end(), banks_[layer].begin());
  int64_t bytes = 0;  // weight bytes of one expert: what a routed group reads
  for (const auto& b : banks) bytes += b.ptr ? std::max<int64_t>(0, b.expert_stride) : 0;
  expert_bytes_[layer] = bytes;
}

int Executor::run(int layer, int T, const uint16_t* x, const int32_t* ids, const float* w, uint16_t* y,
                  std::string* err) {
  const auto& p = cfg_.params;
  const int K = cfg_.top_k, E = p.num_experts, H = p.hidden, I = p.inter;
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
    if (ids[r] < -1 || ids[r] >= E) {
      if (err)
        *err = "topk_ids[" + std::to_string(r / K) + ", " + std::to_string(r % K) + "] = " + std::to_string(ids[r]) +
               " is not in [-1, " + std::to_string(E) + ")";
      return CPUMOE_ERR_EXPERT_ID;
    }
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) {
    if (err) *err = state_error();
    return CPUMOE_ERR_INTERNAL;
  }
  pool_.quiesce();  // stragglers of the last step are out of body(): the scratch may change
  if (fold_pending_) fold_tails();
  if (!banks_[layer][0].ptr) {
    if (err) *err = "banks of layer " + std::to_string(layer) + " are not set";
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
  char* xp = (char*)up((uintptr_t)xprep_.data());
  uint16_t* gb = (uint16_t*)up((uintptr_t)g_.data());
  char* gp = (char*)up((uintptr_t)gprep_.data());
  const bool on_in = p.apply_router_weight_on_input != 0;
  for (int j = 0; j < nroutes; ++j) {
    const int r = order_[j];
    rxp_[j] = xp + xa_ * (r / K);
    rwin_[j] = on_in ? w[r] : 1.0f;
    rg_[j] = gb + (size_t)j * I;
    routes_[j] = {j, ids[r], on_in ? 1.0f : w[r], 0, gp + ga_ * j};  // token = j: the route's slot in part_
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
  const int blk = std::max(1, k_->block_hint), team = team_size(layer, nroutes, ngroups);
  const int nib = (I + blk - 1) / blk, nhb = (H + blk - 1) / blk;
  const int iblk = blk * std::clamp(ngroups * nib / (team * kItemsPerThread), 1, nib);
  const int hblk = blk * std::clamp(ngroups * nhb / (team * kItemsPerThread), 1, nhb);
  st_ = {layer, T, nroutes, ngroups, (I + iblk - 1) / iblk, (H + hblk - 1) / hblk, iblk, hblk, x, y, banks_[layer].data()};
  c0_ = 0, c1_ = 0, c3_ = 0, d0_ = 0, d3_ = 0;
  for (int grp = 0; grp < ngroups; ++grp)
    left_[grp].store(st_.n_iblk, std::memory_order_relaxed), gready_[grp].store(0, std::memory_order_relaxed),
        gnext_[grp].store(0, std::memory_order_relaxed), gdone_[grp].store(0, std::memory_order_relaxed);
  for (int hb = 0; hb < st_.n_hblk; ++hb) hleft_[hb].store(ngroups, std::memory_order_relaxed);
  t0_ = mono_ns();
  busy_since_.store(t0_, std::memory_order_release);
  // The caller runs body() too and waits for the last down item: y is complete on return,
  // while workers may still be leaving body() (the next step's quiesce() waits for them).
  pool_.start(&Executor::body_tramp, this, team);
  wait_at_least(d3_, st_.n_hblk);
  if (tracing_) last_done_ = mono_ns() - t0_, ++trace_steps_, trace_ns_ += last_done_, fold_pending_ = true;
  pool_runs_.fetch_add(1, std::memory_order_acq_rel);
  busy_since_.store(0, std::memory_order_release);
  return CPUMOE_ERR_NONE;
}

int Executor::team_size(int layer, int nroutes, int ngroups) const {
  const int64_t unit = team_unit_.load(std::memory_order_relaxed);
  if (unit <= 0) return pool_.size();
  const auto& p = cfg_.params;
  // Work in bytes: the experts' weights read once per group, plus a fixed cost per row dot
  // (call, reduction, store) that dominates narrow experts.
  const int64_t dots = (int64_t)nroutes * (2 * p.inter + p.hidden);
  const int64_t cost = (int64_t)ngroups * expert_bytes_[layer] + dots * kDotBytes;
  return (int)std::min<int64_t>(pool_.size(), 1 + cost / unit);
}

void Executor::body(int tid) {
  const auto& p = cfg_.params;
  const int H = p.hidden, I = p.inter;
  const Step& s = st_;
  char* xp = (char*)up((uintptr_t)xprep_.data());
  // Trace: the time since the last mark goes to one of the slot's sums (no clock reads when off).
  TraceSlot* tr = tracing_ ? &trace_[tid].s : nullptr;
  int64_t mark = tr ? mono_ns() : 0;
  auto lap = [&](int64_t& sum) {
    if (!tr) return;
    const int64_t now = mono_ns();
    sum += now - mark, mark = now;
  };
  if (tr) ++tr->steps, tr->enter += mark - t0_;
  // stage 0: prepare each token's x
  for (int t; (t = c0_.fetch_add(1, std::memory_order_relaxed)) < s.T;) {
    k_->prep_act(k_, s.x + (size_t)t * H, H, xp + xa_ * t);
    d0_.fetch_add(1, std::memory_order_release);
  }
  wait_at_least(d0_, s.T);  // every item is claimed: their threads finish them without waiting
  if (tr) lap(tr->prep);
  // stage 1: gate_up + activation, one (expert group, row block) per item; the thread that
  // completes a group's last block opens the group's route preps (g rows -> the down pass's records) and takes
  // them one by one; the down items waiting for the group take the others (8 tokens sharing an expert: 8 preps,
  // which one thread ran alone while the others waited)
  for (int it; (it = c1_.fetch_add(1, std::memory_order_relaxed)) < s.ngroups * s.n_iblk;) {
    const int grp = it / s.n_iblk, i0 = (it % s.n_iblk) * s.iblk, a = gstart_[grp], b = gstart_[grp + 1];
    k_->gate_up(k_, s.banks, gexpert_[grp], i0, std::min(I, i0 + s.iblk), b - a, &rxp_[a], &rwin_[a], &rg_[a]);
    if (s.n_iblk > 1 && left_[grp].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
    gready_[grp].store(1, std::memory_order_release);
    prep_routes(grp);
  }
  if (tr) lap(tr->gate_up);
  // stage 2: down, one (expert group, output row block) per item, group-major (the first groups' g is ready
  // first): the group's route terms into their slots of part_. The item that completes a row block's last group
  // sums each token's terms in route order from 0, as one down call over all routes would (0 + term is the term:
  // the same bits), then bf16 y. Every gate_up item is claimed by now, so the group waited for is being finished
  // by a thread that never waits. Items of one expert each: the last items of a step are 1 / ngroups of a row
  // block over every route, so threads finish together (H200 host, 16 threads, batch 1: 6-36 us tails before).
  for (int it; (it = c3_.fetch_add(1, std::memory_order_relaxed)) < s.ngroups * s.n_hblk;) {
    const int grp = it / s.n_hblk, hb = it % s.n_hblk, h0 = hb * s.hblk, h1 = std::min(H, h0 + s.hblk);
    const int a = gstart_[grp], b = gstart_[grp + 1];
    for (int j = a; j < b; ++j) std::fill(&part_[(size_t)j * H + h0], &part_[(size_t)j * H + h1], 0.0f);
    if (tr) lap(tr->down);
    for (unsigned i = 0; !gready_[grp].load(std::memory_order_acquire); ++i) spin_pause(i);
    prep_routes(grp);
    for (unsigned i = 0; gdone_[grp].load(std::memory_order_acquire) < b - a; ++i) spin_pause(i);
    if (tr) lap(tr->down_wait);
    k_->down(k_, s.banks, h0, h1, &routes_[a], b - a, part_.data() + h0, H);
    if (hleft_[hb].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
    // Each token's slots in route order: 0 + t1 (the slot's value) is t1 (never -0), then + t2, + t3, ...; the
    // next token's slots are fetched while this one's are summed (other threads wrote them).
    const float* terms[kMaxTopK];
    for (int t = 0; t < s.T; ++t) {
      uint16_t* yt = s.y + (size_t)t * H;
      const int n = tstart_[t + 1] - tstart_[t];
      if (t + 1 < s.T)
        for (int q = tstart_[t + 1]; q < tstart_[t + 2]; ++q)
          prefetch_span(&part_[(size_t)troutes_[q] * H + h0], (size_t)(h1 - h0) * sizeof(float));
      if (n == 0) {  // every route of the token is -1
        std::fill(yt + h0, yt + h1, (uint16_t)0);
        continue;
      }
      for (int q = 0; q < n; ++q) terms[q] = &part_[(size_t)troutes_[tstart_[t] + q] * H];
      rsum_.fn(terms, n, h0, h1, yt);
    }
    d3_.fetch_add(1, std::memory_order_release);
  }
  if (tr) lap(tr->down), tr->exit += mark - t0_, tr->last_exit = mark - t0_;
}

void Executor::prep_routes(int grp) {
  const int a = gstart_[grp], b = gstart_[grp + 1], I = cfg_.params.inter;
  for (int j; (j = a + gnext_[grp].fetch_add(1, std::memory_order_relaxed)) < b;) {
    k_->prep_act(k_, rg_[j], I, const_cast<void*>(routes_[j].act));
    gdone_[grp].fetch_add(1, std::memory_order_release);
  }
}

void Executor::fold_tails() {
  for (int i = 0; i < pool_.size(); ++i) {
    TraceSlot& s = trace_[i].s;
    if (s.last_exit >= 0) s.tail += std::max<int64_t>(0, last_done_ - s.last_exit), s.last_exit = -1;
  }
  fold_pending_ = false;
}

void Executor::set_trace(bool on) {
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  pool_.quiesce();
  if (fold_pending_) fold_tails();
  if (on) {
    for (int i = 0; i < pool_.size(); ++i) trace_[i].s = {}, trace_[i].s.last_exit = -1;
    trace_steps_ = trace_ns_ = 0;
  }
  tracing_ = on;
}

Executor::Trace Executor::trace() {
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  pool_.quiesce();  // the last step's workers have added their sums
  if (fold_pending_) fold_tails();
  Trace t{trace_steps_, trace_ns_, {}};
  for (int i = 0; i < pool_.size(); ++i) t.threads.push_back(trace_[i].s);
  return t;
}

void Executor::set_error(int code, const std::string& msg) {
  if (forked()) {  // the word only: err_mu_ may have been held by a parent thread at the fork
    uint64_t none = 0;
    __atomic_compare_exchange_n(error_, &none, (uint64_t)code, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return;
  }
  std::lock_guard<std::mutex> g(err_mu_);
  if (__atomic_load_n(error_, __ATOMIC_ACQUIRE) == 0) {
    last_error_ = msg;
    __atomic_store_n(error_, (uint64_t)code, __ATOMIC_RELEASE);
  }
}

std::string Executor::last_error() {
  std::lock_guard<std::mutex> g(err_mu_);
  return last_error_;
}

void Executor::clear_error() {
  std::lock_guard<std::mutex> g(err_mu_);
  last_error_.clear();
  __atomic_store_n(error_, 0, __ATOMIC_RELEASE);
}

int Executor::run_task(uint64_t task) {
  const char* base = reinterpret_cast<const char*>(iob_);
  const uint32_t layer = CPUMOE_TASK_LAYER(task), T = CPUMOE_TASK_TOKENS(task);
  std::string err;
  int rc;
  if (forked() || closed()) {
    rc = CPUMOE_ERR_INTERNAL, err = state_error();
  } else if (layer >= (uint32_t)cfg_.num_layers) {
    rc = CPUMOE_ERR_LAYER, err = "layer " + std::to_string(layer) + " >= num_layers " + std::to_string(cfg_.num_layers);
  } else if (T < 1 || T > (uint32_t)cfg_.max_tokens) {
    rc = CPUMOE_ERR_NUM_TOKENS, err = "num_tokens " + std::to_string(T) + " > max_tokens";
  } else {
    rc = run((int)layer, (int)T, (const uint16_t*)(base + iob_->x_off), (const int32_t*)(base + iob_->ids_off),
             (const float*)(base + iob_->w_off), (uint16_t*)(base + iob_->y_off), &err);
  }
  if (rc != CPUMOE_ERR_NONE) set_error(rc, "task layer=" + std::to_string(layer) + " num_tokens=" + std::to_string(T) + ": " + err);
  return rc;
}

template <class Ctx>
std::vector<double> Executor::timed_rates(Pool::Fn fn, Ctx* ctx, int reps) {
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  std::vector<double> out;
  for (int r = 0; r < reps; ++r) {
    ctx->done.store(0);
    const int64_t t0 = mono_ns();
    pool_.run(fn, ctx);
    out.push_back(ctx->done.load() / ((mono_ns() - t0) * 1e-9) / 1e9);
  }
  return out;
}

std::vector<double> Executor::read_bandwidth(const void* p, size_t n, int reps) {
  struct Ctx {
    const cpumoe_formats_api* api;
    const char* p;
    size_t n;
    int nt;
    std::atomic<uint64_t> sink{0}, done{0};
  } ctx{api_, (const char*)p, n & ~(size_t)127, pool_.size()};
  auto fn = [](void* c, int tid) {
    auto* x = static_cast<Ctx*>(c);
    const size_t a = x->n / x->nt * tid / 128 * 128, b = tid == x->nt - 1 ? x->n : x->n / x->nt * (tid + 1) / 128 * 128;
    x->sink.fetch_add(x->api->read_sum(x->p + a, b - a), std::memory_order_relaxed);
    x->done.fetch_add(b - a, std::memory_order_relaxed);
  };
  return timed_rates(fn, &ctx, reps);
}

std::vector<double> Executor::compute_peak(int kind, int tier, uint64_t iters, int reps) {
  struct Ctx {
    const cpumoe_formats_api* api;
    int kind, tier;
    uint64_t iters;
    std::atomic<uint64_t> done{0};
  } ctx{api_, kind, tier, iters};
  auto fn = [](void* c, int) {
    auto* x = static_cast<Ctx*>(c);
    x->done.fetch_add(x->api->peak_loop(x->kind, x->tier, x->iters), std::memory_order_relaxed);
  };
  std::vector<double> out = timed_rates(fn, &ctx, reps);
  if (!out.empty() && out[0] == 0) out.clear();  // the tier has no such loop here
  return out;
}

int64_t Executor::busy_ns() const {
  const int64_t s = busy_since_.load(std::memory_order_acquire);
  return s ? mono_ns() - s : 0;
}
}  // namespace cpumoe_exec
