/* pakv::GatherPaKvCache, pakv::ScatterPaKvCache, pakv::PagedAttention: the ONNX Runtime glue of
 * the custom-op library.
 *
 * Entry point: RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*), loaded by ORT with
 * SessionOptions.register_custom_ops_library(path) (Python) / RegisterCustomOpsLibrary (C API).
 * No ORT header, no libonnxruntime, no Python: see ort_abi.h for the ABI subset used.
 *
 * This file is ORT glue only: registration (one domain per backend, reused), the ops (the cache
 * ops one per (key dtype, value dtype) pair of the contract, so a dtype outside it has no kernel
 * and the session is refused at creation, and each pair once per execution provider of pakv_ep.h;
 * PagedAttention once per dtype it computes in, CPU only),
 * strict attributes, and compute: ORT's tensors become the
 * validator's records (pakv_contract.c: every rule of the contract, with its message), the
 * outputs ORT hands back are validated too, and the copy core (pakv_core.c) runs the plan.
 * Python backends are reached through pakv_bridge.c.
 *
 * The contract (names, layouts, dtypes) is defined in pakv_onnx/spec.py.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"
#include "pakv_bridge.h"
#include "pakv_contract.h"
#include "pakv_core.h"
#include "pakv_dtypes.h"
#include "pakv_ep.h"

#define PAKV_DOMAIN "pakv"
#define PAKV_OPSET_VERSION 1
#define PAKV_NUM_PAIRS (PAKV_NUM_DTYPES * PAKV_NUM_DTYPES)
/* The cache ops (pakv_ep.h's PAKV_OP_GATHER / PAKV_OP_SCATTER), each registered once per execution
 * provider (pakv_ep.h) and (key dtype, value dtype) pair: op n < PAKV_NUM_CACHE_OPS is EP
 * n / (kinds x pairs), kind (n / pairs) % kinds, pair n % pairs. Then PagedAttention on the CPU, one
 * op per dtype of ATTENTION_DTYPES. */
#define PAKV_NUM_CACHE_OPS (PAKV_NUM_EPS * PAKV_NUM_OP_KINDS * PAKV_NUM_PAIRS)
#define PAKV_NUM_OPS (PAKV_NUM_CACHE_OPS + PAKV_NUM_ATTENTION_DTYPES)
#define PAKV_MAX_MODE_LEN 64
/* Session config entry naming the backend these SessionOptions were registered for. */
#define PAKV_CONFIG_KEY "pakv_onnx.backend"

static const char* const INPUT_NAMES[PAKV_OP_ATTENTION + 1][PAKV_NUM_INPUTS] = {
    {"key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset"},
    {"key", "value", "key_cache", "value_cache", "slot_mapping"},
    {"query", "key_cache", "value_cache", "block_table", "cumulative_sequence_lengths", "past_sequence_lengths"}};
/* Inputs and outputs of each op kind. */
static const size_t INPUT_COUNT[PAKV_OP_ATTENTION + 1] = {PAKV_GATHER_INPUTS, PAKV_SCATTER_INPUTS, PAKV_ATTENTION_INPUTS};
static const size_t OUTPUT_COUNT[PAKV_OP_ATTENTION + 1] = {2, 2, 1};
/* PagedAttention's dtypes, as indices into PAKV_CACHE_DTYPES: bfloat16, float16, float32. */
static const int ATTENTION_DTYPES[PAKV_NUM_ATTENTION_DTYPES] = {0, 1, 2};

/* ------------------------------------------------------------------------------------------- */
/* ORT helpers                                                                                 */
/* ------------------------------------------------------------------------------------------- */
static OrtStatus* make_status(const OrtApi* api, int code, const char* msg) {
  return PAKV_API(api, CreateStatus)(code, msg);
}

/* Turn an ORT status into our error (with context) and release it. */
static int take_status(const OrtApi* api, OrtStatus* st, pakv_err* err, const char* what) {
  if (!st) return 0;
  snprintf(err->msg, sizeof(err->msg), "%s: %s", what, PAKV_API(api, GetErrorMessage)(st));
  PAKV_API(api, ReleaseStatus)(st);
  return -1;
}

