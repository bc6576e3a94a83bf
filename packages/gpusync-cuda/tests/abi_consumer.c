/* A C consumer of gpusync's ABI, built by test_abi.py against get_include():
 * it binds the capsule the way kernelio or an engine would, and runs the
 * copy step's two halves (ABI 1.1) through the table. */
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
  const gpusync_api *api = (const gpusync_api *)PyCapsule_Import(GPUSYNC_CUDA_CAPSULE_NAME, 0);
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

/* device_open through the table: (rc, last_error) */
static PyObject *open_device(PyObject *self, PyObject *args) {
  const gpusync_api *api = bind_api();
  gpusync_device *d = NULL;
  int rc;
  if (!api) return NULL;
  rc = api->device_open(0, &d);
  if (rc == 0) api->device_close(d);
  return Py_BuildValue("(is)", rc, rc ? api->last_error() : "");
}

/* (step_submit, step_finish) present in the table (ABI 1.1) */
static PyObject *has_split(PyObject *self, PyObject *args) {
  const gpusync_api *api = bind_api();
  if (!api) return NULL;
  return Py_BuildValue("(OO)", api->step_submit ? Py_True : Py_False, api->step_finish ? Py_True : Py_False);
}

/* split_step(executor_capsule, executor_handle, path, layer, T, x, ids, w, y, src, dst, n) -> (rc, last_error):
 * the copy step's two halves through the table on the legacy stream, with a stream-ordered copy of n bytes
 * src -> dst between them (the caller's other GPU work), then a bounded stream sync: a block registered by a C
 * consumer, the way an engine's own handshake would run it. */
static PyObject *split_step(PyObject *self, PyObject *args) {
  PyObject *cap;
  unsigned long long h, x, ids, w, y, src, dst, n;
  int path, rc;
  unsigned layer, T;
  const gpusync_api *api = bind_api();
  const cpumoe_executor_api *ex;
  gpusync_device *d = NULL;
  gpusync_iob *b = NULL;
  if (!api || !PyArg_ParseTuple(args, "OKiIIKKKKKKK", &cap, &h, &path, &layer, &T, &x, &ids, &w, &y, &src, &dst,
                                &n))
    return NULL;
  ex = (const cpumoe_executor_api *)PyCapsule_GetPointer(cap, CPUMOE_EXECUTOR_CAPSULE_NAME);
  if (!ex) return NULL;
  if ((rc = api->device_open(0, &d))) goto out;
  if ((rc = api->iob_register(d, ex, (cpumoe_executor *)(uintptr_t)h, &b))) goto out;
  if ((rc = api->step_submit(b, path, 0, layer, T, x, ids, w))) goto out;
  if ((rc = api->memcpy_async(d, dst, src, (size_t)n, 0))) goto out;
  if ((rc = api->step_finish(b, path, 0, T, y))) goto out;
  rc = api->stream_sync(d, b, 0, 10.0);
out:
  {
    PyObject *res = Py_BuildValue("(is)", rc, rc ? api->last_error() : "");
    if (b) api->iob_release(b);
    if (d) api->device_close(d);
    return res;
  }
}

static PyMethodDef methods[] = {{"bind", bind, METH_NOARGS, NULL},
                                {"open_device", open_device, METH_NOARGS, NULL},
                                {"has_split", has_split, METH_NOARGS, NULL},
                                {"split_step", split_step, METH_VARARGS, NULL},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "abi_consumer", NULL, -1, methods};
PyMODINIT_FUNC PyInit_abi_consumer(void) { return PyModule_Create(&mod); }
