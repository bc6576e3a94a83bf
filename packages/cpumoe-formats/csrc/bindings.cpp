// pybind11 module cpumoe_formats._native: thin; validation of arrays lives in
// Python (cpumoe_formats/_arrays.py), invariants the kernels rely on are
// re-checked in kernel_create / moe_step.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pthread.h>

#include <atomic>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpumoe_formats/nogil.h"
#include "registry.h"
#include "tiers.h"

namespace py = pybind11;
using namespace cpumoe;

namespace {
std::vector<cpumoe_bank> to_banks(const std::vector<std::tuple<uint64_t, int64_t, int64_t>>& v) {
  std::vector<cpumoe_bank> b(CPUMOE_MAX_BANKS, cpumoe_bank{nullptr, 0, 0});
  if (v.size() > CPUMOE_MAX_BANKS) throw py::value_error("at most 8 banks");
  for (size_t i = 0; i < v.size(); ++i)
    b[i] = {(const void*)(uintptr_t)std::get<0>(v[i]), std::get<1>(v[i]), std::get<2>(v[i])};
  return b;
}

// A call's claim on the bytes it writes (out) or reads (x, ids, w) while the GIL is released, so that a
// concurrent call (another thread) writing memory that one in flight uses raises instead of racing. Entries are
// added and removed with the GIL held, which orders them; a forked child starts with none (the threads that
// held them do not exist there).
struct Span {
  uintptr_t lo, hi;
  bool write;
};
std::vector<Span>& in_flight() {
  static std::vector<Span>* v = new std::vector<Span>();  // never destroyed: daemon threads may outlive statics
  return *v;
}
void clear_in_flight_in_child() { in_flight().clear(); }
class Claim {
 public:
  Claim(std::initializer_list<Span> spans) {
    auto& v = in_flight();
    for (const Span& s : spans) {
      if (s.hi <= s.lo) continue;
      for (const Span& o : v)
        if (s.lo < o.hi && o.lo < s.hi && (s.write || o.write))
          throw std::runtime_error(std::string(s.write ? "out" : "an input") +
                                " overlaps memory that a call in flight on another thread " +
                                (o.write ? "writes (its out)" : "reads (its x, topk_ids or topk_weights)") +
                                "; give each concurrent call its own out array");
    }
    mine_.reserve(spans.size());
    v.reserve(v.size() + spans.size());  // no push_back below can throw and leave a claim behind
    for (const Span& s : spans)
      if (s.hi > s.lo) v.push_back(s), mine_.push_back(s);
  }
  ~Claim() {  // with the GIL held again
    auto& v = in_flight();
    for (const Span& s : mine_)
      for (size_t i = v.size(); i-- > 0;)
        if (v[i].lo == s.lo && v[i].hi == s.hi && v[i].write == s.write) {
          v.erase(v.begin() + (std::ptrdiff_t)i);
          break;
        }
  }
  Claim(const Claim&) = delete;
  Claim& operator=(const Claim&) = delete;