/* ------------------------------------------------------------------------------------------- */
/* Attributes: absent means the default; present with another type or value is an error      */
/* ------------------------------------------------------------------------------------------- */
typedef enum { ATTR_ABSENT, ATTR_INT, ATTR_FLOAT, ATTR_STRING, ATTR_INTS, ATTR_FLOATS, ATTR_OTHER } attr_kind;
static const char* const ATTR_KIND_NAMES[] = {"absent", "INT", "FLOAT", "STRING", "INTS", "FLOATS",
                                              "STRINGS or another non-scalar type (or an empty list)"};

/* Which type attribute `name` has. ORT has no "attribute type" query in API 16, so each typed
 * getter is tried. The array getters succeed (with 0 elements) for any attribute that is present
 * but holds no ints/floats (STRINGS, TENSOR, GRAPH, an empty list): that tells present from absent
 * without reading ORT's messages; the message ("... type don't match") is the fallback. */
static attr_kind attribute_kind(const OrtApi* api, const OrtKernelInfo* info, const char* name) {
  int64_t i;
  float f;
  size_t n = 0, ints = 0, floats = 0;
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_int64)(info, name, &i);
  if (!st) return ATTR_INT;
  int type_mismatch = strstr(PAKV_API(api, GetErrorMessage)(st), "type") != NULL;
  PAKV_API(api, ReleaseStatus)(st);
  if (!(st = PAKV_API(api, KernelInfoGetAttribute_float)(info, name, &f))) return ATTR_FLOAT;
  PAKV_API(api, ReleaseStatus)(st);
  if (!(st = PAKV_API(api, KernelInfoGetAttribute_string)(info, name, NULL, &n))) return ATTR_STRING;
  PAKV_API(api, ReleaseStatus)(st);
  int present = 0;
  if (!(st = PAKV_API(api, KernelInfoGetAttributeArray_int64)(info, name, NULL, &ints)))
    present = 1;
  else
    PAKV_API(api, ReleaseStatus)(st);
  if (!(st = PAKV_API(api, KernelInfoGetAttributeArray_float)(info, name, NULL, &floats)))
    present = 1;
  else
    PAKV_API(api, ReleaseStatus)(st);
  if (ints > 0) return ATTR_INTS;
  if (floats > 0) return ATTR_FLOATS;
  return present || type_mismatch ? ATTR_OTHER : ATTR_ABSENT;
}

static OrtStatus* attribute_error(const OrtApi* api, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static OrtStatus* attribute_error(const OrtApi* api, const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  return make_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
}

/* cache_mode: a STRING, exactly "Norm" or "PA_NZ" (default "Norm"). */
static OrtStatus* read_cache_mode(const OrtApi* api, const OrtKernelInfo* info, const char* op, int* nz) {
  static const char* allowed = "'Norm' or 'PA_NZ'";
  attr_kind kind = attribute_kind(api, info, "cache_mode");
  *nz = 0;
  if (kind == ATTR_ABSENT) return NULL;
  if (kind != ATTR_STRING)
    return attribute_error(api, "%s attribute cache_mode must be a STRING attribute (%s), got attribute "
                           "type %s", op, allowed, ATTR_KIND_NAMES[kind]);
  char mode[PAKV_MAX_MODE_LEN];
  size_t size = 0;
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_string)(info, "cache_mode", NULL, &size);
  if (st) return st;
  if (size > sizeof(mode))
    return attribute_error(api, "cache_mode must be %s, got a string of %zu bytes", allowed, size - 1);
  size = sizeof(mode);
  if ((st = PAKV_API(api, KernelInfoGetAttribute_string)(info, "cache_mode", mode, &size))) return st;
  mode[sizeof(mode) - 1] = 0;
  if (size == 0 || strlen(mode) + 1 != size)
    return attribute_error(api, "%s attribute cache_mode must be %s, got '%s' followed by a NUL byte "
                           "and more bytes", op, allowed, mode);
  if (strcmp(mode, "Norm") == 0) return NULL;
  if (strcmp(mode, "PA_NZ") == 0) {
    *nz = 1;
    return NULL;
  }
  return attribute_error(api, "cache_mode must be %s, got '%s'", allowed, mode);
}

