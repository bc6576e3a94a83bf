// pybind11 module cpumoe_formats._native: thin; validation of arrays lives in
// Python (cpumoe_formats/_arrays.py), invariants the kernels rely on are
// re-checked in kernel_create / moe_step.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

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

class Kernel {
 public:
  Kernel(int format, int act, int mode, bool apply_on_input, int E, int H, int I, float alpha, float limit,
         int tier_cap) {
    cpumoe_params p{format, act, mode, apply_on_input ? 1 : 0, E, H, I, alpha, limit};
    char err[512] = {0};
    cpumoe_kernel* k = nullptr;
    if (kernel_create(&p, tier_cap, &k, err, sizeof err) != 0) throw py::value_error(err);
    k_.reset(k);
  }
  std::string name() const { return k_->name; }
  int tier() const { return k_->tier; }
  int block_hint() const { return k_->block_hint; }
  size_t act_bytes(int K) const { return k_->act_bytes(k_.get(), K); }
  void prep_act(uint64_t src, int K, uint64_t dst) const {
    py::gil_scoped_release nogil;
    k_->prep_act(k_.get(), (const uint16_t*)(uintptr_t)src, K, (void*)(uintptr_t)dst);
  }
  void gate_up(const std::vector<std::tuple<uint64_t, int64_t, int64_t>>& banks, int e, int i0, int i1,
               const std::vector<uint64_t>& xs, const std::vector<float>& w_in, const std::vector<uint64_t>& gs) const {
    const auto& p = k_->params;
    if (e < 0 || e >= p.num_experts) throw py::value_error("expert id out of range");
    if (i0 < 0 || i1 > p.inter || i0 >= i1) throw py::value_error("need 0 <= i0 < i1 <= I");
    if (xs.size() != w_in.size() || xs.size() != gs.size() || xs.empty())
      throw py::value_error("xs, w_in and g need the same non-zero length");
    auto b = to_banks(banks);
    std::vector<const void*> xp(xs.size());
    std::vector<uint16_t*> gp;
    for (auto g : gs) gp.push_back((uint16_t*)(uintptr_t)g);
    for (size_t j = 0; j < xs.size(); ++j) xp[j] = (const void*)(uintptr_t)xs[j];
    py::gil_scoped_release nogil;
    k_->gate_up(k_.get(), b.data(), e, i0, i1, (int)xs.size(), xp.data(), w_in.data(), gp.data());
  }
  void down(const std::vector<std::tuple<uint64_t, int64_t, int64_t>>& banks, int h0, int h1,
            const std::vector<std::tuple<int, int, float, uint64_t>>& routes, uint64_t acc, int64_t acc_stride) const {
    const auto& p = k_->params;
    if (h0 < 0 || h1 > p.hidden || h0 >= h1) throw py::value_error("need 0 <= h0 < h1 <= H");
    std::vector<cpumoe_route> r;
    for (auto& t : routes) {
      if (std::get<1>(t) < 0 || std::get<1>(t) >= p.num_experts) throw py::value_error("expert id out of range");
      r.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t), 0, (const void*)(uintptr_t)std::get<3>(t)});
    }
    if (r.empty()) throw py::value_error("down needs at least one route");
    auto b = to_banks(banks);
    py::gil_scoped_release nogil;
    k_->down(k_.get(), b.data(), h0, h1, r.data(), (int)r.size(), (float*)(uintptr_t)acc, acc_stride);
  }
  void moe_step(const std::vector<std::tuple<uint64_t, int64_t, int64_t>>& banks, int T, int top_k, uint64_t x,
                uint64_t ids, uint64_t w, uint64_t y) {
    auto b = to_banks(banks);
    char err[256] = {0};
    int rc;
    {
      py::gil_scoped_release nogil;
      size_t need = step_scratch_bytes(k_.get(), T, top_k);
      if (scratch_.size() < need) scratch_.resize(need);
      rc = cpumoe::moe_step(k_.get(), b.data(), T, top_k, (const uint16_t*)(uintptr_t)x, (const int32_t*)(uintptr_t)ids,
                            (const float*)(uintptr_t)w, (uint16_t*)(uintptr_t)y, scratch_.data(), err, sizeof err);
    }
    if (rc != 0) throw py::value_error(err);
  }

 private:
  struct Del {
    void operator()(cpumoe_kernel* k) const { kernel_destroy(k); }
  };
  std::unique_ptr<cpumoe_kernel, Del> k_;
  std::vector<char> scratch_;
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
  m.def("read_bandwidth", [](uint64_t p, size_t n, int reps) {
    py::gil_scoped_release nogil;
    return read_bandwidth_gbps((const void*)(uintptr_t)p, n, reps);
  });
  m.def("peak_loop", [](int32_t kind, int32_t tier, uint64_t iters) {
    py::gil_scoped_release nogil;
    return peak_loop(kind, tier, iters);
  });
  m.def("activate_bf16_both", [](int act, float alpha, float limit, uint64_t gate, uint64_t up, size_t n, uint64_t fast,
                                 uint64_t ref) {
    py::gil_scoped_release nogil;
    activate_bf16_both(act, alpha, limit, (const float*)(uintptr_t)gate, (const float*)(uintptr_t)up, n,
                       (uint16_t*)(uintptr_t)fast, (uint16_t*)(uintptr_t)ref);
  });
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
      .def("moe_step", &Kernel::moe_step);
}
