/* The Python front's hot path in C: torch tensors -> the validator's pakv_tensor records, and the
 * calls into libpakv_ort.so without ctypes (CPython extension `pakv_onnx.native_lib._front`,
 * stable ABI 3.10).
 *
 * Why: a decode step describes seven tensors per call. Done in Python (attribute reads, a
 * struct.pack of ~100 values) and called through ctypes, that was half the front's time; here
 * each record is written where the validator reads it, and the library's functions are called
 * through their addresses (taken from the ctypes handle once), with the GIL released as ctypes
 * does. This file holds no contract rule: the validator (pakv_contract_*.c) judges the records.
 *
 * Only exact torch.Tensor objects on the CPU are read here. Anything else (None for a required
 * input, a non-tensor, a tensor subclass, a tensor on a device) goes to the Python function given
 * to configure(), which raises the TypeError for a non-tensor or returns what to describe: the
 * tensor (a device index tensor made contiguous), its data address, the host copy to read (index
 * tensors) or None, and the device name. */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "pakv_contract.h"

enum { ROLE_OPTIONAL = 1, ROLE_INDEX = 2 }; /* the role bits of each position (validator.py) */

static PyObject* g_tensor_type; /* torch.Tensor */
static PyObject* g_element_types; /* torch.dtype -> ONNX element type (spec.ONNX_ELEMENT_TYPE_OF) */
static PyObject* g_other;       /* Python: (name, value, is_index) -> (tensor, data, host or None, device) */
static PyObject *s_data_ptr, *s_is_cpu, *s_shape, *s_stride, *s_dtype;

/* Up to PAKV_MAX_RANK entries of a tuple of ints into out; the tuple's length in *n. */
static int read_ints(PyObject* tuple, int64_t* out, Py_ssize_t* n) {
  *n = PyTuple_Size(tuple);
  if (*n < 0) return -1;
  for (Py_ssize_t i = 0; i < *n && i < PAKV_MAX_RANK; i++) {
    out[i] = PyLong_AsLongLong(PyTuple_GetItem(tuple, i));
    if (out[i] == -1 && PyErr_Occurred()) return -1;
  }
  return 0;
}