/* is_seq_lens_cumsum: an INT, 0 or 1 (default 1). */
static OrtStatus* read_cumsum(const OrtApi* api, const OrtKernelInfo* info, int64_t* cumsum) {
  attr_kind kind = attribute_kind(api, info, "is_seq_lens_cumsum");
  *cumsum = 1;
  if (kind == ATTR_ABSENT) return NULL;
  if (kind != ATTR_INT)
    return attribute_error(api, "GatherPaKvCache attribute is_seq_lens_cumsum must be an INT attribute (0 or 1), got "
                           "attribute type %s", ATTR_KIND_NAMES[kind]);
  OrtStatus* st = PAKV_API(api, KernelInfoGetAttribute_int64)(info, "is_seq_lens_cumsum", cumsum);
  if (st) return st;
  if (*cumsum != 0 && *cumsum != 1)
    return attribute_error(api, "is_seq_lens_cumsum must be 0/1 (an INT attribute), got %lld", (long long)*cumsum);
  return NULL;
}

/* scale: a FLOAT (default 0: 1 / sqrt(head_dim); the validator resolves it and checks it is finite). */
static OrtStatus* read_scale(const OrtApi* api, const OrtKernelInfo* info, float* scale) {
  attr_kind kind = attribute_kind(api, info, "scale");
  *scale = 0.0f;
  if (kind == ATTR_ABSENT) return NULL;
  if (kind != ATTR_FLOAT)
    return attribute_error(api, "PagedAttention attribute scale must be a FLOAT attribute, got attribute type %s",
                           ATTR_KIND_NAMES[kind]);
  return PAKV_API(api, KernelInfoGetAttribute_float)(info, "scale", scale);
}

/* ------------------------------------------------------------------------------------------- */
/* Ops and kernels                                                                             */
/* ------------------------------------------------------------------------------------------- */
typedef struct {
  PakvOrtCustomOp base; /* first: ORT sees an OrtCustomOp* */
  int kind;             /* PAKV_OP_GATHER / PAKV_OP_SCATTER (pakv_ep.h) */
  int key_dtype;        /* index into PAKV_CACHE_DTYPES */
  int value_dtype;
  int backend;          /* bridge slot; PAKV_NATIVE_BACKEND = the C kernel */
  int ep;               /* PAKV_EP_*: the execution provider of this entry */
  int parallel_for;     /* the runtime offers KernelContext_ParallelFor (API >= 17) */
} pakv_op;

typedef struct {
  const OrtApi* api;
  int kind, backend, nz;
  int64_t cumsum;
  int ep, parallel_for;
  float scale; /* PagedAttention's */
} pakv_kernel;

static const char* op_name(const PakvOrtCustomOp* op) { return pakv_op_type(((const pakv_op*)op)->kind); }
static const char* op_ep(const PakvOrtCustomOp* op) { return pakv_ep_name(((const pakv_op*)op)->ep); }
/* Gather: key_cache, value_cache, then index tensors. Scatter: key, value (of their caches'
 * dtypes), key_cache, value_cache, then slot_mapping. Attention: query, key_cache, value_cache of
 * one dtype, then index tensors. Index inputs are int32 or int64 (checked at run time). */
static int op_input_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  size_t typed = o->kind == PAKV_OP_SCATTER ? 4 : o->kind == PAKV_OP_ATTENTION ? 3 : 2;
  if (i >= typed) return PAKV_ONNX_UNDEFINED;
  return PAKV_CACHE_DTYPES[i % 2 == 0 ? o->key_dtype : o->value_dtype].onnx_type;
}
static size_t op_input_count(const PakvOrtCustomOp* op) { return INPUT_COUNT[((const pakv_op*)op)->kind]; }
static int op_output_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  return PAKV_CACHE_DTYPES[i == 0 ? o->key_dtype : o->value_dtype].onnx_type;
}
static size_t op_output_count(const PakvOrtCustomOp* op) { return OUTPUT_COUNT[((const pakv_op*)op)->kind]; }
static int op_input_char(const PakvOrtCustomOp* op, size_t i) {
  return ((const pakv_op*)op)->kind == PAKV_OP_GATHER && i == 4 ? PAKV_ORT_OPTIONAL : PAKV_ORT_REQUIRED;
}
static int op_output_char(const PakvOrtCustomOp* op, size_t i) { (void)op; (void)i; return PAKV_ORT_REQUIRED; }
static int op_mem_type(const PakvOrtCustomOp* op, size_t i) {
  const pakv_op* o = (const pakv_op*)op;
  return pakv_ep_input_memory_type(o->ep, o->kind, i); /* a device entry's index inputs on the host */
}
static int op_min_arity(const PakvOrtCustomOp* op) { (void)op; return 1; }
static int op_homogeneity(const PakvOrtCustomOp* op) { (void)op; return 0; }
static int op_opset_version(const PakvOrtCustomOp* op) { (void)op; return PAKV_OPSET_VERSION; }
/* The scatter's alias map (ORT >= 1.18 reads it): key_cache (input 2) is key_cache_out (output 0),
 * value_cache (3) is value_cache_out (1). Static arrays: ReleaseAliasMap has nothing to free. */
