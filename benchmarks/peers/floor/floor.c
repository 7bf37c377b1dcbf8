/* The floor of a small call (benchmarks/bench_call_floor.py): a C extension function that returns a
 * new 4-element float32 array and does nothing else, called like vector_add(a, b). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

static PyObject *new4(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self, (void)args, (void)n;
    npy_intp dims[1] = {4};
    return PyArray_SimpleNew(1, dims, NPY_FLOAT32);
}
static PyMethodDef methods[] = {{"new4", (PyCFunction)(void (*)(void))new4, METH_FASTCALL, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "floor", NULL, -1, methods};
PyMODINIT_FUNC PyInit_floor(void) { import_array(); return PyModule_Create(&mod); }
