/* A C consumer of gpusync's ABI on the HIP backend, built by test_abi.py
 * against gpusync_hip.get_include(): it binds the capsule the way kernelio or
 * an engine would and drives the module/launch/memory services kernelio uses. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gpusync/abi.h"

#ifndef WANT_MAJOR
#define WANT_MAJOR GPUSYNC_ABI_MAJOR
#endif
#ifndef WANT_MINOR
#define WANT_MINOR GPUSYNC_ABI_MINOR
#endif
/* The table size the consumer needs: a 1.0 consumer passes offsetof(gpusync_api, step_submit). */
#ifndef WANT_SIZE
#define WANT_SIZE sizeof(gpusync_api)
#endif

static const gpusync_api *bind_api(void) {
  const gpusync_api *api = (const gpusync_api *)PyCapsule_Import(GPUSYNC_HIP_CAPSULE_NAME, 0);
  char err[512];
  if (!api) return NULL;
  if (gpusync_check_api_as(api, WANT_MAJOR, WANT_MINOR, WANT_SIZE, err, sizeof err)) {
    PyErr_SetString(PyExc_ImportError, err);
    return NULL;
  }
  return api;
}

static PyObject *bind(PyObject *self, PyObject *args) {
  const gpusync_api *api = bind_api();
  if (!api) return NULL;
  return Py_BuildValue("(IIss)", api->abi_major, api->abi_minor, api->backend, api->path_name(GPUSYNC_PATH_MEMOP));
}

static PyObject *open_device(PyObject *self, PyObject *args) {
  const gpusync_api *api = bind_api();
  gpusync_device *d = NULL;
  int rc;
  if (!api) return NULL;
  rc = api->device_open(0, &d);
  if (rc == 0) api->device_close(d);
  return Py_BuildValue("(is)", rc, rc ? api->last_error() : "");
}

/* fill(image: bytes, n, value) -> (rc, message, list of n values read back):
 * module_load + module_function("fill_u32") + mem_alloc + launch + stream_sync + memcpy_async. */
static PyObject *fill(PyObject *self, PyObject *args) {
  const char *image;
  Py_ssize_t len;
  unsigned n, value, i;
  const gpusync_api *api = bind_api();
  gpusync_device *d = NULL;
  void *mod = NULL, *fn = NULL;
  uint64_t dptr = 0;
  uint32_t host[64];
  int rc;
  PyObject *vals;
  if (!api || !PyArg_ParseTuple(args, "y#II", &image, &len, &n, &value)) return NULL;
  if (n > 64) n = 64;
  if ((rc = api->device_open(0, &d))) goto out;
  if ((rc = api->module_load(d, image, &mod))) goto out;
  if ((rc = api->module_function(d, mod, "fill_u32", &fn))) goto out;
  if ((rc = api->mem_alloc(d, n * 4, &dptr))) goto out;
  {
    uint32_t grid[3] = {1, 1, 1}, block[3] = {64, 1, 1};
    uint32_t *p = (uint32_t *)(uintptr_t)dptr;
    void *kargs[3] = {&p, &value, &n};
    if ((rc = api->launch(d, fn, grid, block, 0, 0, kargs))) goto out;
  }
  if ((rc = api->memcpy_async(d, (uint64_t)(uintptr_t)host, dptr, n * 4, 0))) goto out;
  rc = api->stream_sync(d, NULL, 0, 5.0);
out:
  vals = PyList_New(0);
  for (i = 0; rc == 0 && i < n; ++i) PyList_Append(vals, PyLong_FromUnsignedLong(host[i]));
  {
    PyObject *res = Py_BuildValue("(isN)", rc, rc ? api->last_error() : "", vals);
    if (dptr) api->mem_free(d, dptr);
    if (mod) api->module_unload(d, mod);
    if (d) api->device_close(d);
    return res;
  }
}

/* (step_submit, step_finish) present in the table (ABI 1.1) */
static PyObject *has_split(PyObject *self, PyObject *args) {
  const gpusync_api *api = bind_api();
  if (!api) return NULL;
  return Py_BuildValue("(OO)", api->step_submit ? Py_True : Py_False, api->step_finish ? Py_True : Py_False);
}

static PyMethodDef methods[] = {{"bind", bind, METH_NOARGS, NULL},
                                {"has_split", has_split, METH_NOARGS, NULL},
                                {"open_device", open_device, METH_NOARGS, NULL},
                                {"fill", fill, METH_VARARGS, NULL},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "abi_consumer_hip", NULL, -1, methods};
PyMODINIT_FUNC PyInit_abi_consumer_hip(void) { return PyModule_Create(&mod); }