static int g_alias_inputs[2] = {2, 3}, g_alias_outputs[2] = {0, 1};
static size_t scatter_alias_map(int** inputs, int** outputs) {
  *inputs = g_alias_inputs;
  *outputs = g_alias_outputs;
  return 2;
}
static void release_alias_map(int* inputs, int* outputs) { (void)inputs; (void)outputs; }

static OrtStatus* kernel_create(const PakvOrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  int nz = 0, kind = ((const pakv_op*)op)->kind;
  int64_t cumsum = 1;
  float scale = 0.0f;
  OrtStatus* st = kind == PAKV_OP_ATTENTION ? read_scale(api, info, &scale) : read_cache_mode(api, info, pakv_op_type(kind), &nz);
  if (!st && kind == PAKV_OP_GATHER) st = read_cumsum(api, info, &cumsum);
  if (st) return st;
  pakv_kernel* k = (pakv_kernel*)calloc(1, sizeof(pakv_kernel));
  if (!k) return make_status(api, PAKV_ORT_FAIL, "pakv: out of memory creating the kernel");
  k->api = api;
  k->kind = kind;
  k->backend = ((const pakv_op*)op)->backend;
  k->ep = ((const pakv_op*)op)->ep;
  k->parallel_for = ((const pakv_op*)op)->parallel_for;
  k->nz = nz;
  k->cumsum = cumsum;
  k->scale = scale;
  *out = k;
  return NULL;
}

static void kernel_destroy(void* kernel) { free(kernel); }

/* ------------------------------------------------------------------------------------------- */
/* Compute: ORT's tensors -> the validator's records -> the copy core (or a Python backend)    */
/* ------------------------------------------------------------------------------------------- */
/* Input i as a record (absent beyond the node's input count or when ORT passes none). ORT tensors
 * are dense; on the CPU execution provider every input is host memory, on a device EP its memory
 * info says where it is. */
static int read_input(const OrtApi* api, OrtKernelContext* ctx, const pakv_kernel* k, size_t count, size_t i,
                      pakv_tensor* t,
                      pakv_err* err) {
  memset(t, 0, sizeof(*t));
  if (i >= count) return 0;
  const OrtValue* v = NULL;
  char what[64];
  snprintf(what, sizeof(what), "reading input %s", INPUT_NAMES[k->kind][i]);
  if (take_status(api, PAKV_API(api, KernelContext_GetInput)(ctx, i, &v), err, what)) return -1;
  if (!v) return 0;
  OrtTensorTypeAndShapeInfo* info = NULL;
  if (take_status(api, PAKV_API(api, GetTensorTypeAndShape)(v, &info), err, what)) return -1;
  int type = 0;
  size_t nd = 0;
  int64_t dims[PAKV_MAX_RANK] = {0};
  int rc = take_status(api, PAKV_API(api, GetTensorElementType)(info, &type), err, what);
  if (!rc) rc = take_status(api, PAKV_API(api, GetDimensionsCount)(info, &nd), err, what);
  /* A rank past the record's is kept as a rank alone: the validator refuses it by name. */
  if (!rc && nd <= PAKV_MAX_RANK) rc = take_status(api, PAKV_API(api, GetDimensions)(info, dims, nd), err, what);
  PAKV_API(api, ReleaseTensorTypeAndShapeInfo)(info);
  if (rc) return -1;
  void* data = NULL;
  if (take_status(api, PAKV_API(api, GetTensorMutableData)((OrtValue*)v, &data), err, what)) return -1;
  pakv_dense_record(t, data, type, (int)nd, dims, "cpu");
  t->host_data = data;
  return k->ep == PAKV_EP_CPU ? 0 : pakv_ep_locate(api, k->ep, v, t, err);
}

