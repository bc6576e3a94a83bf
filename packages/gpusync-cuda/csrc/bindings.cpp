// gpusync_cuda._native: Python bindings over the same objects the C ABI hands
// out, the versioned capsule, and a bench-only CPU responder.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <thread>
#include <vector>

#include "capi.h"
#include "probe.h"
#include "gpusync/py_objects.h"

namespace py = pybind11;
using namespace gpusync;

namespace {
PyObject* g_error = nullptr;          // GpuSyncError(RuntimeError)
PyObject* g_no_driver = nullptr;      // NoDriverError(GpuSyncError)
PyObject* g_capture_refused = nullptr;  // CaptureRefusedError(GpuSyncError)

CUstream S(uint64_t s) { return reinterpret_cast<CUstream>(static_cast<uintptr_t>(s)); }

// Bench only: a CPU thread that answers a doorbell at once (ready != 0 ->
// ready := 0, done := 1), so the memop write/wait floor is measured without a task.
struct Responder {
  uint64_t* ready;
  uint64_t* done;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> served{0};
  std::thread t;
  Responder(uint64_t r, uint64_t d) : ready((uint64_t*)(uintptr_t)r), done((uint64_t*)(uintptr_t)d) {
    t = std::thread([this] {
      while (!stop.load(std::memory_order_acquire)) {
        if (__atomic_load_n(ready, __ATOMIC_ACQUIRE)) {
          __atomic_store_n(ready, 0, __ATOMIC_RELEASE);
          __atomic_store_n(done, 1, __ATOMIC_RELEASE);
          served.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  }
  ~Responder() {
    stop.store(true, std::memory_order_release);
    t.join();
  }
};
}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "gpusync-cuda native core: dlopen'd CUDA driver, IO block registration, doorbell, probe";
  m.attr("ABI_MAJOR") = GPUSYNC_ABI_MAJOR;
  m.attr("ABI_MINOR") = GPUSYNC_ABI_MINOR;
  m.attr("PROTOCOL_VERSION") = CPUMOE_PROTOCOL_VERSION;
  m.attr("EXECUTOR_ABI") = py::make_tuple(CPUMOE_EXECUTOR_ABI_MAJOR, CPUMOE_EXECUTOR_ABI_MINOR);
  m.attr("CAPSULE_NAME") = GPUSYNC_CUDA_CAPSULE_NAME;
  m.attr("BUILD_INFO") = api()->build_info;
  m.attr("_C_API_v1") = py::capsule((void*)api(), GPUSYNC_CUDA_CAPSULE_NAME);
  m.attr("PATHS") = py::dict(py::arg("eager") = (int)GPUSYNC_PATH_EAGER, py::arg("memop") = (int)GPUSYNC_PATH_MEMOP,
                             py::arg("host-func") = (int)GPUSYNC_PATH_HOSTFN,
                             py::arg("kernel") = (int)GPUSYNC_PATH_KERNEL);

  static py::exception<Error> err(m, "GpuSyncError", PyExc_RuntimeError);
  g_error = err.ptr();
  g_no_driver = PyErr_NewException("gpusync_cuda._native.NoDriverError", g_error, nullptr);
  g_capture_refused = PyErr_NewException("gpusync_cuda._native.CaptureRefusedError", g_error, nullptr);
  m.attr("NoDriverError") = py::handle(g_no_driver);
  m.attr("CaptureRefusedError") = py::handle(g_capture_refused);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* cls = e.code == GPUSYNC_E_NO_DRIVER ? g_no_driver
                      : e.code == GPUSYNC_E_CAPTURE_REFUSED ? g_capture_refused
                      : e.code == GPUSYNC_E_TIMEOUT ? PyExc_TimeoutError
                                                     : g_error;
      PyErr_SetString(cls, e.what());
    }
  });

  m.def("driver_status", [] {
    const Driver& d = Driver::get();
    return py::dict(py::arg("loaded") = d.loaded, py::arg("initialized") = d.initialized,
                    py::arg("error") = d.error, py::arg("library") = d.library, py::arg("resolver") = d.resolver,
                    py::arg("driver_version") = d.driver_version, py::arg("missing") = d.missing,
                    py::arg("memops") = d.has_memops(), py::arg("graphs") = d.has_graphs(),
                    py::arg("modules") = d.has_modules(), py::arg("host_func") = d.cuLaunchHostFunc != nullptr);
  });
  m.def("check_executor_capsule", [](py::capsule cap) { executor_api_of(cap); },
        "Raise naming both versions unless the capsule is an executor ABI this build can bind.");
  m.def("path_name", [](int p) { return std::string(path_name(p)); });

