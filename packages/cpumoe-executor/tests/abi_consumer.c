/* A minimal consumer of the cpumoe-executor ABI, built the way a sync backend
 * binds: PyCapsule_Import + version check, then the host-function entry points
 * through the table. WANT_* simulate a consumer built against another version. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cpumoe_executor/abi.h"

#ifndef WANT_MAJOR
#define WANT_MAJOR CPUMOE_EXECUTOR_ABI_MAJOR
#endif
#ifndef WANT_MINOR
#define WANT_MINOR CPUMOE_EXECUTOR_ABI_MINOR
#endif

static const cpumoe_executor_api *api;

/* run(handle, layer, num_tokens) -> (iob magic, iob version): submit + wait through the host-fn entries */
static PyObject *run(PyObject *self, PyObject *args) {
  unsigned long long h;
  unsigned layer, T;
  (void)self;
  if (!PyArg_ParseTuple(args, "KII", &h, &layer, &T)) return NULL;
  cpumoe_executor *ex = (cpumoe_executor *)(uintptr_t)h;
  cpumoe_hostfn_arg *a = api->hostfn_arg(ex, layer, T);
  if (!a) {
    PyErr_SetString(PyExc_ValueError, "hostfn_arg refused layer/num_tokens");
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS api->hostfn_submit(a);
  api->hostfn_wait(a);
  Py_END_ALLOW_THREADS cpumoe_iob_header *iob = api->iob(ex);
  return Py_BuildValue("KI", (unsigned long long)iob->magic, iob->version);
}

static PyMethodDef methods[] = {{"run", run, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "exec_consumer", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_exec_consumer(void) {
  api = (const cpumoe_executor_api *)PyCapsule_Import(CPUMOE_EXECUTOR_CAPSULE_NAME, 0);
  if (!api) return NULL;
  char err[512];
  if (cpumoe_executor_check_api_as(api, WANT_MAJOR, WANT_MINOR, sizeof(cpumoe_executor_api), err, sizeof err)) {
    PyErr_SetString(PyExc_ImportError, err);
    return NULL;
  }
  return PyModule_Create(&mod);
}