void* pakv_ort_output(const OrtApi* api, OrtKernelContext* ctx, int index, const int64_t* dims, int ndim,
                      pakv_err* err) {
  OrtValue* out = NULL;
  void* data = NULL;
  const char* what = index == 0 ? "allocating output 0" : "allocating output 1";
  if (take_status(api, PAKV_API(api, KernelContext_GetOutput)(ctx, (size_t)index, dims, (size_t)ndim, &out), err,
                  what))
    return NULL;
  if (take_status(api, PAKV_API(api, GetTensorMutableData)(out, &data), err, what)) return NULL;
  if (!data) {
    /* An empty output may have no buffer; callers never write through it. */
    static char empty;
    data = &empty;
  }
  return data;
}

/* int64 scratch of `len` entries, or NULL (then len becomes -1): when it cannot be had the
 * validator still checks the call's shapes first and then says there is no room, so every
 * refusal keeps its order. */
static int64_t* alloc_scratch(int64_t* len) {
  int64_t bytes = 0;
  int64_t* scratch = NULL;
  if (*len >= 0 && !pakv_mul(*len > 0 ? *len : 1, (int64_t)sizeof(int64_t), &bytes)) scratch = (int64_t*)malloc((size_t)bytes);
  if (!scratch) *len = -1;
  return scratch;
}

/* Output i of the call as a dense record on this EP (the buffer ORT hands back: a host may have
 * bound it to any buffer, so it is validated like an input). */
static int output_record_of(const pakv_kernel* k, OrtKernelContext* ctx, int i, int elem_type, const int64_t* dims,
                            int rank, const char* device, pakv_tensor* t, pakv_err* err) {
  void* data = pakv_ort_output(k->api, ctx, i, dims, rank, err);
  if (!data) return -1;
  pakv_dense_record(t, data, elem_type, rank, dims, device); /* ORT allocates them on the entry's device */
  return 0;
}

/* Gather: validate, take ORT's outputs and validate them too, before anything is written; copy. */
static int run_gather(const pakv_kernel* k, OrtKernelContext* ctx, pakv_tensor* records, pakv_err* err) {
  pakv_plan plan;
  int64_t len = pakv_gather_scratch_len(records);
  int64_t* scratch = alloc_scratch(&len);
  int rc = pakv_validate_gather(records, k->nz, (int)k->cumsum, &plan, scratch, len, err);
  for (int i = 0; !rc && i < PAKV_NUM_OUTPUTS; i++)
    rc = output_record_of(k, ctx, i, records[i].elem_type, i == 0 ? plan.key_out_dims : plan.value_out_dims,
                          plan.out_rank, records[PAKV_GATHER_KEY_CACHE].device, &records[PAKV_GATHER_KEY_OUT + i], err);
  if (!rc) rc = pakv_validate_gather_outputs(records, &plan, err);
  if (!rc) {
    plan.key_out = (void*)records[PAKV_GATHER_KEY_OUT].data;
    plan.value_out = (void*)records[PAKV_GATHER_VALUE_OUT].data;
    rc = pakv_ep_run_plan(k->api, ctx, k->ep, k->parallel_for, &plan, err);
  }
  free(scratch);
  return rc;
}

/* Bytes of a dense record (its dims' product x element size; the validator checked its extent). */
static int64_t dense_bytes(const pakv_tensor* t) {
  int64_t bytes = PAKV_CACHE_DTYPES[pakv_dtype_index(t->elem_type)].itemsize;
  for (int d = 0; d < t->ndim; d++) bytes *= t->dims[d];
  return bytes;
}

/* Scatter: validate; the updated caches are the buffers ORT hands back. When one is its input's
 * own buffer (the alias map, ORT >= 1.18, when it feeds later nodes; or a host that bound the
 * output to the input's buffer, as ORT GenAI does) only the T rows are written; otherwise the
 * cache is copied there first (correct, and the slow case: the whole pool per call). */