static int read_address(PyObject* number, const void** out) {
  *out = PyLong_AsVoidPtr(number);
  return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

/* shape, strides and element type of `tensor` into `rec`. A rank over PAKV_MAX_RANK keeps its
 * first dims and its true ndim, which the validator refuses by name. */
static int read_layout(PyObject* tensor, pakv_tensor* rec) {
  Py_ssize_t rank, stride_rank;
  PyObject* dtype = PyObject_GetAttr(tensor, s_dtype);
  if (!dtype) return -1;
  PyObject* element_type = PyDict_GetItemWithError(g_element_types, dtype);
  Py_DECREF(dtype);
  if (!element_type && PyErr_Occurred()) return -1;
  rec->elem_type = element_type ? (int32_t)PyLong_AsLong(element_type) : 0;
  PyObject* shape = PyObject_GetAttr(tensor, s_shape);
  if (!shape) return -1;
  int bad = read_ints(shape, rec->dims, &rank);
  Py_DECREF(shape);
  if (bad) return -1;
  PyObject* strides = PyObject_CallMethodObjArgs(tensor, s_stride, NULL);
  if (!strides) return -1;
  bad = read_ints(strides, rec->strides, &stride_rank);
  Py_DECREF(strides);
  if (bad) return -1;
  rec->ndim = (int32_t)(rank > INT32_MAX ? INT32_MAX : rank);
  return 0;
}

/* A CPU torch.Tensor; 1 when it is one and was described, 0 when it needs the Python path. */
static int describe_cpu(PyObject* tensor, int is_index, pakv_tensor* rec, PyObject* hosts, Py_ssize_t at) {
  if ((PyObject*)Py_TYPE(tensor) != g_tensor_type) return 0;
  PyObject* is_cpu = PyObject_GetAttr(tensor, s_is_cpu);
  if (!is_cpu) return -1;
  int on_host = is_cpu == Py_True;
  Py_DECREF(is_cpu);
  if (!on_host) return 0;
  PyObject* data = PyObject_CallMethodObjArgs(tensor, s_data_ptr, NULL);
  if (!data) return -1;
  int bad = read_address(data, &rec->data);
  Py_DECREF(data);
  if (bad) return -1;
  if (is_index) {
    rec->host_data = rec->data;
    Py_INCREF(tensor);
    PyList_SetItem(hosts, at, tensor); /* steals the reference */
  }
  memcpy(rec->device, "cpu", 4);
  rec->present = 1;
  return read_layout(tensor, rec) ? -1 : 1;
}

/* Anything else, through the Python function; a device copy it made is kept alive in hosts. */
static int describe_other(PyObject* name, PyObject* value, int is_index, pakv_tensor* rec, PyObject* hosts,
                          Py_ssize_t at) {
  PyObject* got = PyObject_CallFunctionObjArgs(g_other, name, value, is_index ? Py_True : Py_False, NULL);
  if (!got) return -1;
  PyObject *tensor, *data, *host, *device;
  if (!PyArg_ParseTuple(got, "OOOO", &tensor, &data, &host, &device) || read_address(data, &rec->data)) goto fail;
  if (host != Py_None) {
    PyObject* host_data = PyObject_CallMethodObjArgs(host, s_data_ptr, NULL);
    if (!host_data) goto fail;
    int bad = read_address(host_data, &rec->host_data);
    Py_DECREF(host_data);
    Py_INCREF(host);
    PyList_SetItem(hosts, at, host);
    if (bad || PyList_Append(hosts, tensor)) goto fail; /* the record holds its address too */
  }
  Py_ssize_t length = 0;
  const char* text = PyUnicode_AsUTF8AndSize(device, &length);
  if (!text) goto fail;
  if (length > PAKV_DEVICE_LEN - 1) length = PAKV_DEVICE_LEN - 1;
  memcpy(rec->device, text, (size_t)length);
  rec->device[length] = '\0';
  rec->present = 1;
  int bad = read_layout(tensor, rec);
  Py_DECREF(got);
  return bad ? -1 : 0;
fail:
  Py_DECREF(got);
  return -1;
}

/* describe(address, values, roles) -> hosts
 *   address: where len(values) consecutive pakv_tensor records go (inside a call's buffer)
 *   values:  the call's tensors in the validator's order (None: absent)
 *   roles:   per position (name, role bits: ROLE_OPTIONAL | ROLE_INDEX)
 *   hosts:   per position the host tensor the record's host_data points into (index tensors) or
 *            None, then any device copies; keep it alive as long as the records are used. */
static PyObject* describe(PyObject* self, PyObject* args) {
  PyObject *address, *values, *roles;
  if (!PyArg_ParseTuple(args, "O!O!O!", &PyLong_Type, &address, &PyTuple_Type, &values, &PyTuple_Type, &roles))
    return NULL;
  pakv_tensor* records = PyLong_AsVoidPtr(address);
  Py_ssize_t count = PyTuple_Size(values);
  if (!records || count != PyTuple_Size(roles)) {
    PyErr_SetString(PyExc_ValueError, "describe: a null address, or values and roles of different lengths");
    return NULL;
  }
  if (!g_other) return PyErr_Format(PyExc_RuntimeError, "describe: configure() was not called");
  PyObject* hosts = PyList_New(count);
  if (!hosts) return NULL;
  for (Py_ssize_t i = 0; i < count; i++) {
    Py_INCREF(Py_None);
    PyList_SetItem(hosts, i, Py_None);
    PyObject* value = PyTuple_GetItem(values, i);
    PyObject* role = PyTuple_GetItem(roles, i);
    long bits = PyLong_AsLong(PyTuple_GetItem(role, 1));
    if (bits == -1 && PyErr_Occurred()) goto fail;
    memset(&records[i], 0, sizeof(pakv_tensor));
    if (value == Py_None && (bits & ROLE_OPTIONAL)) continue;
    int done = describe_cpu(value, bits & ROLE_INDEX, &records[i], hosts, i);
    if (done < 0 || (done == 0 && describe_other(PyTuple_GetItem(role, 0), value, bits & ROLE_INDEX, &records[i],
                                                 hosts, i)))
      goto fail;
  }
  return hosts;
fail:
  Py_DECREF(hosts);
  return NULL;
}

typedef int (*one_pointer_fn)(void*);
typedef int (*run_fn)(const void*, char*, size_t);

/* call(function, pointer) -> int: `int function(void*)` (pakv_plan_gather, ...), GIL released. */
static PyObject* call(PyObject* self, PyObject* args) {
  PyObject *function, *pointer;
  if (!PyArg_ParseTuple(args, "O!O!", &PyLong_Type, &function, &PyLong_Type, &pointer)) return NULL;
  one_pointer_fn fn = (one_pointer_fn)(uintptr_t)PyLong_AsVoidPtr(function);
  void* arg = PyLong_AsVoidPtr(pointer);
  if (!fn || PyErr_Occurred()) return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "call: null function");
  int result;
  Py_BEGIN_ALLOW_THREADS
  result = fn(arg);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(result);
}

