// kernelio._native: Python bindings of the host launchers and the probe.
#include <pybind11/pybind11.h>

#include "launcher.h"

namespace py = pybind11;
using namespace kernelio;

namespace {
const gpusync_api* api_of(py::capsule cap) {
  const char* name = cap.name();
  const std::string n = name ? name : "";
  if (n != GPUSYNC_CUDA_CAPSULE_NAME && n != GPUSYNC_HIP_CAPSULE_NAME)
    throw Error("kernelio: expected a gpusync backend capsule (" GPUSYNC_CUDA_CAPSULE_NAME " or "
                GPUSYNC_HIP_CAPSULE_NAME "), got '" + n + "'; install a gpusync backend with ABI major " +
                std::to_string(GPUSYNC_ABI_MAJOR));
  return bind_api(cap.get_pointer());
}
// A gpusync Device object (its .handle) or a raw gpusync_device* as an integer.
gpusync_device* dev_of(py::handle d) {
  const uint64_t h = py::hasattr(d, "handle") ? d.attr("handle").cast<uint64_t>() : d.cast<uint64_t>();
  return reinterpret_cast<gpusync_device*>(static_cast<uintptr_t>(h));
}
}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kernelio host launchers: publish/combine through a gpusync backend's C ABI";
  m.attr("PARAMS_VERSION") = KERNELIO_PARAMS_VERSION;
  m.attr("GPUSYNC_ABI") = py::make_tuple(GPUSYNC_ABI_MAJOR, GPUSYNC_ABI_MINOR);
  py::register_exception<Error>(m, "KernelIOError", PyExc_RuntimeError);

  m.def("check_backend", [](py::capsule cap) { api_of(cap); },
        "Raise naming both versions unless the capsule is a gpusync ABI this build can use.");
  m.def(
      "capsule_backend",
      [](py::capsule cap) {
        const char* name = cap.name();
        const std::string n = name ? name : "";
        if (n == GPUSYNC_CUDA_CAPSULE_NAME) return "cuda";
        if (n == GPUSYNC_HIP_CAPSULE_NAME) return "hip";
        throw Error("kernelio: expected a gpusync backend capsule (" GPUSYNC_CUDA_CAPSULE_NAME " or "
                    GPUSYNC_HIP_CAPSULE_NAME "), got '" + n + "'");
      },
      "'cuda' or 'hip': which image the capsule's module_load takes (from the capsule's name alone).");
  m.def(
      "probe",
      [](py::capsule cap, py::object dev, py::bytes image, double timeout_s, bool wait) {
        const gpusync_api* api = api_of(cap);
        gpusync_device* d = dev_of(dev);
        std::string img = image;
        py::gil_scoped_release nogil;
        return probe(api, d, img, timeout_s, wait);
      },
      py::arg("backend"), py::arg("device"), py::arg("image"), py::arg("timeout_s") = 10.0, py::arg("wait") = false,
      "Self-test on scratch pinned memory; returns '' when it passed, else what failed. wait=True also "
      "tests combine's in-kernel wait (released by a host store, skipped steps, its timeout).");

  py::class_<KernelIO>(m, "KernelIO")
      // keep_alive<1, 3>: the device object outlives the kernels (their destructor frees through it).
      .def(py::init([](py::capsule cap, py::object dev, py::bytes image, uint64_t io_x, uint64_t io_ids, uint64_t io_w,
                       uint64_t io_y, uint64_t ready, uint64_t done, int H, int K, int max_tokens) {
             IoTarget io;
             io.io_x = io_x, io.io_ids = io_ids, io.io_w = io_w, io.io_y = io_y, io.ready = ready, io.done = done;
             io.H = H, io.K = K, io.max_tokens = max_tokens;
             return new KernelIO(api_of(cap), dev_of(dev), std::string(image), io);
           }),
           py::arg("backend"), py::arg("device"), py::arg("image"), py::arg("io_x"), py::arg("io_ids"),
           py::arg("io_w"), py::arg("io_y"), py::arg("ready"), py::arg("done"), py::arg("H"), py::arg("K"),
           py::arg("max_tokens"), py::keep_alive<1, 3>())
      .def("publish", &KernelIO::publish, py::arg("stream"), py::arg("T"), py::arg("x"), py::arg("x_stride"),
           py::arg("ids"), py::arg("ids_stride"), py::arg("w"), py::arg("w_stride"), py::arg("resident"),
           py::arg("num_experts"), py::arg("task"))
      .def("combine", &KernelIO::combine, py::arg("stream"), py::arg("T"), py::arg("out"), py::arg("out_stride"),
           py::arg("accumulate"), py::arg("wait") = false,
           "wait=True: the kernel polls done >= 1 itself (no stream memop wait before it), bounded by "
           "poll_timeout_s; a timed-out launch reads no y and counts in poll_timeouts().")
      .def("poll_timeouts", &KernelIO::poll_timeouts, py::arg("clear") = true,
           "Combine blocks that gave up waiting since the last clear (synchronizes the null stream).")
      .def_property(
          "poll_timeout_s", [](const KernelIO& k) { return k.poll_timeout_ns() * 1e-9; },
          [](KernelIO& k, double s) {
            if (!(s > 0 && s <= 3600)) throw py::value_error("poll_timeout_s must be in (0, 3600] seconds");
            k.set_poll_timeout_ns((uint64_t)(s * 1e9));
          },
          "In-kernel wait bound for launches made from now on (a captured graph keeps its value).")
      .def_property_readonly("scratch", &KernelIO::scratch);
}
