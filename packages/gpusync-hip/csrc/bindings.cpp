// gpusync_hip._native: Python bindings over the same objects the C ABI hands
// out, the versioned capsule, and raw-stream test helpers (no torch needed).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "capi.h"
#include "probe.h"
#include "gpusync/py_objects.h"

namespace py = pybind11;
using namespace gpusync;

namespace {
PyObject* g_error = nullptr;            // GpuSyncError(RuntimeError)
PyObject* g_no_driver = nullptr;        // NoDriverError(GpuSyncError)
PyObject* g_capture_refused = nullptr;  // CaptureRefusedError(GpuSyncError)

hipStream_t S(uint64_t s) { return reinterpret_cast<hipStream_t>(static_cast<uintptr_t>(s)); }

py::dict runtime_status() {
  const Runtime& r = Runtime::get();
  py::dict d;
  d["loaded"] = r.loaded, d["initialized"] = r.initialized, d["error"] = r.error, d["library"] = r.library;
  d["choice"] = r.choice, d["runtime_version"] = r.runtime_version, d["driver_version"] = r.driver_version;
  d["device_count"] = r.device_count, d["missing"] = r.missing;
  d["memops"] = r.loaded && r.has_memops(), d["signal_memory"] = r.loaded && r.has_signal_memory();
  d["graphs"] = r.loaded && r.has_graphs(), d["splice"] = r.loaded && r.has_splice();
  d["release_event"] = r.loaded && r.has_release_event();
  d["captured_release_event"] = r.loaded && r.has_captured_release_event();
  d["host_func"] = r.loaded && r.hipLaunchHostFunc != nullptr, d["modules"] = r.loaded && r.has_modules();
  return d;
}
}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "gpusync-hip native core: dlopen'd HIP runtime, signal words, doorbell, probe, recovery";
  m.attr("ABI_MAJOR") = GPUSYNC_ABI_MAJOR;
  m.attr("ABI_MINOR") = GPUSYNC_ABI_MINOR;
  m.attr("PROTOCOL_VERSION") = CPUMOE_PROTOCOL_VERSION;
  m.attr("EXECUTOR_ABI") = py::make_tuple(CPUMOE_EXECUTOR_ABI_MAJOR, CPUMOE_EXECUTOR_ABI_MINOR);
  m.attr("CAPSULE_NAME") = GPUSYNC_HIP_CAPSULE_NAME;
  m.attr("BUILD_INFO") = api()->build_info;
  m.attr("_C_API_v1") = py::capsule((void*)api(), GPUSYNC_HIP_CAPSULE_NAME);
  m.attr("PATHS") = py::dict(py::arg("eager") = (int)GPUSYNC_PATH_EAGER, py::arg("memop") = (int)GPUSYNC_PATH_MEMOP,
                             py::arg("host-func") = (int)GPUSYNC_PATH_HOSTFN,
                             py::arg("kernel") = (int)GPUSYNC_PATH_KERNEL);
  m.attr("MECHANISMS") = py::dict(py::arg("none") = (int)MECH_NONE, py::arg("native") = (int)MECH_NATIVE,
                                  py::arg("splice") = (int)MECH_SPLICE);

  static py::exception<Error> err(m, "GpuSyncError", PyExc_RuntimeError);
  g_error = err.ptr();
  g_no_driver = PyErr_NewException("gpusync_hip._native.NoDriverError", g_error, nullptr);
  g_capture_refused = PyErr_NewException("gpusync_hip._native.CaptureRefusedError", g_error, nullptr);
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

  m.def("driver_status", &runtime_status, "How the HIP runtime loaded: library, why it was chosen, versions, "
                                          "missing optional entry points, or why not.");
  m.def("check_executor_capsule", [](py::capsule cap) { executor_api_of(cap); },
        "Raise naming both versions unless the capsule is an executor ABI this build can bind.");
  m.def("path_name", [](int p) { return std::string(path_name(p)); });
  m.def("_peek_error", [] {
    const Runtime& r = Runtime::get();
    r.require();
    return (int)r.hipPeekAtLastError();
  }, "hipPeekAtLastError() on this thread (tests: no residual error).");
  m.def("_error_name", [](int rc) { return Runtime::get().name(rc); });

  py::class_<PyDevice, std::shared_ptr<PyDevice>>(m, "Device")
      .def(py::init<int>(), py::arg("ordinal"))
      .def_property_readonly("handle", [](PyDevice& s) { return (uint64_t)(uintptr_t)s.h; })
      .def_property_readonly("ordinal", [](PyDevice& s) { return s.d().ordinal(); })
      .def_property_readonly("wait_value_attr", [](PyDevice& s) { return s.d().wait_value_attr(); })
      .def("capture_status", [](PyDevice& s, uint64_t st) { return s.d().capture_status(S(st)); })
      .def("sync",
           [](PyDevice& s, uint64_t st, double t) {
             py::gil_scoped_release nogil;
             return s.d().sync(S(st), t);
           })
      // Test helpers: a private stream and a raw capture, without torch.
      .def("_stream_create",
           [](PyDevice& s) {
             const Runtime& r = s.d().rt();
             Device::Guard g(s.d());
             hipStream_t st = nullptr;
             r.check(r.hipStreamCreateWithFlags(&st, hipStreamNonBlocking), "hipStreamCreateWithFlags");
             return (uint64_t)(uintptr_t)st;
           })
      .def("_stream_destroy", [](PyDevice& s, uint64_t st) { s.d().rt().hipStreamDestroy(S(st)); })
      .def("_capture_begin",
           [](PyDevice& s, uint64_t st) {
             const Runtime& r = s.d().rt();
             if (!r.has_graphs()) throw Error(GPUSYNC_E_UNSUPPORTED, "no graph entry points");
             r.check(r.hipStreamBeginCapture(S(st), hipStreamCaptureModeThreadLocal), "hipStreamBeginCapture");
           })
      // Ends the capture and returns the graph handle (instantiate/launch/destroy below).
      .def("_capture_end",
           [](PyDevice& s, uint64_t st) {
             const Runtime& r = s.d().rt();
             hipGraph_t g = nullptr;
             r.check(r.hipStreamEndCapture(S(st), &g), "hipStreamEndCapture");
             return (uint64_t)(uintptr_t)g;
           })
      .def("_graph_instantiate",
           [](PyDevice& s, uint64_t g) {
             const Runtime& r = s.d().rt();
             hipGraphExec_t e = nullptr;
             r.check(r.hipGraphInstantiate(&e, (hipGraph_t)(uintptr_t)g, nullptr, nullptr, 0), "hipGraphInstantiate");
             return (uint64_t)(uintptr_t)e;
           })
      .def("_graph_launch",
           [](PyDevice& s, uint64_t e, uint64_t st) {
             const Runtime& r = s.d().rt();
             r.check(r.hipGraphLaunch((hipGraphExec_t)(uintptr_t)e, S(st)), "hipGraphLaunch");
           })
      .def("_graph_destroy", [](PyDevice& s, uint64_t g, uint64_t e) {
        const Runtime& r = s.d().rt();
        if (e) r.hipGraphExecDestroy((hipGraphExec_t)(uintptr_t)e);
        if (g) r.hipGraphDestroy((hipGraph_t)(uintptr_t)g);
      });

  py::class_<PyIob>(m, "Iob")
      .def(py::init<std::shared_ptr<PyDevice>, py::capsule, uint64_t, py::object>(), py::arg("device"),
           py::arg("executor_capsule"), py::arg("executor_handle"), py::arg("keepalive") = py::none())
      .def_property_readonly("handle", [](PyIob& s) { return (uint64_t)(uintptr_t)s.h; })
      .def_property_readonly("base", [](PyIob& s) { return (uint64_t)(uintptr_t)s.b().hdr(); })
      .def_property_readonly("words",
                             [](PyIob& s) {
                               py::dict d;
                               d["ready"] = (uint64_t)(uintptr_t)s.b().ready_word();
                               d["done"] = (uint64_t)(uintptr_t)s.b().done_word();
                               d["signal"] = s.b().signal_words();
                               d["note"] = s.b().signal_note();
                               return d;
                             })
      .def("load_word", [](PyIob&, uint64_t addr) { return __atomic_load_n((uint64_t*)(uintptr_t)addr, __ATOMIC_ACQUIRE); })
      .def("dptr", [](PyIob& s, uint64_t host) { return s.b().dptr((const void*)(uintptr_t)host); })
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
           [](PyIob& s, int p, double t, int forced) {
             ProbeResult r;
             {
               py::gil_scoped_release nogil;
               r = probe(s.b(), p, t, forced);
             }
             return py::make_tuple(r.safe, r.eager, r.report);
           },
           py::arg("path"), py::arg("timeout_s"), py::arg("forced") = -1)
      .def_property("mechanism", [](PyIob& s) { return (int)s.b().mechanism(); },
                    [](PyIob& s, int m) {
                      if (m < MECH_NONE || m > MECH_SPLICE) throw Error(GPUSYNC_E_INVALID, "no such mechanism");
                      s.b().set_mechanism((Mechanism)m);
                    })
      .def("replay_safe", [](PyIob& s, int p) { return s.b().replay_safe(p); })
      .def("set_replay_safe", [](PyIob& s, int p, bool on) { s.b().set_replay_safe(p, on); })
      .def("report", [](PyIob& s, int p) { return s.b().report(p); })
      .def_property_readonly("param_entries", [](PyIob& s) { return s.b().param_entries(); })
      .def_property_readonly("event_count", [](PyIob& s) { return s.b().event_count(); });
}