static int run_scatter(const pakv_kernel* k, OrtKernelContext* ctx, pakv_tensor* records, pakv_err* err) {
  pakv_scatter_plan plan;
  int64_t len = pakv_scatter_scratch_len(records);
  int64_t* scratch = alloc_scratch(&len);
  int rc = pakv_validate_scatter(records, k->nz, &plan, scratch, len, err);
  for (int i = 0; !rc && i < PAKV_NUM_OUTPUTS; i++) {
    const pakv_tensor* cache = &records[PAKV_SCATTER_KEY_CACHE + i];
    rc = output_record_of(k, ctx, i, cache->elem_type, cache->dims, cache->ndim, cache->device,
                          &records[PAKV_SCATTER_KEY_CACHE_OUT + i], err);
  }
  if (!rc) rc = pakv_validate_scatter_outputs(records, err);
  for (int i = 0; !rc && i < PAKV_NUM_OUTPUTS; i++) {
    const pakv_tensor *cache = &records[PAKV_SCATTER_KEY_CACHE + i], *out = &records[PAKV_SCATTER_KEY_CACHE_OUT + i];
    if (out->data != cache->data)
      rc = pakv_ep_copy(k->api, ctx, k->ep, (void*)out->data, cache->data, dense_bytes(cache), err);
    if (i == 0)
      plan.key_cache = (void*)out->data;
    else
      plan.value_cache = (void*)out->data;
  }
  if (!rc) rc = pakv_ep_run_scatter(k->api, ctx, k->ep, &plan, err);
  free(scratch);
  return rc;
}

/* Attention: validate, take ORT's output and validate it too, then attend (CPU: ORT's pool). */
static int run_attention(const pakv_kernel* k, OrtKernelContext* ctx, pakv_tensor* records, pakv_err* err) {
  pakv_attention_plan plan;
  int64_t len = pakv_attention_scratch_len(records);
  int64_t* scratch = alloc_scratch(&len);
  int rc = pakv_validate_attention(records, k->scale, &plan, scratch, len, err);
  if (!rc) {
    int64_t dims[3] = {plan.num_tokens, plan.num_heads, plan.value_head_dim};
    rc = output_record_of(k, ctx, 0, records[PAKV_ATTENTION_QUERY].elem_type, dims, 3,
                          records[PAKV_ATTENTION_QUERY].device, &records[PAKV_ATTENTION_OUT], err);
  }
  if (!rc) rc = pakv_validate_attention_output(records, &plan, err);
  if (!rc) {
    plan.out = (void*)records[PAKV_ATTENTION_OUT].data;
    rc = pakv_ep_run_attention(k->api, ctx, k->ep, k->parallel_for, &plan, err);
  }
  free(scratch);
  return rc;
}

/* The status of a failed call: the validator's kind leads the message, as the Python front raises it. */
static OrtStatus* call_error(const OrtApi* api, const pakv_err* err) {
  char msg[PAKV_ERR_LEN + 16];
  snprintf(msg, sizeof(msg), "%s: %s", err->kind == PAKV_ERR_TYPE ? "TypeError" : "ValueError", err->msg);
  return make_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
}

static OrtStatus* kernel_compute(void* kernel, OrtKernelContext* ctx) {
  const pakv_kernel* k = (const pakv_kernel*)kernel;
  const OrtApi* api = k->api;
  pakv_request* req = (pakv_request*)calloc(1, sizeof(pakv_request));
  pakv_tensor* records = (pakv_tensor*)calloc(PAKV_GATHER_RECORDS, sizeof(pakv_tensor)); /* = every op's */
  OrtStatus* result = NULL;
  pakv_err err = {PAKV_ERR_VALUE, {0}};
  size_t count = 0;
  int rc = !req || !records ? pakv_fail(&err, "pakv: out of memory") : 0;
  if (!rc)
    rc = take_status(api, PAKV_API_AS(api, KernelContext_GetInputCount, KernelContext_GetCount)(ctx, &count), &err,
                     "counting inputs");
  for (size_t i = 0; !rc && i < INPUT_COUNT[k->kind]; i++) rc = read_input(api, ctx, k, count, i, &records[i], &err);
  if (!rc && k->backend != PAKV_NATIVE_BACKEND) rc = pakv_ep_stream(api, ctx, k->ep, &req->stream, &err);
  if (!rc && k->backend != PAKV_NATIVE_BACKEND) {
    memcpy(req->inputs, records, sizeof(req->inputs));
    req->op = pakv_op_type(k->kind);
    req->cache_mode = k->nz ? "PA_NZ" : "Norm";
    req->is_seq_lens_cumsum = k->cumsum;
    req->scale = k->scale;
    req->num_inputs = (int32_t)INPUT_COUNT[k->kind];
    req->ctx = ctx;
    req->api = api;
    if (pakv_call_python(k->backend, req)) result = make_status(api, PAKV_ORT_INVALID_ARGUMENT, req->error);
  } else if (!rc) {
    rc = k->kind == PAKV_OP_SCATTER     ? run_scatter(k, ctx, records, &err)
         : k->kind == PAKV_OP_ATTENTION ? run_attention(k, ctx, records, &err)
                                        : run_gather(k, ctx, records, &err);
  }
  if (rc) result = call_error(api, &err);
  free(records);
  free(req);
  return result;
}

