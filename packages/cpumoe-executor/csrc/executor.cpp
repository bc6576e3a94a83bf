// The executor's life (construction, close, fork), its banks (in place, or placed on NUMA nodes), errors, doorbell
// tasks and the timed loops on its threads (read ceilings, compute roof). The step itself: step.cpp.
#include "executor.h"

#include <pthread.h>
#include <sched.h>
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
// Placed banks start on page boundaries (every layout's alignment, and no page holds two banks).
constexpr size_t kPage = 4096;
// A copy that first-touches placed memory is cut at 2 MiB (a transparent huge page: each is touched by one thread).
constexpr size_t kTouchChunk = 2 << 20;
// Whether the calling thread may run on exactly one CPU (pinned).
bool pinned_here() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return pthread_getaffinity_np(pthread_self(), sizeof set, &set) == 0 && CPU_COUNT(&set) == 1;
}
// The copying (first-touching) threads of a group: its workers, or its one thread where it has none (group 0's
// caller alone). i of n -> this thread's index among them, or -1.
int toucher(int group, int i, int n) {
  if (group == 0 && n > 1) return i == 0 ? -1 : i - 1;
  return i;
}
int touchers(int group, int n) { return group == 0 && n > 1 ? n - 1 : n; }
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
    : api_(api), cfg_(cfg), fork_gen_(fork_generation()), pid_(getpid()) {
  if (cfg_.top_k < 1 || cfg_.top_k > kMaxTopK)
    throw std::invalid_argument("top_k " + std::to_string(cfg_.top_k) + " outside [1, " + std::to_string(kMaxTopK) + "]");
  const auto& p = cfg_.params;
  if (cfg_.formats.empty() != cfg_.layer_kernels.empty())
    throw std::invalid_argument("formats and layer_kernels come together (both empty: params.format everywhere)");
  if (cfg_.formats.empty()) {
    cfg_.formats = {p.format};
    cfg_.layer_kernels.assign(cfg_.num_layers, {0, 0});
  }
  if ((int)cfg_.layer_kernels.size() != cfg_.num_layers)
    throw std::invalid_argument("layer_kernels has " + std::to_string(cfg_.layer_kernels.size()) +
                                " entries, expected one per layer (" + std::to_string(cfg_.num_layers) + ")");
  for (const auto& lk : cfg_.layer_kernels)
    for (int f : lk)
      if (f < 0 || f >= (int)cfg_.formats.size())
        throw std::invalid_argument("layer_kernels names format " + std::to_string(f) + " of " +
                                    std::to_string(cfg_.formats.size()));
  if (cfg_.groups.empty()) cfg_.groups = {Config::Group{-1, cfg_.cores, {0}}};
  if (cfg_.bounds.empty()) cfg_.bounds = {0, p.inter};
  const int np = (int)cfg_.bounds.size() - 1;
  if (np < 1 || np > kMaxParts || cfg_.bounds.front() != 0 || cfg_.bounds.back() != p.inter ||
      !std::is_sorted(cfg_.bounds.begin(), cfg_.bounds.end()) ||
      std::adjacent_find(cfg_.bounds.begin(), cfg_.bounds.end()) != cfg_.bounds.end())
    throw std::invalid_argument("part bounds must rise from 0 to I=" + std::to_string(p.inter) + " in 1 to " +
                                std::to_string(kMaxParts) + " parts");
  std::vector<int> sharers(np, 0);
  for (const auto& G : cfg_.groups) {
    if (G.cores.empty() || G.parts.empty()) throw std::invalid_argument("a worker group needs cores and parts");
    for (int q : G.parts) {
      if (q < 0 || q >= np) throw std::invalid_argument("a worker group runs part " + std::to_string(q) + " of " + std::to_string(np));
      ++sharers[q];
    }
  }
  for (int q = 0; q < np; ++q)
    if (!sharers[q]) throw std::invalid_argument("part " + std::to_string(q) + " is run by no worker group");
  const OmpTeam* omp = nullptr;
  if (cfg_.team_openmp) {
    if (cfg_.groups.size() > 1)
      throw std::invalid_argument("team='openmp' runs one pool: expected numa off (got " +
                                  std::to_string(cfg_.groups.size()) + " worker groups)");
    std::string why;
    omp = OmpTeam::host(&why);
    if (!omp) throw std::invalid_argument("team='openmp': " + why);
  }
  rsum_ = route_sum_for(capped_tier(api_, cfg_.tier_cap));
  const size_t T = cfg_.max_tokens, R = T * cfg_.top_k;
  for (int q = 0; q < np; ++q) {
    auto P = std::make_unique<Part>();
    P->i0 = cfg_.bounds[q], P->i1 = cfg_.bounds[q + 1], P->sharers = sharers[q];
    cpumoe_params pp = p;
    pp.inter = P->i1 - P->i0;
    for (int32_t f : cfg_.formats) {
      pp.format = f;
      char err[512] = {0};
      cpumoe_kernel* k = nullptr;
      if (api_->kernel_create(&pp, cfg_.tier_cap, &k, err, sizeof err) != 0) {
        for (auto* q : P->ks) api_->kernel_destroy(q);
        for (auto& Q : parts_)
          for (auto* q : Q->ks) api_->kernel_destroy(q);
        throw std::invalid_argument(err);
      }
      P->ks.push_back(k);
      // scratch rows fit every kernel's prepared x and g (a layer's gate_up kernel prepares x, its down kernel g)
      P->xa = std::max(P->xa, up(k->act_bytes(k, p.hidden)));
      P->ga = std::max(P->ga, up(k->act_bytes(k, pp.inter)));
    }
    P->kg = P->kd = P->ks[0];
    P->xprep.resize(P->xa * T + kAlign);
    P->g.resize(R * pp.inter * sizeof(uint16_t) + kAlign);
    P->gprep.resize(P->ga * R + kAlign);
    P->terms.resize(R * p.hidden);
    P->rxp.resize(R);
    P->rg.resize(R);
    P->routes.resize(R);
    P->expert_bytes.assign(cfg_.num_layers, 0);
    P->left.reset(new std::atomic<int>[R]);
    P->gready.reset(new std::atomic<int>[R]);
    P->gnext.reset(new std::atomic<int>[R]);
    P->gdone.reset(new std::atomic<int>[R]);
    parts_.push_back(std::move(P));
  }
  kernel_name_ = parts_[0]->ks[0]->name;
  {
    char err[512] = {0};
    if (api_->linear_create(cfg_.tier_cap, &lin_, err, sizeof err) != 0) {
      for (auto& Q : parts_)
        for (auto* q : Q->ks) api_->kernel_destroy(q);
      throw std::invalid_argument(err);
    }
    linear_name_ = lin_->name;
    if (api_->attention_create(cfg_.tier_cap, &att_, err, sizeof err) != 0) {
      api_->linear_destroy(lin_), lin_ = nullptr;
      for (auto& Q : parts_)
        for (auto* q : Q->ks) api_->kernel_destroy(q);
      throw std::invalid_argument(err);
    }
    attention_name_ = att_->name;
  }
  tstart_.resize(T + 1);
  troutes_.resize(R);
  order_.resize(R);
  gstart_.resize(R + 1);
  gexpert_.resize(R);
  count_.resize(p.num_experts + 1);
  rwin_.resize(R);
  hleft_.reset(new std::atomic<int>[p.hidden]);
  // Threads last: nothing below throws once a pool exists (a throw would skip the destructor, but each pool's own
  // destructor joins its threads).
  for (size_t gi = 0; gi < cfg_.groups.size(); ++gi) {
    const auto& C = cfg_.groups[gi];
    auto G = std::make_unique<Group>();
    G->ex = this, G->index = (int)gi, G->node = C.node, G->first = nthreads_, G->parts = C.parts;
    std::vector<int> cores = C.cores;
    if (gi > 0) cores.insert(cores.begin(), -1);  // tid 0 of a launched pool is nobody
    G->pool = std::make_unique<Pool>(cores, cfg_.pin, cfg_.spin_us, omp);
    G->banks.assign(C.parts.size(), std::vector<LayerBanks>(cfg_.num_layers));
    G->mem.assign(C.parts.size(), std::vector<std::shared_ptr<NodeMem>>(cfg_.num_layers));
    nthreads_ += G->threads();
    groups_.push_back(std::move(G));
  }
  trace_.reset(new Slot[nthreads_]());

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
  for (auto& G : groups_) G->pool->abandon();
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
    for (auto& G : groups_) G->pool->stop();
  }
  for (auto& P : parts_) {
    for (auto*& k : P->ks)
      if (k) api_->kernel_destroy(k), k = nullptr;
    P->kg = P->kd = nullptr;
    release(P->xprep), release(P->g), release(P->gprep), release(P->terms), release(P->rxp), release(P->rg);
    release(P->routes);
    P->left.reset(), P->gready.reset(), P->gnext.reset(), P->gdone.reset();
  }
  if (lin_) api_->linear_destroy(lin_), lin_ = nullptr;
  if (att_) api_->attention_destroy(att_), att_ = nullptr;
  release(lin_x_);
  for (auto& G : groups_) release(G->banks), release(G->mem);  // placed banks: freed unless a view holds them
  release(placements_), release(tstart_), release(troutes_), release(order_), release(gstart_), release(gexpert_);
  release(count_), release(rwin_);
  hleft_.reset();
}