 private:
  std::vector<Span> mine_;
};
Span span(uint64_t p, size_t n, bool write) { return Span{(uintptr_t)p, (uintptr_t)p + n, write}; }

// What a Kernel owns: the native kernel and the step scratch. Held by shared_ptr: close() drops the Kernel's
// reference and a call in flight on another thread keeps its own, so the kernel is freed after the last call.
struct KernelState {
  cpumoe_kernel* k = nullptr;
  std::vector<char> scratch;                 // the step scratch of the call holding scratch_busy
  std::atomic<bool> scratch_busy{false};     // a concurrent call allocates its own scratch instead
  ~KernelState() { kernel_destroy(k); }
};

// Thread contract: shareable. Every method may be called from any number of threads at once: the native kernel
// is read-only after creation, and moe_step uses the kernel's scratch when it is free (one uncontended atomic
// exchange) or its own. close() may race calls in flight; they finish on the state they hold.
class Kernel {
 public:
  Kernel(int format, int act, int mode, bool apply_on_input, int E, int H, int I, float alpha, float limit,
         int tier_cap) {
    cpumoe_params p{format, act, mode, apply_on_input ? 1 : 0, E, H, I, alpha, limit};
    char err[512] = {0};
    cpumoe_kernel* k = nullptr;
    if (kernel_create(&p, tier_cap, &k, err, sizeof err) != 0) throw py::value_error(err);
    st_ = std::make_shared<KernelState>();
    st_->k = k;
  }
  // Methods run with the GIL held until they release it: st_ is read and reset under the GIL only.
  std::shared_ptr<KernelState> live() const {
    if (!st_) throw std::runtime_error("cpumoe_formats._native.Kernel is closed");
    return st_;
  }
  void close() { st_.reset(); }
  bool closed() const { return !st_; }
  std::string name() const { return live()->k->name; }
  int tier() const { return live()->k->tier; }
  int block_hint() const { return live()->k->block_hint; }
  size_t act_bytes(int K) const {
    auto s = live();
    return s->k->act_bytes(s->k, K);
  }
  void prep_act(uint64_t src, int K, uint64_t dst) const {
    auto s = live();
    NoGil nogil;
    s->k->prep_act(s->k, (const uint16_t*)(uintptr_t)src, K, (void*)(uintptr_t)dst);
  }
  void gate_up(const std::vector<std::tuple<uint64_t, int64_t, int64_t>>& banks, int e, int i0, int i1,
               const std::vector<uint64_t>& xs, const std::vector<float>& w_in, const std::vector<uint64_t>& gs) const {
    auto s = live();
    const auto& p = s->k->params;
    if (e < 0 || e >= p.num_experts) throw py::value_error("expert id out of range");
    if (i0 < 0 || i1 > p.inter || i0 >= i1) throw py::value_error("need 0 <= i0 < i1 <= I");
    if (xs.size() != w_in.size() || xs.size() != gs.size() || xs.empty())
      throw py::value_error("xs, w_in and g need the same non-zero length");
    auto b = to_banks(banks);
    std::vector<const void*> xp(xs.size());
    std::vector<uint16_t*> gp;
    for (auto g : gs) gp.push_back((uint16_t*)(uintptr_t)g);
    for (size_t j = 0; j < xs.size(); ++j) xp[j] = (const void*)(uintptr_t)xs[j];
    NoGil nogil;
    s->k->gate_up(s->k, b.data(), e, i0, i1, (int)xs.size(), xp.data(), w_in.data(), gp.data());
  }
  void down(const std::vector<std::tuple<uint64_t, int64_t, int64_t>>& banks, int h0, int h1,
            const std::vector<std::tuple<int, int, float, uint64_t>>& routes, uint64_t acc, int64_t acc_stride) const {
    auto s = live();
    const auto& p = s->k->params;
    if (h0 < 0 || h1 > p.hidden || h0 >= h1) throw py::value_error("need 0 <= h0 < h1 <= H");
    std::vector<cpumoe_route> r;
    for (auto& t : routes) {
      if (std::get<1>(t) < 0 || std::get<1>(t) >= p.num_experts) throw py::value_error("expert id out of range");
      r.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t), 0, (const void*)(uintptr_t)std::get<3>(t)});
    }
    if (r.empty()) throw py::value_error("down needs at least one route");
    auto b = to_banks(banks);
    NoGil nogil;
    s->k->down(s->k, b.data(), h0, h1, r.data(), (int)r.size(), (float*)(uintptr_t)acc, acc_stride);
  }
  void moe_step(const std::vector<std::tuple<uint64_t, int64_t, int64_t>>& banks, int T, int top_k, uint64_t x,
                uint64_t ids, uint64_t w, uint64_t y) {
    auto s = live();
    const int H = s->k->params.hidden;
    if (T < 0 || top_k <= 0) throw py::value_error("num_tokens must be >= 0 and top_k > 0");
    auto b = to_banks(banks);
    const size_t th = (size_t)T * H * sizeof(uint16_t), tk = (size_t)T * top_k;
    const Claim claim{span(y, th, true), span(x, th, false), span(ids, tk * 4, false), span(w, tk * 4, false)};
    char err[256] = {0};
    int rc;
    {
      NoGil nogil;
      rc = step(*s, b.data(), T, top_k, x, ids, w, y, err, sizeof err);
    }
    if (rc != 0) throw py::value_error(err);
  }

 private:
  static int step(KernelState& s, const cpumoe_bank* b, int T, int top_k, uint64_t x, uint64_t ids, uint64_t w,
                  uint64_t y, char* err, size_t errlen) {
    const size_t need = step_scratch_bytes(s.k, T, top_k);
    std::unique_ptr<char[]> own;
    char* scratch;
    const bool shared = !s.scratch_busy.exchange(true, std::memory_order_acquire);
    struct Release {
      std::atomic<bool>* flag;
      ~Release() {
        if (flag) flag->store(false, std::memory_order_release);
      }
    } release{shared ? &s.scratch_busy : nullptr};
    if (shared) {
      if (s.scratch.size() < need) s.scratch.resize(need);
      scratch = s.scratch.data();
    } else {
      own.reset(new char[need]);
      scratch = own.get();
    }
    return cpumoe::moe_step(s.k, b, T, top_k, (const uint16_t*)(uintptr_t)x, (const int32_t*)(uintptr_t)ids,
                            (const float*)(uintptr_t)w, (uint16_t*)(uintptr_t)y, scratch, err, errlen);
  }
  std::shared_ptr<KernelState> st_;
};
// The dense bf16 linear (ABI 1.9), single-threaded: what the executor runs on its threads, here for tests and
// tools. Thread contract: shareable; the native kernel is stateless and read-only, each call prepares x into a
// buffer of its own; concurrent calls follow Kernel's rule (a call's out may not overlap another's memory).
struct LinearState {
  cpumoe_linear* k = nullptr;
  ~LinearState() { linear_destroy(k); }
};
class Linear {
 public:
  explicit Linear(int tier_cap) {
    char err[512] = {0};
    cpumoe_linear* k = nullptr;
    if (linear_create(tier_cap, &k, err, sizeof err) != 0) throw py::value_error(err);
    st_ = std::make_shared<LinearState>();
    st_->k = k;
  }
  std::shared_ptr<LinearState> live() const {
    if (!st_) throw std::runtime_error("cpumoe_formats._native.Linear is closed");
    return st_;
  }
  void close() { st_.reset(); }
  bool closed() const { return !st_; }
  std::string name() const { return live()->k->name; }
  int tier() const { return live()->k->tier; }
  int row_block() const { return live()->k->row_block; }
  size_t x_bytes(int K) const {
    auto s = live();
    return s->k->x_bytes(s->k, K);
  }
  // Rows [r0, r1) of y for n tokens; pointers and byte strides checked by the Python caller (linear.py).
  void rows(uint64_t w, int64_t w_stride, int K, int M, int r0, int r1, int n, uint64_t x, int64_t x_stride,
            uint64_t bias, uint64_t y, int64_t y_stride, bool y_fp32) const {
    auto s = live();
    if (K < 1 || M < 1 || n < 1) throw py::value_error("need K >= 1, M >= 1 and n >= 1");
    if (r0 < 0 || r1 > M || r0 >= r1) throw py::value_error("need 0 <= r0 < r1 <= M");
    const size_t yb = (size_t)(n - 1) * y_stride + (size_t)M * (y_fp32 ? 4 : 2);
    const size_t xb = (size_t)(n - 1) * x_stride + (size_t)K * 2;
    const Claim claim{span(y, yb, true), span(x, xb, false), span(w, (size_t)(M - 1) * w_stride + 2 * K, false)};
    NoGil nogil;
    const cpumoe_linear* k = s->k;
    const size_t xp = k->x_bytes(k, K);
    std::vector<char> buf;
    const void* xr = (const void*)(uintptr_t)x;
    int64_t xs = x_stride;
    if (xp) {  // the tier's prepared rows
      buf.resize(xp * n + 64);
      char* d = buf.data() + (64 - (uintptr_t)buf.data() % 64) % 64;
      for (int t = 0; t < n; ++t) k->prep_x(k, (const uint16_t*)(uintptr_t)(x + (uint64_t)t * x_stride), K, d + xp * t);
      xr = d, xs = (int64_t)xp;
    }
    k->rows(k, (const void*)(uintptr_t)w, w_stride, K, r0, r1, n, xr, xs, (const uint16_t*)(uintptr_t)bias,
            (void*)(uintptr_t)y, y_stride, y_fp32 ? 1 : 0);
  }

