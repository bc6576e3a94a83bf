/* A C consumer of gpusync's ABI, built by test_abi.py against get_include():
 * it binds the capsule the way kernelio or an engine would. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gpusync/abi.h"

#ifndef WANT_MAJOR
#define WANT_MAJOR GPUSYNC_ABI_MAJOR
#endif
#ifndef WANT_MINOR
#define WANT_MINOR GPUSYNC_ABI_MINOR
#endif

static const gpusync_api *bind_api(void) {
  const gpusync_api *api = (const gpusync_api *)PyCapsule_Import(GPUSYNC_CUDA_CAPSULE_NAME, 0);
  char err[512];
  if (!api) return NULL;
  if (gpusync_check_api_as(api, WANT_MAJOR, WANT_MINOR, sizeof(gpusync_api), err, sizeof err)) {
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

static PyMethodDef methods[] = {{"bind", bind, METH_NOARGS, NULL},
                                {"open_device", open_device, METH_NOARGS, NULL},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "abi_consumer", NULL, -1, methods};
PyMODINIT_FUNC PyInit_abi_consumer(void) { return PyModule_Create(&mod); }
