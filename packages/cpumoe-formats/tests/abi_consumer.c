/* A minimal C consumer of the cpumoe-formats ABI, built by test_abi.py the way
 * the executor binds: PyCapsule_Import + version check + calls through the table.
 * WANT_MAJOR / WANT_MINOR simulate a consumer built against another version. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cpumoe_formats/abi.h"

#ifndef WANT_MAJOR
#define WANT_MAJOR CPUMOE_FORMATS_ABI_MAJOR
#endif
#ifndef WANT_MINOR
#define WANT_MINOR CPUMOE_FORMATS_ABI_MINOR
#endif

static const cpumoe_formats_api *api;

/* step(format, E, H, I, [(ptr, estride, rstride)...], T, top_k, x, ids, w, y) -> kernel name */
static PyObject *step(PyObject *self, PyObject *args) {
  int fmt, E, H, I, T, K;
  PyObject *banks;
  unsigned long long x, ids, w, y;
  (void)self;
  if (!PyArg_ParseTuple(args, "iiiiO!iiKKKK", &fmt, &E, &H, &I, &PyList_Type, &banks, &T, &K, &x, &ids, &w, &y))
    return NULL;
  cpumoe_bank b[CPUMOE_MAX_BANKS] = {{0}};
  for (Py_ssize_t i = 0; i < PyList_Size(banks) && i < CPUMOE_MAX_BANKS; ++i) {
    unsigned long long p;
    long long es, rs;
    if (!PyArg_ParseTuple(PyList_GetItem(banks, i), "KLL", &p, &es, &rs)) return NULL;
    b[i].ptr = (const void *)(uintptr_t)p, b[i].expert_stride = es, b[i].row_stride = rs;
  }
  cpumoe_params prm = {fmt, CPUMOE_ACT_SILU, CPUMOE_MODE_NATIVE, 0, E, H, I, 1.702f, __builtin_inff()};
  cpumoe_kernel *k = NULL;
  char err[512];
  if (api->kernel_create(&prm, -1, &k, err, sizeof err)) {
    PyErr_SetString(PyExc_ValueError, err);
    return NULL;
  }
  void *scratch = malloc(api->step_scratch_bytes(k, T, K));
  int rc = api->moe_step(k, b, T, K, (const uint16_t *)(uintptr_t)x, (const int32_t *)(uintptr_t)ids,
                         (const float *)(uintptr_t)w, (uint16_t *)(uintptr_t)y, scratch, err, sizeof err);
  free(scratch);
  PyObject *name = PyUnicode_FromString(k->name);
  api->kernel_destroy(k);
  if (rc) {
    Py_DECREF(name);
    PyErr_SetString(PyExc_ValueError, err);
    return NULL;
  }
  return name;
}

/* linear(M, K, n, w, x, y) -> tier name: y [n, M] bf16 = x [n, K] bf16 @ w [M, K] bf16 ^T (ABI 1.9), rows in two
 * calls ([0, M/2) then the rest) to use the row range as the executor does */
static PyObject *linear(PyObject *self, PyObject *args) {
  int M, K, n;
  unsigned long long w, x, y;
  (void)self;
  if (!PyArg_ParseTuple(args, "iiiKKK", &M, &K, &n, &w, &x, &y)) return NULL;
  cpumoe_linear *k = NULL;
  char err[512];
  if (api->linear_create(-1, &k, err, sizeof err)) {
    PyErr_SetString(PyExc_ValueError, err);
    return NULL;
  }
  size_t xb = k->x_bytes(k, K);
  const void *xr = (const void *)(uintptr_t)x;
  int64_t xs = 2 * (int64_t)K;
  void *buf = NULL;
  if (xb) {
    buf = malloc(xb * n);
    for (int t = 0; t < n; ++t) k->prep_x(k, (const uint16_t *)(uintptr_t)x + (size_t)t * K, K, (char *)buf + xb * t);
    xr = buf, xs = (int64_t)xb;
  }
  k->rows(k, (const void *)(uintptr_t)w, 2 * (int64_t)K, K, 0, M / 2, n, xr, xs, NULL, (void *)(uintptr_t)y,
          2 * (int64_t)M, 0);
  k->rows(k, (const void *)(uintptr_t)w, 2 * (int64_t)K, K, M / 2, M, n, xr, xs, NULL, (void *)(uintptr_t)y,
          2 * (int64_t)M, 0);
  free(buf);
  PyObject *name = PyUnicode_FromString(k->name);
  api->linear_destroy(k);
  return name;
}

static PyMethodDef methods[] = {{"step", step, METH_VARARGS, "one MoE step through the C ABI"},
                                {"linear", linear, METH_VARARGS, "the dense bf16 linear through the C ABI"},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "abi_consumer", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_abi_consumer(void) {
  api = (const cpumoe_formats_api *)PyCapsule_Import(CPUMOE_FORMATS_CAPSULE_NAME, 0);
  if (!api) return NULL;
  char err[512];
  if (cpumoe_formats_check_api_as(api, WANT_MAJOR, WANT_MINOR, sizeof(cpumoe_formats_api), err, sizeof err)) {
    PyErr_SetString(PyExc_ImportError, err);
    return NULL;
  }
  return PyModule_Create(&mod);
}