/* ------------------------------------------------------------------------------------------- */
/* Registration                                                                                */
/* ------------------------------------------------------------------------------------------- */
static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static pakv_op* g_ops[PAKV_MAX_BACKENDS];                /* PAKV_NUM_OPS ops per backend, never freed */
static OrtCustomOpDomain* g_domains[PAKV_MAX_BACKENDS];  /* one domain per backend, reused (no leak per call) */
/* The backend the next RegisterCustomOps call on this thread binds to. Thread-local: a raw
 * registration on another thread always gets native, and cannot take a backend chosen here. */
static _Thread_local int g_next_backend = PAKV_NATIVE_BACKEND;

PAKV_EXPORT int pakv_bind_next_registration(const char* name) {
  int slot = name ? pakv_backend_slot(name) : PAKV_NATIVE_BACKEND;
  g_next_backend = slot < 0 ? PAKV_NATIVE_BACKEND : slot;
  return slot;
}

static size_t no_inplace(int** inputs, int** outputs) {
  *inputs = *outputs = NULL;
  return 0;
}

/* Every op of `backend` (PAKV_NUM_OPS, ordered as PAKV_NUM_OPS says). `api` is the runtime's API
 * version: it reads the opset range and has ParallelFor from 17, reads the scatter's alias map
 * from 18. */
static void init_ops(pakv_op* ops, int backend, int api) {
  for (int n = 0; n < PAKV_NUM_OPS; n++) {
    pakv_op* o = &ops[n];
    int ep = n / (PAKV_NUM_OP_KINDS * PAKV_NUM_PAIRS), kind = (n / PAKV_NUM_PAIRS) % PAKV_NUM_OP_KINDS;
    int d = n % PAKV_NUM_PAIRS;
    if (n >= PAKV_NUM_CACHE_OPS) { /* PagedAttention: CPU, one dtype for every tensor it types */
      int dtype = ATTENTION_DTYPES[n - PAKV_NUM_CACHE_OPS];
      ep = PAKV_EP_CPU;
      kind = PAKV_OP_ATTENTION;
      d = dtype * PAKV_NUM_DTYPES + dtype;
    }
    memset(o, 0, sizeof(*o));
    o->base.version = api >= PAKV_ORT_API_OPSET_RANGE ? PAKV_ORT_API_OPSET_RANGE : PAKV_ORT_API_VERSION;
    if (kind == PAKV_OP_SCATTER && api >= PAKV_ORT_API_ALIAS_MAP) {
      o->base.version = PAKV_ORT_API_ALIAS_MAP;
      o->base.GetMayInplace = no_inplace;
      o->base.ReleaseMayInplace = release_alias_map;
      o->base.GetAliasMap = scatter_alias_map;
      o->base.ReleaseAliasMap = release_alias_map;
    }
    o->base.GetName = op_name;
    o->base.GetExecutionProviderType = op_ep;
    o->base.GetInputType = op_input_type;
    o->base.GetInputTypeCount = op_input_count;
    o->base.GetOutputType = op_output_type;
    o->base.GetOutputTypeCount = op_output_count;
    o->base.KernelDestroy = kernel_destroy;
    o->base.GetInputCharacteristic = op_input_char;
    o->base.GetOutputCharacteristic = op_output_char;
    o->base.GetInputMemoryType = op_mem_type;
    o->base.GetVariadicInputMinArity = op_min_arity;
    o->base.GetVariadicInputHomogeneity = op_homogeneity;
    o->base.GetVariadicOutputMinArity = op_min_arity;
    o->base.GetVariadicOutputHomogeneity = op_homogeneity;
    o->base.CreateKernelV2 = kernel_create;
    o->base.KernelComputeV2 = kernel_compute;
    o->base.GetStartVersion = op_opset_version; /* read by ORT only for version >= 17 */
    o->base.GetEndVersion = op_opset_version;
    o->kind = kind;
    o->key_dtype = d / PAKV_NUM_DTYPES;
    o->value_dtype = d % PAKV_NUM_DTYPES;
    o->backend = backend;
    o->ep = ep;
    o->parallel_for = api >= PAKV_ORT_API_PARALLEL_FOR;
  }
}

