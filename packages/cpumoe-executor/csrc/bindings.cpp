// pybind11 module cpumoe_executor._native. Binds cpumoe-formats through its
// versioned capsule at import (a mismatch is an ImportError naming both versions).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>

#include "capi.h"
#include "executor.h"
#include "gil.h"
#include "numa_mem.h"
#include "topology.h"

namespace py = pybind11;
using namespace cpumoe_exec;

namespace cpumoe_exec {
void register_latency(py::module& m);  // latency.cpp: the doorbell bench's probes
}

namespace {
const cpumoe_formats_api* g_formats = nullptr;
py::dict placement_dict(const Placement& p) {
  return py::dict(py::arg("layer") = p.layer, py::arg("group") = p.group, py::arg("part") = p.part,
                  py::arg("node") = p.node, py::arg("bytes") = p.bytes,
                  py::arg("mbind") = p.mbind_errno < 0 ? std::string("not asked") : errno_name(p.mbind_errno),
                  py::arg("touched_by") = p.touched_by, py::arg("touchers_pinned") = p.touchers_pinned,
                  py::arg("pages_checked") = p.pages_checked, py::arg("pages_on_node") = p.pages_on_node,
                  py::arg("offsets") = p.offsets);
}
using BankTuple = std::tuple<uint64_t, int64_t, int64_t>;

// The IO block's memory as a Python buffer: numpy views made from it keep it alive (executor.h: IoMem).
struct PyIoMemory {
  std::shared_ptr<IoMem> m;
};

// Placed bank memory as a Python buffer: numpy views made from it keep it alive (numa_mem.h: NodeMem).
struct PyNodeMemory {
  std::shared_ptr<NodeMem> m;
};

using GroupTuple = std::tuple<int, std::vector<int>, std::vector<int>>;  // (node, cores, parts)

struct PyExecutor {
  std::unique_ptr<Executor> ex;
  PyExecutor(int format, int act, int mode, bool on_input, int E, int H, int I, float alpha, float limit,
             int tier_cap, int num_layers, int top_k, int max_tokens, std::vector<int> cores, bool pin,
             int64_t spin_us, std::string label, const std::vector<GroupTuple>& groups, std::vector<int> bounds,
             std::vector<int32_t> formats, const std::vector<std::pair<int, int>>& layer_kernels, bool team_openmp) {
    if (num_layers < 1) throw py::value_error("num_layers must be >= 1");
    if (max_tokens < 1) throw py::value_error("max_tokens must be >= 1");
    if (cores.empty() && groups.empty()) throw py::value_error("at least one core");
    Config c;
    c.params = {format, act, mode, on_input ? 1 : 0, E, H, I, alpha, limit};
    c.tier_cap = tier_cap, c.num_layers = num_layers, c.top_k = top_k, c.max_tokens = max_tokens;
    c.cores = std::move(cores), c.pin = pin, c.spin_us = spin_us, c.label = std::move(label);
    for (const auto& g : groups) c.groups.push_back({std::get<0>(g), std::get<1>(g), std::get<2>(g)});
    c.bounds = std::move(bounds);
    c.formats = std::move(formats);
    c.team_openmp = team_openmp;
    for (const auto& lk : layer_kernels) c.layer_kernels.push_back({lk.first, lk.second});
    try {
      ex = std::make_unique<Executor>(g_formats, c);
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
  }
};
}  // namespace

PYBIND11_MODULE(_native, m) {
  g_formats = (const cpumoe_formats_api*)PyCapsule_Import(CPUMOE_FORMATS_CAPSULE_NAME, 0);
  if (!g_formats) throw py::error_already_set();
  char err[512] = {0};
  if (cpumoe_formats_check_api(g_formats, err, sizeof err) != 0) throw py::import_error(err);

  m.attr("ABI_MAJOR") = CPUMOE_EXECUTOR_ABI_MAJOR;
  m.attr("ABI_MINOR") = CPUMOE_EXECUTOR_ABI_MINOR;
  m.attr("PROTOCOL_VERSION") = CPUMOE_PROTOCOL_VERSION;
  m.attr("IOB_MAGIC") = py::int_(CPUMOE_IOB_MAGIC);
  m.attr("MAX_TOP_K") = py::int_(Executor::kMaxTopK);  // checked against cpumoe_formats.inputs.MAX_TOP_K (tests)
  m.attr("FORMATS_ABI") = py::make_tuple(g_formats->abi_major, g_formats->abi_minor);
  m.attr("_C_API_v1") = py::capsule((void*)executor_api(), CPUMOE_EXECUTOR_CAPSULE_NAME);
  m.def("physical_cores", [] { return physical_cores(); });
  m.def(
      "physical_cores_in", [](const std::string& root, const std::vector<int>& allowed) { return physical_cores(root, allowed); },
      py::arg("root"), py::arg("allowed"));
  m.def("openmp_team_unusable", [] {
    std::string why;
    return OmpTeam::host(&why) ? std::string() : why;
  });
  m.def("allowed_cpus", &allowed_cpus);
  m.def("cgroup_cpu_limit", [](const std::string& root) { return cgroup_cpu_limit(root); }, py::arg("root") = kSysRoot);
  m.def("parse_cpulist", &parse_cpulist);
  m.attr("MAX_PARTS") = Executor::kMaxParts;
  m.def("default_cores", [] {
    std::string why;
    auto c = default_cores(&why);
    return py::make_tuple(c, why);
  });
  // Atomic word access for tests and for a CPU thread playing the GPU's part.
  m.def("load_u64", [](uint64_t a) { return __atomic_load_n((uint64_t*)(uintptr_t)a, __ATOMIC_ACQUIRE); });
  m.def("store_u64", [](uint64_t a, uint64_t v) { __atomic_store_n((uint64_t*)(uintptr_t)a, v, __ATOMIC_RELEASE); });
  m.def(
      "play_gpu",
      [](uint64_t ready, uint64_t done, uint64_t task, double timeout_s) {
        // What the GPU stream does: done = 0, ready = task, wait done >= 1 (bounded).
        return without_gil([&] {
          auto* r = (uint64_t*)(uintptr_t)ready;
          auto* d = (uint64_t*)(uintptr_t)done;
          __atomic_store_n(d, 0, __ATOMIC_RELEASE);
          __atomic_store_n(r, task, __ATOMIC_RELEASE);
          const int64_t until = mono_ns() + (int64_t)(timeout_s * 1e9);
          for (unsigned i = 0; __atomic_load_n(d, __ATOMIC_ACQUIRE) < 1; ++i) {
            if ((i & 1023) == 0 && mono_ns() > until) return false;
            spin_pause(i);
          }
          return true;
        });
      },
      py::arg("ready"), py::arg("done"), py::arg("task"), py::arg("timeout_s"));
  register_latency(m);
  // The down row block reduction, for tests (addresses of float32 term rows and of the uint16 output; isa "" = the
  // one an executor runs here by default, else "avx512f" / "avx2" / "sse2", a ValueError where this CPU (its
  // formats-library tier, under CPUMOE_ISA) cannot run it).
  m.def("route_sum_isa", [] { return std::string(route_sum_for(capped_tier(g_formats, -1)).isa); });
  m.def(
      "route_sum",
      [](const std::vector<uint64_t>& terms, int32_t h0, int32_t h1, uint64_t y, const std::string& isa) {
        if (terms.empty() || terms.size() > (size_t)Executor::kMaxTopK)
          throw py::value_error("terms: 1 to " + std::to_string(Executor::kMaxTopK) + " rows, got " +
                                std::to_string(terms.size()));
        if (h0 < 0 || h1 < h0) throw py::value_error("need 0 <= h0 <= h1");
        std::vector<const float*> t;
        for (uint64_t a : terms) t.push_back((const float*)(uintptr_t)a);
        const int tier = capped_tier(g_formats, -1);
        RouteSum rs = route_sum_for(tier);
        if (!isa.empty() && !route_sum_named(isa.c_str(), tier, &rs))
          throw py::value_error("isa '" + isa + "': not one of avx512f, avx2, sse2 this CPU runs");
        rs.fn(t.data(), (int)t.size(), h0, h1, (uint16_t*)(uintptr_t)y);
      },
      py::arg("terms"), py::arg("h0"), py::arg("h1"), py::arg("y"), py::arg("isa") = "");
  m.def("call_hostfn", [](uint64_t arg, bool submit) {
    without_gil([&] {
      const auto* api = executor_api();
      (submit ? api->hostfn_submit : api->hostfn_wait)((void*)(uintptr_t)arg);
    });
  });

  py::class_<PyIoMemory>(m, "IoMemory", py::buffer_protocol())
      .def_buffer([](PyIoMemory& s) {
        return py::buffer_info(s.m->p, 1, py::format_descriptor<uint8_t>::format(), 1, {(py::ssize_t)s.m->n}, {1},
                               false);
      })
      .def_property_readonly("address", [](PyIoMemory& s) { return (uint64_t)(uintptr_t)s.m->p; })
      .def("__len__", [](PyIoMemory& s) { return s.m->n; });

  py::class_<PyNodeMemory>(m, "NodeMemory", py::buffer_protocol())
      .def_buffer([](PyNodeMemory& s) {
        return py::buffer_info(s.m->p, 1, py::format_descriptor<uint8_t>::format(), 1, {(py::ssize_t)s.m->n}, {1},
                               true);
      })
      .def_property_readonly("address", [](PyNodeMemory& s) { return (uint64_t)(uintptr_t)s.m->p; })
      .def("__len__", [](PyNodeMemory& s) { return s.m->n; });

  // Every call that waits for a lock or a step releases the GIL (gil.h): a step in flight never needs it.
  py::class_<PyExecutor>(m, "Executor")
      .def(py::init<int, int, int, bool, int, int, int, float, float, int, int, int, int, std::vector<int>, bool,
                    int64_t, std::string, const std::vector<GroupTuple>&, std::vector<int>, std::vector<int32_t>,
                    const std::vector<std::pair<int, int>>&, bool>(),
           py::arg("format"), py::arg("act"), py::arg("mode"), py::arg("on_input"), py::arg("E"), py::arg("H"),
           py::arg("I"), py::arg("alpha"), py::arg("limit"), py::arg("tier_cap"), py::arg("num_layers"),
           py::arg("top_k"), py::arg("max_tokens"), py::arg("cores"), py::arg("pin"), py::arg("spin_us"),
           py::arg("label"), py::arg("groups") = std::vector<GroupTuple>{}, py::arg("bounds") = std::vector<int>{},
           py::arg("formats") = std::vector<int32_t>{},
           py::arg("layer_kernels") = std::vector<std::pair<int, int>>{}, py::arg("team_openmp") = false)
      .def("place_banks",
           [](PyExecutor& s, int layer, int group, int part, const std::vector<std::tuple<uint64_t, size_t, int64_t, int64_t>>& src,
              const std::vector<int>& gu_map, const std::vector<int>& dn_map) {
             std::vector<Executor::BankSource> b;
             for (auto& t : src)
               b.push_back({(const void*)(uintptr_t)std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t)});
             const Placement p = without_gil([&] { return s.ex->place_banks(layer, group, part, b, gu_map, dn_map); });
             return py::make_tuple(PyNodeMemory{p.mem}, placement_dict(p));
           },
           py::arg("layer"), py::arg("group"), py::arg("part"), py::arg("src"), py::arg("gu_map") = std::vector<int>{},
           py::arg("dn_map") = std::vector<int>{})
      .def("placements",
           [](PyExecutor& s) {
             py::list out;
             for (const auto& p : without_gil([&] { return s.ex->placements(); })) out.append(placement_dict(p));
             return out;
           })
      .def("node_read_bandwidth",
           [](PyExecutor& s, size_t bytes, int reps, int group) {
             return without_gil([&] { return s.ex->node_read_bandwidth(bytes, reps, group); });
           })
      .def_property_readonly("num_groups", [](PyExecutor& s) { return s.ex->num_groups(); })
      .def_property_readonly("num_parts", [](PyExecutor& s) { return s.ex->num_parts(); })
      .def("set_banks",
           [](PyExecutor& s, int layer, const std::vector<BankTuple>& banks, const std::vector<int>& gu_map,
              const std::vector<int>& dn_map) {
             std::vector<cpumoe_bank> b;
             for (auto& t : banks) b.push_back({(const void*)(uintptr_t)std::get<0>(t), std::get<1>(t), std::get<2>(t)});
             without_gil([&] { s.ex->set_banks(layer, b, gu_map, dn_map); });
           },
           py::arg("layer"), py::arg("banks"), py::arg("gu_map") = std::vector<int>{},
           py::arg("dn_map") = std::vector<int>{})
      .def("decode",
           [](PyExecutor& s, int layer, int T, uint64_t x, uint64_t ids, uint64_t w, uint64_t y, int ids_bytes,
              bool w_bf16) {
             if (ids_bytes != 4 && ids_bytes != 8)
               throw py::value_error("ids_bytes=" + std::to_string(ids_bytes) + ": expected 4 (int32) or 8 (int64)");
             std::string err;
             const int rc = without_gil([&] {
               return s.ex->run_routed(layer, T, (const uint16_t*)(uintptr_t)x, (const void*)(uintptr_t)ids,
                                       ids_bytes, (const void*)(uintptr_t)w, w_bf16, (uint16_t*)(uintptr_t)y, &err);
             });
             if (rc == CPUMOE_ERR_INTERNAL) throw std::runtime_error(err);  // closed, or a forked child's copy
             if (rc) throw py::value_error(err);
           },
           py::arg("layer"), py::arg("T"), py::arg("x"), py::arg("ids"), py::arg("w"), py::arg("y"),
           py::arg("ids_bytes") = 4, py::arg("w_bf16") = false)
      .def("linear",
           [](PyExecutor& s, uint64_t w, int64_t w_stride, int M, int K, int n, uint64_t x, int64_t x_stride,
              uint64_t bias, uint64_t y, int64_t y_stride, bool y_fp32) {
             without_gil([&] {
               s.ex->linear((const void*)(uintptr_t)w, w_stride, M, K, n, (const uint16_t*)(uintptr_t)x, x_stride,
                            (const uint16_t*)(uintptr_t)bias, (void*)(uintptr_t)y, y_stride, y_fp32);
             });
           },
           py::arg("w"), py::arg("w_stride"), py::arg("M"), py::arg("K"), py::arg("n"), py::arg("x"),
           py::arg("x_stride"), py::arg("bias"), py::arg("y"), py::arg("y_stride"), py::arg("y_fp32") = false)
      .def("attention",
           [](PyExecutor& s, int n, int group, int D, int L, int Hkv, uint64_t q, int64_t q_tok, int64_t q_head,
              uint64_t k, int64_t k_head, int64_t k_pos, uint64_t v, int64_t v_head, int64_t v_pos, uint64_t mask,
              int64_t mask_tok, float scale, uint64_t o, int64_t o_tok, int64_t o_head) {
             const cpumoe_attention_args a = cpumoe_attention_args_of(
                 n, group, D, L, q, q_tok, q_head, k, k_head, k_pos, v, v_head, v_pos, mask, mask_tok, scale, o, o_tok,
                 o_head);
             without_gil([&] { s.ex->attention(a, Hkv); });
           },
           py::arg("n"), py::arg("group"), py::arg("D"), py::arg("L"), py::arg("Hkv"), py::arg("q"), py::arg("q_tok"),
           py::arg("q_head"), py::arg("k"), py::arg("k_head"), py::arg("k_pos"), py::arg("v"), py::arg("v_head"),
           py::arg("v_pos"), py::arg("mask"), py::arg("mask_tok"), py::arg("scale"), py::arg("o"), py::arg("o_tok"),
           py::arg("o_head"))
      .def_property_readonly("attention_name", [](PyExecutor& s) { return s.ex->attention_name(); })
      .def_property_readonly("attention_runs", [](PyExecutor& s) { return s.ex->attention_runs(); })
      .def_property_readonly("linear_name", [](PyExecutor& s) { return s.ex->linear_name(); })
      .def_property_readonly("linear_runs", [](PyExecutor& s) { return s.ex->linear_runs(); })
      .def("run_task", [](PyExecutor& s, uint64_t task) { return without_gil([&] { return s.ex->run_task(task); }); })
      .def("start_coordinator",
           [](PyExecutor& s, uint64_t ready, uint64_t done, uint64_t error, int core) {
             without_gil([&] {
               s.ex->start_coordinator((uint64_t*)(uintptr_t)ready, (uint64_t*)(uintptr_t)done,
                                       (uint64_t*)(uintptr_t)error, core);
             });
           })
      .def("stop_coordinator", [](PyExecutor& s) { without_gil([&] { s.ex->stop_coordinator(); }); })
      .def("close", [](PyExecutor& s) { without_gil([&] { s.ex->close(); }); })
      .def_property_readonly("closed", [](PyExecutor& s) { return s.ex->closed(); })
      .def("state_error", [](PyExecutor& s) { return s.ex->state_error(); })
      .def("io_memory", [](PyExecutor& s) { return PyIoMemory{s.ex->io_memory()}; })
      .def("read_bandwidth",
           [](PyExecutor& s, uint64_t p, size_t n, int reps) {
             return without_gil([&] { return s.ex->read_bandwidth((const void*)(uintptr_t)p, n, reps); });
           })
      .def("compute_peak",
           [](PyExecutor& s, int kind, int tier, uint64_t iters, int reps) {
             return without_gil([&] { return s.ex->compute_peak(kind, tier, iters, reps); });
           })
      .def_property_readonly("coordinator_running", [](PyExecutor& s) { return s.ex->coordinator_running(); })
      .def("hostfn_arg", [](PyExecutor& s, uint32_t layer, uint32_t T) { return (uint64_t)(uintptr_t)s.ex->hostfn_arg(layer, T); })
      .def_property_readonly("served", [](PyExecutor& s) { return s.ex->served(); })
      .def_property_readonly("service_ns", [](PyExecutor& s) { return s.ex->service_ns(); })
      .def_property_readonly("pool_runs", [](PyExecutor& s) { return s.ex->pool_runs(); })
      .def_property_readonly("work_ns", [](PyExecutor& s) { return s.ex->work_ns(); })
      .def_property_readonly("work_experts", [](PyExecutor& s) { return s.ex->work_experts(); })
      .def_property_readonly("busy_ns", [](PyExecutor& s) { return s.ex->busy_ns(); })
      .def("set_trace", [](PyExecutor& s, bool on) { without_gil([&] { s.ex->set_trace(on); }); })
      .def("trace",
           [](PyExecutor& s) {
             const auto t = without_gil([&] { return s.ex->trace(); });
             py::list threads;
             for (const auto& x : t.threads)
               threads.append(py::dict(py::arg("steps") = x.steps, py::arg("enter_ns") = x.enter,
                                       py::arg("prep_ns") = x.prep, py::arg("gate_up_ns") = x.gate_up,
                                       py::arg("down_wait_ns") = x.down_wait, py::arg("down_ns") = x.down,
                                       py::arg("exit_ns") = x.exit, py::arg("tail_ns") = x.tail));
             return py::dict(py::arg("steps") = t.steps, py::arg("step_ns") = t.step_ns, py::arg("threads") = threads);
           })
      .def("last_error", [](PyExecutor& s) { return s.ex->last_error(); })
      .def("clear_error", [](PyExecutor& s) { s.ex->clear_error(); })
      .def_property_readonly("iob", [](PyExecutor& s) { return (uint64_t)(uintptr_t)s.ex->iob(); })
      .def_property_readonly("handle", [](PyExecutor& s) { return (uint64_t)(uintptr_t)s.ex.get(); })
      .def_property_readonly("kernel_name", [](PyExecutor& s) { return s.ex->kernel_name(); })
      .def_property_readonly("kernel_names", [](PyExecutor& s) { return s.ex->kernel_names(); })
      .def_property_readonly("route_sum_isa", [](PyExecutor& s) { return std::string(s.ex->route_sum_isa()); })
      .def_property_readonly("threads", [](PyExecutor& s) { return s.ex->threads(); })
      .def_property_readonly("pinned", [](PyExecutor& s) { return s.ex->pinned(); });
}