void Executor::quiesce_all() {
  for (auto& G : groups_) G->pool->quiesce();
}

void Executor::set_hot(bool hot) {
  for (auto& G : groups_) G->pool->set_hot(hot);
}

int Executor::pinned() const {
  int n = 0;
  for (const auto& G : groups_) n += G->pool->pinned();
  return n;
}

int Executor::pool_sleepers() const {
  int n = 0;
  for (const auto& G : groups_) n += G->pool->sleepers();
  return n;
}

std::vector<std::string> Executor::kernel_names() const {
  std::vector<std::string> out;
  if (!parts_.empty())
    for (const auto* k : parts_[0]->ks) out.push_back(k ? k->name : "closed");
  return out;
}

Executor::LayerBanks Executor::layer_arrays(int layer, const std::vector<cpumoe_bank>& banks,
                                            const std::vector<int>& gu_map, const std::vector<int>& dn_map) const {
  if (gu_map.empty() != dn_map.empty()) throw std::invalid_argument("gu_map and dn_map come together");
  if (gu_map.size() > CPUMOE_MAX_BANKS || dn_map.size() > CPUMOE_MAX_BANKS)
    throw std::invalid_argument("a bank map has more than 8 slots");
  LayerBanks lb;
  if (gu_map.empty()) {
    if (cfg_.layer_kernels[layer][0] != cfg_.layer_kernels[layer][1])
      throw std::invalid_argument("layer " + std::to_string(layer) + " runs two formats: its banks need gu_map and dn_map");
    std::copy(banks.begin(), banks.end(), lb.gu.begin());
    lb.dn = lb.gu;
  } else {
    auto fill = [&](const std::vector<int>& map, std::array<cpumoe_bank, CPUMOE_MAX_BANKS>& dst) {
      for (size_t s = 0; s < map.size(); ++s) {
        if (map[s] < -1 || map[s] >= (int)banks.size())
          throw std::invalid_argument("a bank map names bank " + std::to_string(map[s]) + " of " + std::to_string(banks.size()));
        if (map[s] >= 0) dst[s] = banks[map[s]];
      }
    };
    fill(gu_map, lb.gu), fill(dn_map, lb.dn);
  }
  lb.set = true;
  return lb;
}