 private:
  std::shared_ptr<LinearState> st_;
};
// Decode attention (ABI 1.11), single-threaded on the calling thread. Thread contract: shareable, as Linear (each
// call its own scratch; a call's o may not overlap another call's memory).
struct AttentionState {
  cpumoe_attention* k = nullptr;
  ~AttentionState() { attention_destroy(k); }
};
class Attention {
 public:
  explicit Attention(int tier_cap) {
    char err[512] = {0};
    cpumoe_attention* k = nullptr;
    if (attention_create(tier_cap, &k, err, sizeof err) != 0) throw py::value_error(err);
    st_ = std::make_shared<AttentionState>();
    st_->k = k;
  }
  std::shared_ptr<AttentionState> live() const {
    if (!st_) throw std::runtime_error("cpumoe_formats._native.Attention is closed");
    return st_;
  }
  void close() { st_.reset(); }
  bool closed() const { return !st_; }
  std::string name() const { return live()->k->name; }
  int tier() const { return live()->k->tier; }
  // Every kv head of n tokens. Pointers, element strides and sizes are checked by the Python callers
  // (attention.py, moe_engine's attention); the spans below cover each array's last element.
  void run(int n, int group, int D, int L, int Hkv, uint64_t q, int64_t q_tok, int64_t q_head, uint64_t k,
           int64_t k_head, int64_t k_pos, uint64_t v, int64_t v_head, int64_t v_pos, uint64_t mask,
           int64_t mask_tok, float scale, uint64_t o, int64_t o_tok, int64_t o_head) const {
    auto s = live();
    if (n < 1 || group < 1 || D < 1 || L < 1 || Hkv < 1)
      throw py::value_error("need n, group, D, L and Hkv >= 1");
    if (q_tok < 0 || q_head < 0 || k_head < 0 || k_pos < 0 || v_head < 0 || v_pos < 0 || mask_tok < 0 || o_tok < 0 ||
        o_head < 0)
      throw py::value_error("strides must be >= 0");
    const int64_t H = (int64_t)Hkv * group;
    auto end = [D](int64_t a, int64_t sa, int64_t b, int64_t sb) { return 2 * ((a - 1) * sa + (b - 1) * sb + D); };
    const Claim claim{span(o, end(n, o_tok, H, o_head), true), span(q, end(n, q_tok, H, q_head), false),
                      span(k, end(Hkv, k_head, L, k_pos), false), span(v, end(Hkv, v_head, L, v_pos), false),
                      span(mask, mask ? (size_t)((n - 1) * mask_tok + L) : 0, false)};
    const cpumoe_attention_args a = cpumoe_attention_args_of(n, group, D, L, q, q_tok, q_head, k, k_head, k_pos, v, v_head,
                                                              v_pos, mask, mask_tok, scale, o, o_tok, o_head);
    NoGil nogil;
    const cpumoe_attention* kk = s->k;
    // the thread's own scratch, kept between calls: at a 4096-long cache it is ~140 KB, which malloc would map and
    // unmap (and fault in) every call
    thread_local std::vector<char> scratch;
    const size_t need = kk->scratch_bytes(kk, group, D, L);
    if (scratch.size() < need) scratch.resize(need);
    kk->heads(kk, &a, 0, Hkv, scratch.data());
  }