  py::class_<PyDevice, std::shared_ptr<PyDevice>>(m, "Device")
      .def(py::init<int>(), py::arg("ordinal"))
      .def_property_readonly("handle", [](PyDevice& s) { return (uint64_t)(uintptr_t)s.h; })
      .def_property_readonly("ordinal", [](PyDevice& s) { return s.d().ordinal(); })
      .def_property_readonly("name", [](PyDevice& s) { return s.d().name(); })
      .def_property_readonly("cc", [](PyDevice& s) { return s.d().cc(); })
      .def_property_readonly("memops64", [](PyDevice& s) { return s.d().memops64(); })
      .def_property_readonly("hostptr_registered", [](PyDevice& s) { return s.d().hostptr_registered(); })
      .def("capture_status", [](PyDevice& s, uint64_t st) { return s.d().capture_status(S(st)); })
      .def("sync",
           [](PyDevice& s, uint64_t st, double t) {
             py::gil_scoped_release nogil;
             return s.d().sync(S(st), t);
           })
      // Test helpers: a private stream and a raw capture, without torch.
      .def("_stream_create",
           [](PyDevice& s) {
             Device::Guard g(s.d());
             CUstream st = nullptr;
             s.d().drv().check(s.d().drv().cuStreamCreate(&st, STREAM_NON_BLOCKING), "cuStreamCreate");
             return (uint64_t)(uintptr_t)st;
           })
      .def("_stream_destroy",
           [](PyDevice& s, uint64_t st) {
             Device::Guard g(s.d());
             s.d().drv().cuStreamDestroy(S(st));
           })
      .def("_capture_begin",
           [](PyDevice& s, uint64_t st) {
             Device::Guard g(s.d());
             if (!s.d().drv().has_graphs()) throw Error(GPUSYNC_E_UNSUPPORTED, "no graph entry points");
             s.d().drv().check(s.d().drv().cuStreamBeginCapture(S(st), CAPTURE_MODE_THREAD_LOCAL),
                               "cuStreamBeginCapture");
           })
      // Bench helpers: raw memops on registered scratch words (the floor under every path).
      .def("_host_register",
           [](PyDevice& s, uint64_t host, size_t n) {
             bool owned = false;
             return (uint64_t)s.d().host_register((void*)(uintptr_t)host, n, &owned);
           })
      .def("_host_unregister", [](PyDevice& s, uint64_t host) { s.d().host_unregister((void*)(uintptr_t)host); })
      .def("_write64",
           [](PyDevice& s, uint64_t st, uint64_t dptr, uint64_t v) {
             Device::Guard g(s.d());
             if (!s.d().memops64()) throw Error(GPUSYNC_E_UNSUPPORTED, "no v2 memops");
             s.d().drv().check(s.d().drv().cuStreamWriteValue64(S(st), dptr, v, STREAM_WRITE_VALUE_DEFAULT),
                               "cuStreamWriteValue64");
           })
      .def("_wait64",
           [](PyDevice& s, uint64_t st, uint64_t dptr, uint64_t v) {
             Device::Guard g(s.d());
             if (!s.d().memops64()) throw Error(GPUSYNC_E_UNSUPPORTED, "no v2 memops");
             s.d().drv().check(s.d().drv().cuStreamWaitValue64(S(st), dptr, v, STREAM_WAIT_VALUE_GEQ),
                               "cuStreamWaitValue64");
           })
      .def("_capture_end", [](PyDevice& s, uint64_t st) {
        // Ends the capture, returns the node types {type: count}, destroys the graph.
        Device::Guard g(s.d());
        const Driver& d = s.d().drv();
        CUgraph graph = nullptr;
        d.check(d.cuStreamEndCapture(S(st), &graph), "cuStreamEndCapture");
        size_t n = 0;
        d.cuGraphGetNodes(graph, nullptr, &n);
        std::vector<CUgraphNode> nodes(n);
        d.cuGraphGetNodes(graph, nodes.data(), &n);
        py::dict types;
        for (auto* nd : nodes) {
          int t = -1;
          d.cuGraphNodeGetType(nd, &t);
          types[py::int_(t)] = (types.contains(py::int_(t)) ? types[py::int_(t)].cast<int>() : 0) + 1;
        }
        d.cuGraphDestroy(graph);
        return types;
      });

  py::class_<PyIob>(m, "Iob")
      .def(py::init<std::shared_ptr<PyDevice>, py::capsule, uint64_t, py::object>(), py::arg("device"),
           py::arg("executor_capsule"), py::arg("executor_handle"), py::arg("keepalive") = py::none())
      .def_property_readonly("handle", [](PyIob& s) { return (uint64_t)(uintptr_t)s.h; })
      .def_property_readonly("base", [](PyIob& s) { return (uint64_t)(uintptr_t)s.b().hdr(); })
      .def("dptr", [](PyIob& s, uint64_t host) { return (uint64_t)s.b().dptr((const void*)(uintptr_t)host); })
      .def("submit", [](PyIob& s, int p, uint64_t st, uint32_t l, uint32_t T) { s.b().submit(p, S(st), l, T); })
      .def("wait", [](PyIob& s, int p, uint64_t st) { s.b().wait(p, S(st)); })
      .def("step",
           [](PyIob& s, int p, uint64_t st, uint32_t l, uint32_t T, uint64_t x, uint64_t ids, uint64_t w, uint64_t y) {
             s.b().step(p, S(st), l, T, x, ids, w, y);
           })
      // The copy step in two halves on one stream (step == step_submit + step_finish).
      .def("step_submit",
           [](PyIob& s, int p, uint64_t st, uint32_t l, uint32_t T, uint64_t x, uint64_t ids, uint64_t w) {
             s.b().step_submit(p, S(st), l, T, x, ids, w);
           })
      .def("step_finish",
           [](PyIob& s, int p, uint64_t st, uint32_t T, uint64_t y) { s.b().step_finish(p, S(st), T, y); })
      .def("sync",
           [](PyIob& s, uint64_t st, double t) {
             py::gil_scoped_release nogil;
             return s.b().sync(S(st), t);
           })
      .def("probe",
           [](PyIob& s, int p, double t) {
             ProbeResult r;
             {
               py::gil_scoped_release nogil;
               r = probe(s.b(), p, t);
             }
             return py::make_tuple(r.safe, r.report);
           })
      .def("replay_safe", [](PyIob& s, int p) { return s.b().replay_safe(p); })
      .def("set_replay_safe", [](PyIob& s, int p, bool on) { s.b().set_replay_safe(p, on); })
      .def("report", [](PyIob& s, int p) { return s.b().report(p); });

  py::class_<Responder>(m, "_Responder")
      .def(py::init<uint64_t, uint64_t>())
      .def_property_readonly("served", [](Responder& r) { return r.served.load(); });
}