void Executor::set_banks(int layer, const std::vector<cpumoe_bank>& banks, const std::vector<int>& gu_map,
                         const std::vector<int>& dn_map) {
  if (layer < 0 || layer >= cfg_.num_layers) throw std::out_of_range("layer out of range");
  if (banks.size() > CPUMOE_MAX_BANKS) throw std::invalid_argument("too many banks");
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  if (groups_.size() != 1 || parts_.size() != 1)
    throw std::invalid_argument("set_banks is the single pool's (one group, one part): place_banks places them");
  const LayerBanks lb = layer_arrays(layer, banks, gu_map, dn_map);
  quiesce_all();
  groups_[0]->banks[0][layer] = lb;
  int64_t bytes = 0;  // weight bytes of one expert: what a routed group reads
  for (const auto& b : banks) bytes += b.ptr ? std::max<int64_t>(0, b.expert_stride) : 0;
  parts_[0]->expert_bytes[layer] = bytes;
}

Placement Executor::place_banks(int layer, int group, int part, const std::vector<BankSource>& src,
                                const std::vector<int>& gu_map, const std::vector<int>& dn_map) {
  if (layer < 0 || layer >= cfg_.num_layers) throw std::out_of_range("layer out of range");
  if (group < 0 || group >= (int)cfg_.groups.size()) throw std::out_of_range("group out of range");
  if (src.empty() || src.size() > CPUMOE_MAX_BANKS) throw std::invalid_argument("1 to 8 banks");
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  Group& G = *groups_[group];
  const auto it = std::find(G.parts.begin(), G.parts.end(), part);
  if (it == G.parts.end())
    throw std::invalid_argument("group " + std::to_string(group) + " does not run part " + std::to_string(part));
  const size_t slot = it - G.parts.begin();
  (void)layer_arrays(layer, std::vector<cpumoe_bank>(src.size()), gu_map, dn_map);  // the maps' checks, before the copy
  quiesce_all();
  std::vector<size_t> off(src.size());
  size_t total = 0;
  for (size_t b = 0; b < src.size(); ++b) off[b] = total, total = up(total + src[b].bytes, kPage);
  auto mem = std::make_shared<NodeMem>(total, G.node);
  // The group's own workers write the pages first (after mbind, before anyone else touches them).
  struct Ctx {
    const std::vector<BankSource>* src;
    const std::vector<size_t>* off;
    char* dst;
    size_t total;
    std::atomic<int> touched{0}, pinned{0};
  } ctx{&src, &off, (char*)mem->p, total};
  auto copy = [](void* c, int grp, int i, int n) {
    auto* x = static_cast<Ctx*>(c);
    const int k = toucher(grp, i, n), nk = touchers(grp, n);
    if (k < 0) return;
    const size_t chunks = (x->total + kTouchChunk - 1) / kTouchChunk;
    const size_t a = std::min(x->total, chunks * k / nk * kTouchChunk);
    const size_t b = std::min(x->total, chunks * (k + 1) / nk * kTouchChunk);
    for (size_t j = 0; j < x->src->size(); ++j) {  // this thread's share [a, b) of each bank's bytes
      const size_t lo = std::max(a, (*x->off)[j]), hi = std::min(b, (*x->off)[j] + (*x->src)[j].bytes);
      if (lo < hi) std::memcpy(x->dst + lo, (const char*)(*x->src)[j].ptr + (lo - (*x->off)[j]), hi - lo);
    }
    x->touched.fetch_add(1);
    if (pinned_here()) x->pinned.fetch_add(1);
  };
  run_groups(copy, &ctx, group);
  Placement pl{layer, group, part, G.node, total, mem->mbind_errno, ctx.touched.load(), ctx.pinned.load(), 0, 0, mem,
               off};
  for (int s : page_nodes(mem->p, total, 64)) pl.pages_checked += 1, pl.pages_on_node += s == G.node;
  std::vector<cpumoe_bank> placed(src.size());
  int64_t bytes = 0;
  for (size_t b = 0; b < src.size(); ++b) {
    placed[b] = {(const char*)mem->p + off[b], src[b].expert_stride, src[b].row_stride};
    bytes += std::max<int64_t>(0, src[b].expert_stride);
  }
  G.banks[slot][layer] = layer_arrays(layer, placed, gu_map, dn_map);
  parts_[part]->expert_bytes[layer] = bytes;
  G.mem[slot][layer] = mem;
  placements_.push_back(pl);
  return pl;
}