/* The runtime's API version from its version string ("1.16.3" -> 16: ORT 1.x ships API x).
 * Parsed rather than probed with GetApi(17), which prints an error on older runtimes. */
static int runtime_api_version(const OrtApiBase* base) {
  const char* v = base->GetVersionString ? base->GetVersionString() : NULL;
  long major = 0, minor = 0;
  if (!v || sscanf(v, "%ld.%ld", &major, &minor) != 2) return PAKV_ORT_API_VERSION;
  return major > 1 ? 1000 : (int)minor;
}

/* The domain of `backend`, created on first use (caller holds g_reg_lock). */
static OrtStatus* backend_domain(const OrtApi* api, const OrtApiBase* base, int backend, OrtCustomOpDomain** out) {
  if (g_domains[backend]) {
    *out = g_domains[backend];
    return NULL;
  }
  if (!g_ops[backend]) {
    pakv_op* ops = (pakv_op*)calloc(PAKV_NUM_OPS, sizeof(pakv_op));
    if (!ops) return make_status(api, PAKV_ORT_FAIL, "pakv: out of memory registering the ops");
    init_ops(ops, backend, runtime_api_version(base));
    g_ops[backend] = ops;
  }
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* st = PAKV_API(api, CreateCustomOpDomain)(PAKV_DOMAIN, &domain);
  for (int n = 0; !st && n < PAKV_NUM_OPS; n++) st = PAKV_API(api, CustomOpDomain_Add)(domain, &g_ops[backend][n]);
  if (st) return st; /* a half-built domain is not kept (ORT owns nothing of it yet; it is leaked once) */
  g_domains[backend] = *out = domain;
  return NULL;
}

/* A second registration on the same SessionOptions would make ORT fail at session creation with
 * "Domain already set in registry"; refuse it here, saying what to do. */
static OrtStatus* mark_options(const OrtApi* api, OrtSessionOptions* options, int backend) {
  int has = 0;
  OrtStatus* st = PAKV_API(api, HasSessionConfigEntry)(options, PAKV_CONFIG_KEY, &has);
  if (st) return st;
  if (has) {
    char prev[PAKV_BACKEND_NAME_LEN + 8] = "?";
    size_t size = sizeof(prev);
    st = PAKV_API(api, GetSessionConfigEntry)(options, PAKV_CONFIG_KEY, prev, &size);
    if (st) PAKV_API(api, ReleaseStatus)(st);
    prev[sizeof(prev) - 1] = 0;
    char msg[512];
    snprintf(msg, sizeof(msg),
             "the pakv GatherPaKvCache library is already registered on these SessionOptions (backend '%s'); "
             "register it once per SessionOptions (every session made from them can use it), or use a new "
             "SessionOptions for backend '%s'",
             prev, pakv_backend_name(backend));
    return make_status(api, PAKV_ORT_INVALID_ARGUMENT, msg);
  }
  return PAKV_API(api, AddSessionConfigEntry)(options, PAKV_CONFIG_KEY, pakv_backend_name(backend));
}

PAKV_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  int backend = g_next_backend;
  g_next_backend = PAKV_NATIVE_BACKEND; /* one registration per selection; hosts that never select get native */
  const OrtApi* api = api_base->GetApi(PAKV_ORT_API_VERSION);
  if (!api) {
    /* Older runtime: find any API table to report the error with (CreateStatus is slot 0 in all). */
    for (uint32_t v = PAKV_ORT_API_VERSION - 1; v >= 1 && !api; v--) api = api_base->GetApi(v);
    if (!api) return NULL; /* cannot even report; ORT this old has no usable API */
    char msg[256];
    snprintf(msg, sizeof(msg),
             "pakv GatherPaKvCache plugin needs ONNX Runtime >= 1.16 (C API version %d); this runtime is %s",
             PAKV_ORT_API_VERSION, api_base->GetVersionString ? api_base->GetVersionString() : "older");
    return make_status(api, PAKV_ORT_FAIL, msg);
  }
  OrtStatus* st = mark_options(api, options, backend);
  if (st) return st;
  OrtCustomOpDomain* domain = NULL;
  pthread_mutex_lock(&g_reg_lock);
  st = backend_domain(api, api_base, backend, &domain);
  pthread_mutex_unlock(&g_reg_lock);
  if (st) return st;
  return PAKV_API(api, AddCustomOpDomain)(options, domain);
}