/* run(function, plan, error, error_len) -> int: `int function(const void*, char*, size_t)`
 * (pakv_gather, pakv_scatter), GIL released: the copy runs while other threads go on. */
static PyObject* run(PyObject* self, PyObject* args) {
  PyObject *function, *plan, *error;
  Py_ssize_t error_len;
  if (!PyArg_ParseTuple(args, "O!O!O!n", &PyLong_Type, &function, &PyLong_Type, &plan, &PyLong_Type, &error,
                        &error_len))
    return NULL;
  run_fn fn = (run_fn)(uintptr_t)PyLong_AsVoidPtr(function);
  const void* plan_at = PyLong_AsVoidPtr(plan);
  char* error_at = PyLong_AsVoidPtr(error);
  if (PyErr_Occurred()) return NULL;
  if (!fn || error_len < 0) return PyErr_Format(PyExc_ValueError, "run: null function or negative error length");
  int result;
  Py_BEGIN_ALLOW_THREADS
  result = fn(plan_at, error_at, (size_t)error_len);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(result);
}

/* configure(tensor_type, element_types, other): once, at import of pakv_onnx.validator. */
static PyObject* configure(PyObject* self, PyObject* args) {
  PyObject *tensor_type, *element_types, *other;
  if (!PyArg_ParseTuple(args, "OO!O", &tensor_type, &PyDict_Type, &element_types, &other)) return NULL;
  if (!PyCallable_Check(other)) return PyErr_Format(PyExc_TypeError, "configure: other must be callable");
  PyObject* old[] = {g_tensor_type, g_element_types, g_other};
  Py_INCREF(tensor_type);
  Py_INCREF(element_types);
  Py_INCREF(other);
  g_tensor_type = tensor_type;
  g_element_types = element_types;
  g_other = other;
  for (size_t i = 0; i < sizeof old / sizeof old[0]; i++) Py_XDECREF(old[i]);
  Py_RETURN_NONE;
}

static PyObject* record_size(PyObject* self, PyObject* unused) { return PyLong_FromSize_t(sizeof(pakv_tensor)); }

static PyMethodDef METHODS[] = {
    {"configure", configure, METH_VARARGS, "configure(tensor_type, element_types, other): set once at import."},
    {"describe", describe, METH_VARARGS, "describe(address, values, roles) -> hosts: write pakv_tensor records."},
    {"call", call, METH_VARARGS, "call(function, pointer) -> int: int function(void*), GIL released."},
    {"run", run, METH_VARARGS, "run(function, plan, error, error_len) -> int: a plan runner, GIL released."},
    {"record_size", record_size, METH_NOARGS, "sizeof(pakv_tensor) as this module was compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_front", "The Python front's hot path (pakv_front.c).", -1, METHODS, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__front(void) {
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_is_cpu = PyUnicode_InternFromString("is_cpu");
  s_shape = PyUnicode_InternFromString("shape");
  s_stride = PyUnicode_InternFromString("stride");
  s_dtype = PyUnicode_InternFromString("dtype");
  if (!s_data_ptr || !s_is_cpu || !s_shape || !s_stride || !s_dtype) return NULL;
  return PyModule_Create(&MODULE);
}
