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
 * tensors) or None, and the device name.
 *
 * How a CPU tensor is read: where torch offers DLPack's C exchange table
 * (`torch.Tensor.__dlpack_c_exchange_api__`, torch >= 2.10), one call of its
 * dltensor_from_py_object_no_sync fills a DLTensor that points at the tensor's own sizes and
 * strides: no Python object is made. Otherwise (older torch, or a tensor that call refuses) five
 * attribute reads (is_cpu, data_ptr(), dtype, shape, stride()), each making Python objects: about
 * 0.35 us a tensor, most of the front's own cost at seven tensors a call. Both routes write the
 * same record (tests/test_front_records.py). */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "pakv_contract.h"

enum { ROLE_OPTIONAL = 1, ROLE_INDEX = 2 }; /* the role bits of each position (validator.py) */

/* DLPack's C layout, major version 1 (the layout of dlpack.h, stable within a major version). */
enum { DL_MAJOR = 1, DL_CPU = 1 };
typedef struct {
  int32_t device_type;
  int32_t device_id;
} dl_device;
typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} dl_dtype;
typedef struct {
  void* data;
  dl_device device;
  int32_t ndim;
  dl_dtype dtype;
  int64_t* shape;
  int64_t* strides; /* NULL: row-major (allowed by DLPack; torch always gives them) */
  uint64_t byte_offset;
} dl_tensor;
typedef struct dl_api_header {
  uint32_t major;
  uint32_t minor;
  struct dl_api_header* prev_api;
} dl_api_header;
typedef int (*dl_from_py_fn)(void* py_object, dl_tensor* out); /* 0, or -1 with a Python error set */
typedef struct {
  dl_api_header header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  dl_from_py_fn dltensor_from_py_object_no_sync; /* may be NULL */
  void* current_work_stream;
} dl_exchange_api;

/* DLPack element type -> ONNX element type, for the DLPack types exactly one torch dtype has
 * (validator._dlpack_element_types builds it from spec.ONNX_ELEMENT_TYPE_OF); any other type is
 * looked up by its torch dtype, as the attribute route does. */
enum { DL_TYPES_MAX = 64 };
typedef struct {
  uint32_t key; /* code | bits << 8 | lanes << 16 */
  int32_t elem_type;
} dl_type_entry;

static dl_from_py_fn g_dl_from_py; /* NULL: the attribute route */
static dl_type_entry g_dl_types[DL_TYPES_MAX];
static Py_ssize_t g_dl_type_count;
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

/* The ONNX element type of `tensor`'s torch dtype (0: none) into `rec`. */
static int read_element_type(PyObject* tensor, pakv_tensor* rec) {
  PyObject* dtype = PyObject_GetAttr(tensor, s_dtype);
  if (!dtype) return -1;
  PyObject* element_type = PyDict_GetItemWithError(g_element_types, dtype);
  Py_DECREF(dtype);
  if (!element_type && PyErr_Occurred()) return -1;
  rec->elem_type = element_type ? (int32_t)PyLong_AsLong(element_type) : 0;
  return 0;
}

/* shape, strides and element type of `tensor` into `rec`. A rank over PAKV_MAX_RANK keeps its
 * first dims and its true ndim, which the validator refuses by name. */