 private:
  std::shared_ptr<AttentionState> st_;
};
}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "cpumoe-formats native kernels (C ABI v" + std::to_string(CPUMOE_FORMATS_ABI_MAJOR) + "." +
            std::to_string(CPUMOE_FORMATS_ABI_MINOR) + ")";
  m.attr("ABI_MAJOR") = CPUMOE_FORMATS_ABI_MAJOR;
  m.attr("ABI_MINOR") = CPUMOE_FORMATS_ABI_MINOR;
  m.attr("CAPSULE_NAME") = CPUMOE_FORMATS_CAPSULE_NAME;
  m.attr("BUILD_INFO") = api_table()->build_info;
  m.attr("_C_API_v1") = py::capsule((void*)api_table(), CPUMOE_FORMATS_CAPSULE_NAME);
  // What a consumer built against (major, minor, size) would be told when binding.
  m.def("check_api_as", [](uint32_t major, uint32_t minor, size_t size) -> py::object {
    char err[512] = {0};
    if (cpumoe_formats_check_api_as(api_table(), major, minor, size, err, sizeof err) == 0) return py::none();
    return py::str(err);
  });
  m.def("detected_tier", &detected_tier);
  m.def("env_tier_cap", &env_tier_cap);
  m.def("usable_tier_mask", &usable_tier_mask);
  m.def("cpu_is_amd", &cpu_is_amd);
  m.def("x16_prefetch", [] { return py::make_tuple(x16_prefetch(), std::string(x16_prefetch_why())); });
  m.def("tier_name", &tier_name);
  m.def("variant_tier_mask", &variant_tier_mask);
  m.def("format_info", [] {
    py::list out;
    for (const auto& f : kFormats) {
      py::list modes;
      for (int md = 0; md < CPUMOE_MODE_COUNT; ++md)
        if (f.modes & (1u << md)) modes.append(mode_name(md));
      out.append(py::dict(py::arg("name") = f.name, py::arg("banks") = f.banks, py::arg("k_multiple") = f.k_multiple,
                          py::arg("input_weight") = f.input_weight, py::arg("modes") = modes));
    }
    return out;
  });
  m.def("read_sum", [](uint64_t p, size_t n) {  // the read loop's checksum: tests check it reads each block once
    NoGil nogil;
    return read_sum((const void*)(uintptr_t)p, n);
  });
  m.def("read_bandwidth", [](uint64_t p, size_t n, int reps) {
    NoGil nogil;
    return read_bandwidth_gbps((const void*)(uintptr_t)p, n, reps);
  });
  m.def("peak_loop", [](int32_t kind, int32_t tier, uint64_t iters) {
    NoGil nogil;
    return peak_loop(kind, tier, iters);
  });
  m.def("activate_bf16_both", [](int act, float alpha, float limit, uint64_t gate, uint64_t up, size_t n, uint64_t fast,
                                 uint64_t ref) {
    NoGil nogil;
    activate_bf16_both(act, alpha, limit, (const float*)(uintptr_t)gate, (const float*)(uintptr_t)up, n,
                       (uint16_t*)(uintptr_t)fast, (uint16_t*)(uintptr_t)ref);
  });
  pthread_atfork(nullptr, nullptr, &clear_in_flight_in_child);
  py::class_<Kernel>(m, "Kernel")
      .def(py::init<int, int, int, bool, int, int, int, float, float, int>(), py::arg("format"), py::arg("act"),
           py::arg("mode"), py::arg("apply_router_weight_on_input"), py::arg("E"), py::arg("H"), py::arg("I"),
           py::arg("alpha"), py::arg("limit"), py::arg("tier_cap") = -1)
      .def_property_readonly("name", &Kernel::name)
      .def_property_readonly("tier", &Kernel::tier)
      .def_property_readonly("block_hint", &Kernel::block_hint)
      .def("act_bytes", &Kernel::act_bytes)
      .def("prep_act", &Kernel::prep_act)
      .def("gate_up", &Kernel::gate_up)
      .def("down", &Kernel::down)
      .def("moe_step", &Kernel::moe_step)
      .def("close", &Kernel::close)
      .def_property_readonly("closed", &Kernel::closed);
  py::class_<Attention>(m, "Attention")
      .def(py::init<int>(), py::arg("tier_cap") = -1)
      .def_property_readonly("name", &Attention::name)
      .def_property_readonly("tier", &Attention::tier)
      .def_property_readonly("closed", &Attention::closed)
      .def("close", &Attention::close)
      .def("run", &Attention::run, py::arg("n"), py::arg("group"), py::arg("D"), py::arg("L"), py::arg("Hkv"),
           py::arg("q"), py::arg("q_tok"), py::arg("q_head"), py::arg("k"), py::arg("k_head"), py::arg("k_pos"),
           py::arg("v"), py::arg("v_head"), py::arg("v_pos"), py::arg("mask"), py::arg("mask_tok"), py::arg("scale"),
           py::arg("o"), py::arg("o_tok"), py::arg("o_head"));
  py::class_<Linear>(m, "Linear")
      .def(py::init<int>(), py::arg("tier_cap") = -1)
      .def_property_readonly("name", &Linear::name)
      .def_property_readonly("tier", &Linear::tier)
      .def_property_readonly("row_block", &Linear::row_block)
      .def("x_bytes", &Linear::x_bytes)
      .def("rows", &Linear::rows, py::arg("w"), py::arg("w_stride"), py::arg("K"), py::arg("M"), py::arg("r0"),
           py::arg("r1"), py::arg("n"), py::arg("x"), py::arg("x_stride"), py::arg("bias"), py::arg("y"),
           py::arg("y_stride"), py::arg("y_fp32"))
      .def("close", &Linear::close)
      .def_property_readonly("closed", &Linear::closed);
}