std::vector<Placement> Executor::placements() {
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  return placements_;
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

namespace {
struct GroupCall {
  void (*fn)(void*, int, int, int);
  void* ctx;
  int group, n;
};
void group_call(void* c, int tid) {
  auto* g = static_cast<GroupCall*>(c);
  g->fn(g->ctx, g->group, g->group == 0 ? tid : tid - 1, g->n);
}
}  // namespace

void Executor::run_groups(GroupFn fn, void* ctx, int which) {
  std::vector<GroupCall> calls(groups_.size());
  for (size_t gi = 0; gi < groups_.size(); ++gi) calls[gi] = {fn, ctx, (int)gi, groups_[gi]->threads()};
  for (size_t gi = 1; gi < groups_.size(); ++gi)
    if (which < 0 || which == (int)gi) groups_[gi]->pool->launch(&group_call, &calls[gi], groups_[gi]->pool->size());
  if (which <= 0) groups_[0]->pool->run(&group_call, &calls[0], groups_[0]->pool->size());
  quiesce_all();  // the launched groups are done with calls
}

template <class Ctx>
std::vector<double> Executor::timed_rates(GroupFn fn, Ctx* ctx, int reps, int which) {
  std::vector<double> out;
  for (int r = 0; r < reps; ++r) {
    ctx->done.store(0);
    const int64_t t0 = mono_ns();
    run_groups(fn, ctx, which);
    out.push_back(ctx->done.load() / ((mono_ns() - t0) * 1e-9) / 1e9);
  }
  return out;
}

std::vector<double> Executor::read_bandwidth(const void* p, size_t n, int reps) {
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  std::vector<int> first;
  for (auto& G : groups_) first.push_back(G->first);
  struct Ctx {
    const cpumoe_formats_api* api;
    const char* p;
    size_t n;
    int nt;
    const std::vector<int>* first;
    std::atomic<uint64_t> sink{0}, done{0};
  } ctx{api_, (const char*)p, n & ~(size_t)127, nthreads_, &first};
  auto fn = [](void* c, int grp, int i, int) {
    auto* x = static_cast<Ctx*>(c);
    const int tid = (*x->first)[grp] + i;
    const size_t a = x->n / x->nt * tid / 128 * 128, b = tid == x->nt - 1 ? x->n : x->n / x->nt * (tid + 1) / 128 * 128;
    x->sink.fetch_add(x->api->read_sum(x->p + a, b - a), std::memory_order_relaxed);
    x->done.fetch_add(b - a, std::memory_order_relaxed);
  };
  return timed_rates(fn, &ctx, reps);
}

std::vector<double> Executor::node_read_bandwidth(size_t bytes, int reps, int which) {
  if (which < -1 || which >= (int)groups_.size()) throw std::out_of_range("group out of range");
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  quiesce_all();
  std::vector<std::unique_ptr<NodeMem>> bufs;
  for (auto& G : groups_)
    bufs.push_back(which < 0 || which == G->index ? std::make_unique<NodeMem>(bytes & ~(size_t)127, G->node) : nullptr);
  struct Ctx {
    const cpumoe_formats_api* api;
    const std::vector<std::unique_ptr<NodeMem>>* bufs;
    size_t n;
    std::atomic<uint64_t> sink{0}, done{0};
  } ctx{api_, &bufs, bytes & ~(size_t)127};
  // each group's buffer written first by its own workers (as place_banks), then read by all its threads
  auto fill = [](void* c, int grp, int i, int n) {
    auto* x = static_cast<Ctx*>(c);
    const int k = toucher(grp, i, n), nk = touchers(grp, n);
    if (k < 0) return;
    const size_t a = x->n / nk * k, b = k == nk - 1 ? x->n : x->n / nk * (k + 1);
    std::memset((char*)(*x->bufs)[grp]->p + a, 1, b - a);
  };
  run_groups(fill, &ctx, which);
  auto fn = [](void* c, int grp, int i, int n) {
    auto* x = static_cast<Ctx*>(c);
    const size_t a = x->n / n * i / 128 * 128, b = i == n - 1 ? x->n : x->n / n * (i + 1) / 128 * 128;
    x->sink.fetch_add(x->api->read_sum((const char*)(*x->bufs)[grp]->p + a, b - a), std::memory_order_relaxed);
    x->done.fetch_add(b - a, std::memory_order_relaxed);
  };
  return timed_rates(fn, &ctx, reps, which);
}

std::vector<double> Executor::compute_peak(int kind, int tier, uint64_t iters, int reps) {
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> g(run_mu_);
  if (closed()) throw std::runtime_error(state_error());
  struct Ctx {
    const cpumoe_formats_api* api;
    int kind, tier;
    uint64_t iters;
    std::atomic<uint64_t> done{0};
  } ctx{api_, kind, tier, iters};
  auto fn = [](void* c, int, int, int) {
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