static int read_layout(PyObject* tensor, pakv_tensor* rec) {
  Py_ssize_t rank, stride_rank;
  if (read_element_type(tensor, rec)) return -1;
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

/* An index tensor's record reads its data on the host: keep the tensor in hosts[at]. */
static void keep_host(PyObject* tensor, pakv_tensor* rec, PyObject* hosts, Py_ssize_t at) {
  rec->host_data = rec->data;
  Py_INCREF(tensor);
  PyList_SetItem(hosts, at, tensor); /* steals the reference */
}

/* A DLPack element type as one number: code | bits << 8 | lanes << 16. */
static uint32_t dl_key(dl_dtype type) { return (uint32_t)type.code | (uint32_t)type.bits << 8 | (uint32_t)type.lanes << 16; }

/* The element type of a DLPack type from the table; -1: not in it (ask the torch dtype). */
static int32_t dl_element_type(dl_dtype type) {
  uint32_t key = dl_key(type);
  for (Py_ssize_t i = 0; i < g_dl_type_count; i++)
    if (g_dl_types[i].key == key) return g_dl_types[i].elem_type;
  return -1;
}

/* What describe_dlpack did: described it, found it off the CPU (the Python path's), or was refused. */
enum { DL_DESCRIBED = 1, DL_NOT_CPU = 0, DL_REFUSED = 2 };

/* A CPU tensor through DLPack's exchange table: DL_DESCRIBED, DL_NOT_CPU, DL_REFUSED (a tensor
 * DLPack cannot describe: sparse, without storage...; the attribute route then says what it is;
 * nothing written), or -1 with a Python error. */
static int describe_dlpack(PyObject* tensor, int is_index, pakv_tensor* rec, PyObject* hosts, Py_ssize_t at) {
  dl_tensor view;
  if (g_dl_from_py(tensor, &view) != 0) {
    PyErr_Clear();
    return DL_REFUSED;
  }
  if (view.device.device_type != DL_CPU) return DL_NOT_CPU;
  if (view.ndim < 0 || (view.ndim > 0 && (!view.shape || !view.strides))) return DL_REFUSED;
  int32_t element_type = dl_element_type(view.dtype);
  if (element_type < 0 && read_element_type(tensor, rec)) return -1;
  if (element_type >= 0) rec->elem_type = element_type;
  rec->data = (const char*)view.data + view.byte_offset;
  rec->ndim = view.ndim;
  int32_t kept = view.ndim < PAKV_MAX_RANK ? view.ndim : PAKV_MAX_RANK;
  if (kept > 0) { /* a 0-d tensor's shape may be NULL */
    memcpy(rec->dims, view.shape, sizeof(int64_t) * (size_t)kept);
    memcpy(rec->strides, view.strides, sizeof(int64_t) * (size_t)kept);
  }
  memcpy(rec->device, "cpu", 4);
  rec->present = 1;
  if (is_index) keep_host(tensor, rec, hosts, at);
  return DL_DESCRIBED;
}

/* A CPU torch.Tensor; 1 when it is one and was described, 0 when it needs the Python path. */
static int describe_cpu(PyObject* tensor, int is_index, pakv_tensor* rec, PyObject* hosts, Py_ssize_t at) {
  if ((PyObject*)Py_TYPE(tensor) != g_tensor_type) return 0;
  if (g_dl_from_py) {
    int done = describe_dlpack(tensor, is_index, rec, hosts, at);
    if (done != DL_REFUSED) return done;
  }
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
  if (is_index) keep_host(tensor, rec, hosts, at);
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

/* The DLPack exchange table inside torch's capsule, or NULL (None, another major version, or no
 * dltensor_from_py_object_no_sync): the attribute route is then used. */
static const dl_exchange_api* exchange_api(PyObject* exchange) {
  if (exchange == Py_None) return NULL;
  const dl_exchange_api* api = PyCapsule_GetPointer(exchange, "dlpack_exchange_api");
  if (!api) return NULL; /* the Python error stays set: the caller raises it */
  if (api->header.major != DL_MAJOR || !api->dltensor_from_py_object_no_sync) return NULL;
  return api;
}

static dl_from_py_fn exchange_function(PyObject* exchange) {
  const dl_exchange_api* api = exchange_api(exchange);
  return api ? api->dltensor_from_py_object_no_sync : NULL;
}

/* The table {dlpack key: ONNX element type} into g_dl_types; -1 with a Python error. */
static int set_dl_types(PyObject* dl_types) {
  if (PyDict_Size(dl_types) > DL_TYPES_MAX) {
    PyErr_Format(PyExc_ValueError, "configure: more than %d DLPack element types", DL_TYPES_MAX);
    return -1;
  }
  PyObject *key, *value;
  Py_ssize_t pos = 0, count = 0;
  while (PyDict_Next(dl_types, &pos, &key, &value)) {
    unsigned long packed = PyLong_AsUnsignedLong(key);
    long element_type = PyLong_AsLong(value);
    if (PyErr_Occurred()) return -1;
    if (packed > UINT32_MAX || element_type < 0 || element_type > INT32_MAX) {
      PyErr_SetString(PyExc_ValueError, "configure: a DLPack key or element type out of range");
      return -1;
    }
    g_dl_types[count].key = (uint32_t)packed;
    g_dl_types[count].elem_type = (int32_t)element_type;
    count++;
  }
  g_dl_type_count = count;
  return 0;
}

/* configure(tensor_type, element_types, other, exchange, dl_types): once, at the first describe of
 * pakv_onnx.validator. exchange: torch.Tensor.__dlpack_c_exchange_api__ or None (the attribute
 * route); dl_types: {dlpack_key: ONNX element type} of the DLPack types one torch dtype has. */
static PyObject* configure(PyObject* self, PyObject* args) {
  PyObject *tensor_type, *element_types, *other, *exchange = Py_None, *dl_types = Py_None;
  if (!PyArg_ParseTuple(args, "OO!O|OO", &tensor_type, &PyDict_Type, &element_types, &other, &exchange, &dl_types))
    return NULL;
  if (!PyCallable_Check(other)) return PyErr_Format(PyExc_TypeError, "configure: other must be callable");
  if (dl_types != Py_None && !PyDict_Check(dl_types))
    return PyErr_Format(PyExc_TypeError, "configure: dl_types must be a dict or None");
  dl_from_py_fn from_py = exchange_function(exchange);
  if (PyErr_Occurred()) return NULL;
  g_dl_from_py = NULL; /* the table changes below: no DLPack read until both are set */
  g_dl_type_count = 0;
  if (from_py && dl_types != Py_None && set_dl_types(dl_types)) return NULL;
  PyObject* old[] = {g_tensor_type, g_element_types, g_other};
  Py_INCREF(tensor_type);
  Py_INCREF(element_types);
  Py_INCREF(other);
  g_tensor_type = tensor_type;
  g_element_types = element_types;
  g_other = other;
  g_dl_from_py = from_py;
  for (size_t i = 0; i < sizeof old / sizeof old[0]; i++) Py_XDECREF(old[i]);
  Py_RETURN_NONE;
}

/* dlpack_key(exchange, tensor) -> int or None: the DLPack element type torch gives `tensor` (a
 * torch.Tensor: the type the exchange table came from), code | bits << 8 | lanes << 16; None where
 * DLPack cannot describe it. */
static PyObject* dlpack_key(PyObject* self, PyObject* args) {
  PyObject *exchange, *tensor;
  if (!PyArg_ParseTuple(args, "OO", &exchange, &tensor)) return NULL;
  const dl_exchange_api* api = exchange_api(exchange);
  if (!api) return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "dlpack_key: no exchange table");
  /* The table reads only objects of the type it came from (DLPack's rule): ask the object's type. */
  PyObject* own = PyObject_GetAttrString((PyObject*)Py_TYPE(tensor), "__dlpack_c_exchange_api__");
  const void* own_api = own ? PyCapsule_GetPointer(own, "dlpack_exchange_api") : NULL;
  Py_XDECREF(own);
  if (own_api != api) {
    PyErr_Clear();
    return PyErr_Format(PyExc_TypeError, "dlpack_key: %R is not read by this exchange table", (PyObject*)Py_TYPE(tensor));
  }
  dl_tensor view;
  if (api->dltensor_from_py_object_no_sync(tensor, &view) != 0) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return PyLong_FromUnsignedLong(dl_key(view.dtype));
}

static PyObject* record_size(PyObject* self, PyObject* unused) { return PyLong_FromSize_t(sizeof(pakv_tensor)); }

static PyObject* reads_dlpack(PyObject* self, PyObject* unused) { return PyBool_FromLong(g_dl_from_py != NULL); }

static PyMethodDef METHODS[] = {
    {"configure", configure, METH_VARARGS,
     "configure(tensor_type, element_types, other, exchange=None, dl_types=None): set once before describing."},
    {"dlpack_key", dlpack_key, METH_VARARGS, "dlpack_key(exchange, tensor) -> int or None: its DLPack type."},
    {"describe", describe, METH_VARARGS, "describe(address, values, roles) -> hosts: write pakv_tensor records."},
    {"call", call, METH_VARARGS, "call(function, pointer) -> int: int function(void*), GIL released."},
    {"run", run, METH_VARARGS, "run(function, plan, error, error_len) -> int: a plan runner, GIL released."},
    {"record_size", record_size, METH_NOARGS, "sizeof(pakv_tensor) as this module was compiled."},
    {"reads_dlpack", reads_dlpack, METH_NOARGS, "Whether CPU tensors are read through DLPack's exchange table."},
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
