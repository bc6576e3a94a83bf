/* A C ABI consumer that calls the executor from inside an OpenMP parallel region (test_team_openmp.py): each of
 * `outer` threads runs the same IO-block task, so a team='openmp' step starts nested, where libgomp gives it a team
 * of the caller alone. Built with -fopenmp: its libgomp.so.1 is the one already loaded (torch's). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <omp.h>

#include "cpumoe_executor/abi.h"

static const cpumoe_executor_api *api;
/* ThreadSanitizer's annotations where it is preloaded (ci/sanitize.sh tsan), else none: libgomp is not instrumented,
 * so this region's start and end are made visible to it by hand (a reused team thread otherwise looks unordered
 * with what the caller wrote before the region). */
static void (*tsan_acquire)(void *), (*tsan_release)(void *);
static void edge(void (*f)(void *), void *p) {
  if (f) f(p);
}

/* run_in_region(handle, layer, num_tokens, outer) -> [(rc, outer team size), ...] per outer thread */
static PyObject *run_in_region(PyObject *self, PyObject *args) {
  unsigned long long h;
  unsigned layer, T;
  int outer, rc[64] = {0}, size[64] = {0};
  (void)self;
  if (!PyArg_ParseTuple(args, "KIIi", &h, &layer, &T, &outer)) return NULL;
  if (outer < 1 || outer > 64) {
    PyErr_SetString(PyExc_ValueError, "outer: 1 to 64");
    return NULL;
  }
  cpumoe_executor *ex = (cpumoe_executor *)(uintptr_t)h;
  Py_BEGIN_ALLOW_THREADS edge(tsan_release, rc);
#pragma omp parallel num_threads(outer)
  {
    edge(tsan_acquire, rc);
    const int t = omp_get_thread_num();
    size[t] = omp_get_num_threads();
    rc[t] = api->run_task(ex, CPUMOE_TASK(layer, T));
    edge(tsan_release, rc);
  }
  edge(tsan_acquire, rc);
  Py_END_ALLOW_THREADS
  PyObject *out = PyList_New(outer);
  for (int t = 0; t < outer; ++t) PyList_SET_ITEM(out, t, Py_BuildValue("ii", rc[t], size[t]));
  return out;
}

static PyMethodDef methods[] = {{"run_in_region", run_in_region, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "omp_region", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_omp_region(void) {
  *(void **)&tsan_acquire = dlsym(RTLD_DEFAULT, "__tsan_acquire");
  *(void **)&tsan_release = dlsym(RTLD_DEFAULT, "__tsan_release");
  api = (const cpumoe_executor_api *)PyCapsule_Import(CPUMOE_EXECUTOR_CAPSULE_NAME, 0);
  if (!api) return NULL;
  char err[512];
  if (cpumoe_executor_check_api(api, err, sizeof err)) {
    PyErr_SetString(PyExc_ImportError, err);
    return NULL;
  }
  return PyModule_Create(&mod);
}
